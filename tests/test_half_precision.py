"""PyTorch in half precision and the attention kernels it runs: the torch runners in bf16 (fp16 is
CUDA's), the kernel each attention call dispatched to, head dims the fused kernels refuse, and
``bench --torch-precision`` end to end (the CPU-runnable parts of issue 46)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.attention_kernels import attention_kernels, kernel_summary, lost_fused_kernels
from benchmarks.results import BenchReport, BenchSettings
from corp_deploy import CompressConfig, CorpError, compress
from corp_deploy.layers import block_head_dims, unfusable_heads, unfusable_heads_text
from exporters.runners import BackendUnavailable, TorchRunner
from tests.helpers import SMALL_VIT_CLI_ARGS

FAST = ["--backends", "torch", "--batch", "2", "--min-time", "0.02", "--warmup", "1", "--data-samples", "4"]


def test_a_bf16_runner_runs_a_cast_copy_and_returns_float32(small_vit, image_batches):
    model = small_vit()
    x = image_batches(1, 4)[0]
    with torch.no_grad():
        expected = model(x).numpy()
    with TorchRunner(model, "cpu", "bf16") as runner:
        assert runner.model is not model and runner.model.patch_embed.proj.weight.dtype == torch.bfloat16
        out = runner.infer(x.numpy())
    assert model.patch_embed.proj.weight.dtype == torch.float32  # the caller's module is untouched
    assert out.dtype == np.float32 and out.shape == expected.shape
    cosine = F.cosine_similarity(torch.from_numpy(out), torch.from_numpy(expected)).min().item()
    assert 0.99 < cosine < 1 - 1e-7  # rounded to bf16's 8 bits, so close but not equal
    with pytest.raises(BackendUnavailable, match="fp16 is timed on CUDA only"):
        TorchRunner(model, "cpu", "fp16")


def test_each_attention_call_is_named_by_the_kernel_it_ran(small_vit, image_batches):
    model, x = small_vit(), image_batches(1, 2)[0]
    depth = len(model.blocks)
    with sdpa_kernel([SDPBackend.MATH]):
        assert attention_kernels(model, x) == ["math"] * depth
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert attention_kernels(model, x) == ["flash"] * depth
    for block in model.blocks:  # timm's own unfused attention: no SDPA call at all
        block.attn.fused_attn = False
    assert attention_kernels(model, x) == []
    assert kernel_summary([]) == "no SDPA call"
    assert kernel_summary(["cudnn", "cudnn", "math", "cudnn"]) == "cudnn x3, math x1"


def test_unequal_head_dims_lose_the_flash_kernel_and_bench_says_so(small_vit, batches):
    """CORP's default prunes query/key heads only (8 of 16 dims, values keep 16): flash refuses
    them, so with flash or math allowed the compressed model runs math where the dense runs flash."""
    dense = small_vit()
    compressed, _ = compress(dense, batches, CompressConfig.from_settings(sparsity=0.5))
    assert {(b.attn.qk_head_dim, b.attn.v_head_dim) for b in compressed.blocks} == {(8, 16)}
    x = batches[0][:2]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        seen = {
            name: kernel_summary(attention_kernels(m, x)) for name, m in (("dense", dense), ("compressed", compressed))
        }
    assert seen == {"dense": "flash x2", "compressed": "math x2"}
    assert lost_fused_kernels({"torch-cpu": seen}) == {
        "torch-cpu": "the compressed model's attention runs math x2, the dense model's flash x2"
    }
    assert lost_fused_kernels({"torch-cpu": {"dense": "flash x2", "compressed": "cudnn x2"}}) == {}


def test_head_dims_pruned_to_sizes_that_are_not_multiples_of_8_are_found(small_vit, batches):
    """16 head dims at s = 0.3 keep 11 (no fused kernel on CUDA takes them); --round-to 8 keeps 8."""
    dense = small_vit()
    dense_dims = block_head_dims(dense)
    assert dense_dims == {0: (16, 16), 1: (16, 16)}
    odd, _ = compress(dense, batches, CompressConfig.from_settings(sparsity=0.3))
    assert unfusable_heads(odd, dense_dims) == {0: (11, 16), 1: (11, 16)}
    assert "(block 0: 11/16, block 1: 11/16)" in unfusable_heads_text(unfusable_heads(odd, dense_dims))
    assert "--round-to 8" in unfusable_heads_text(unfusable_heads(odd, dense_dims))
    aligned, _ = compress(dense, batches, CompressConfig.from_settings(sparsity=0.3, round_to=8))
    assert unfusable_heads(aligned, dense_dims) == {} and unfusable_heads(dense, dense_dims) == {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert attention_kernels(odd, batches[0][:2]) == ["math", "math"]


def test_a_base_models_own_head_dims_are_not_blamed_on_compression(small_vit, batches):
    """Head dims of 12 (48 wide, 4 heads) are the base model's: unpruned (--target mlp, or the value
    dims left whole) they are not counted; query/key pruned to 6 are, to 8 are not."""
    dense = small_vit(num_heads=4)
    dense_dims = block_head_dims(dense)
    assert dense_dims == {0: (12, 12), 1: (12, 12)}
    for settings, expected in (
        ({"sparsity": 0.5, "target": "mlp"}, {}),
        ({"sparsity": 0.5, "round_to": 8}, {}),  # 8/12: the 12 is the dense value dim
        ({"sparsity": 0.5}, {0: (6, 12), 1: (6, 12)}),
    ):
        compressed, _ = compress(dense, batches, CompressConfig.from_settings(**settings))
        assert unfusable_heads(compressed, dense_dims) == expected, settings


def test_bench_in_bf16_records_precision_parity_and_kernels(tiny_artifact, tmp_path, run_cli):
    result, text = run_cli(["bench", tiny_artifact, *FAST, "--torch-precision", "bf16", "-o", tmp_path / "b"], tmp_path)
    assert result.exit_code == 0, text
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert report["settings"]["torch_precision"] == "bf16"
    assert [row["backend"] for row in report["latency"]][0] == "torch-cpu"
    for model in ("dense", "compressed"):  # bf16 torch-cpu is compared with the fp32 reference
        parity = report["parity"][model]["torch-cpu"]
        assert 0.99 < parity["cosine"] < 1 and parity["max_abs"] > 0
    kernels = report["attention"]["torch-cpu"]
    assert set(kernels) == {"dense", "compressed"} and all(k.endswith("x2") for k in kernels.values())
    assert "PyTorch in bf16" in (tmp_path / "b" / "bench.md").read_text()
    assert f"attention kernels on torch-cpu: dense {kernels['dense']}" in text.replace("\n", " ")
    # a baseline timed in another precision measured other things
    result, text = run_cli(["bench", tiny_artifact, *FAST, "--baseline", tmp_path / "b" / "bench.json"], tmp_path)
    assert result.exit_code == 1 and "--torch-precision bf16 in the baseline, fp32 here" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp16_without_a_gpu_skips_every_torch_backend_with_the_reason(tiny_artifact, tmp_path, run_cli):
    result, text = run_cli(
        ["bench", tiny_artifact, *FAST, "--torch-precision", "fp16", "--json", tmp_path / "r.json"], tmp_path
    )
    assert result.exit_code == 0, text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["latency"] == [] and report["backends"]["torch-cpu"]["reason"].startswith("fp16 is timed on CUDA")
    assert "nothing was timed: every backend asked for was skipped" in " ".join(text.split())


def test_a_precision_bench_does_not_know_is_refused():
    """...also in a baseline; a baseline from before the precision was recorded ran fp32."""
    with pytest.raises(CorpError, match="torch_precision is one of fp32, fp16, bf16"):
        BenchSettings(torch_precision="fp64")
    report = {"format": "corp-deploy-bench", "latency": [], "fidelity": {}}
    with pytest.raises(CorpError, match="baseline is malformed: settings: torch_precision is one of"):
        BenchReport.from_dict({**report, "settings": {"torch_precision": "int4"}}, "baseline")
    assert BenchReport.from_dict({**report, "settings": {}}).settings.torch_precision == "fp32"


def test_compress_warns_about_head_dims_no_fused_kernel_takes(tmp_path, run_cli):
    common = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", 8, "--s", 0.3]
    result, text = run_cli([*common, "-o", tmp_path / "odd"], tmp_path / "state")
    assert result.exit_code == 0, text
    assert "pruned to sizes that are not multiples of 8 (block 0: 11/16, block 1: 11/16)" in " ".join(text.split())
    result, text = run_cli([*common, "--round-to", 8, "-o", tmp_path / "aligned"], tmp_path / "state")
    assert result.exit_code == 0 and "multiples of 8" not in text, text
