"""Whole-model compression on small random-weight ViTs."""

import copy

import pytest
import timm
import torch

from corp_deploy import CompressConfig, PrunedAttention, compress, count_macs, count_params
from corp_deploy.errors import CorpError
from corp_deploy.methods.corp.qk_statistics import HeadGrams


@pytest.mark.parametrize("mode", ["sequential", "independent"])
@pytest.mark.parametrize("target", ["mlp", "attn", "both"])
def test_zero_sparsity_reproduces_the_dense_model(vit, batches, mode, target, image_batches):
    x = image_batches(1, 4, seed=7)[0]
    model, report = compress(
        vit, batches, CompressConfig.from_settings(s_mlp=0.0, s_attn=0.0, target=target, calibration=mode)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=1e-5, atol=1e-5)
    assert report["params"]["compressed"] == report["params"]["dense"]


def test_input_model_is_left_unchanged(vit, batches):
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    compress(vit, batches, CompressConfig(s_mlp=0.5, s_attn=0.5))
    after = vit.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_in_place_compresses_the_given_model_into_the_same_result(vit, batches):
    """``in_place=True`` (what the CLI does, to hold one copy of the weights) returns the given model
    itself, compressed exactly as a copy would be."""
    config = CompressConfig.from_settings(s_mlp=0.5, s_attn=0.5)
    copied, _ = compress(vit, batches, config)
    given = copy.deepcopy(vit)
    model, _ = compress(given, batches, config, in_place=True)
    assert model is given
    expected = copied.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("settings", [dict(s_mlp=0.5, s_attn=0.5), dict(macs=0.5)], ids=["uniform", "budget"])
def test_query_key_sums_in_either_form_give_the_same_model(vit, batches, image_batches, monkeypatch, settings):
    """Past a number of images the per-image query/key Grams are replaced by their Kronecker sums
    (corp_deploy/methods/corp/qk_statistics.py HeadGrams): forced from the first image, compress keeps the same dims and
    the outputs agree to float64 summation order (below float32's resolution)."""
    config = CompressConfig.from_settings(**settings)
    by_image, report = compress(vit, batches, config)
    monkeypatch.setattr(HeadGrams, "_image_limit", lambda self: 0)
    forms, heads = [], HeadGrams.heads
    monkeypatch.setattr(HeadGrams, "heads", lambda self: forms.append(self.kronecker is not None) or heads(self))
    summed, summed_report = compress(vit, batches, config)
    assert forms and all(forms)
    assert [layer["dims"] for layer in report["layers"]] == [layer["dims"] for layer in summed_report["layers"]]
    x = image_batches(1, 4, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(summed(x), by_image(x), rtol=1e-5, atol=1e-5)


def test_compensation_lowers_every_layer_error_and_output_error(vit, batches, image_batches):
    x = image_batches(2, 8, seed=9)
    comp, report = compress(vit, batches, CompressConfig.from_settings(s_mlp=0.5, s_attn=0.5, ridge=1e-2))
    sliced, report_sliced = compress(vit, batches, CompressConfig(s_mlp=0.5, s_attn=0.5, compensation=False))
    for layer in report["layers"]:
        assert layer["mlp"]["error_compensated"] < layer["mlp"]["error_uncompensated"]
        assert layer["attention"]["error_compensated"] < layer["attention"]["error_uncompensated"]
    with torch.no_grad():
        dense = torch.cat([vit.forward_features(b) for b in x])
        err_c = (torch.cat([comp.forward_features(b) for b in x]) - dense).pow(2).mean()
        err_s = (torch.cat([sliced.forward_features(b) for b in x]) - dense).pow(2).mean()
    assert err_c < err_s
    # with statistics from the dense model, the kept channels do not depend on compensation
    cfg = dict(s_mlp=0.5, s_attn=0.5, calibration="independent")
    comp, _ = compress(vit, batches, CompressConfig.from_settings(**cfg))
    sliced, _ = compress(vit, batches, CompressConfig.from_settings(**cfg, compensation=False))
    for b1, b2 in zip(comp.blocks, sliced.blocks):
        assert b1.mlp.fc1.weight.shape == b2.mlp.fc1.weight.shape
        torch.testing.assert_close(b1.mlp.fc1.weight, b2.mlp.fc1.weight, rtol=0, atol=0)


def test_modes_agree_on_first_block_and_differ_after(vit, batches):
    cfg = dict(s_mlp=0.5, s_attn=0.5)
    seq, _ = compress(vit, batches, CompressConfig.from_settings(**cfg, calibration="sequential"))
    ind, _ = compress(vit, batches, CompressConfig.from_settings(**cfg, calibration="independent"))
    # block 0: attention identical (both see dense inputs); its MLP differs (sequential
    # takes MLP statistics after the compressed attention)
    torch.testing.assert_close(seq.blocks[0].attn.qkv.weight, ind.blocks[0].attn.qkv.weight)
    assert not torch.allclose(seq.blocks[0].mlp.fc2.weight, ind.blocks[0].mlp.fc2.weight)


def test_round_to_and_split_sparsities(vit, batches):
    model, report = compress(vit, batches, CompressConfig(s_mlp=0.3, s_attn=0.5, round_to=8))
    for block in model.blocks:
        assert block.mlp.fc1.out_features == 136  # 192 - 58 = 134 -> nearest multiple of 8
        assert block.attn.qk_head_dim == 8 and block.attn.v_head_dim == 16


def test_target_mlp_keeps_timm_attention(vit, batches):
    model, _ = compress(vit, batches, CompressConfig(s_mlp=0.5, target="mlp"))
    assert all(type(b.attn).__name__ == "Attention" for b in model.blocks)
    assert all(b.mlp.fc1.out_features == 96 for b in model.blocks)


def test_distilled_deit_and_register_tokens(batches):
    for name, size in (("deit_tiny_distilled_patch16_224", 32), ("vit_small_patch14_reg4_dinov2", 28)):
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, img_size=size, depth=2, num_classes=10).eval()
        imgs = [torch.randn(4, 3, size, size) for _ in range(2)]
        out, report = compress(model, imgs, CompressConfig(s_mlp=0.5, s_attn=0.25))
        assert report["calibration"]["tokens_per_image"] == model.patch_embed.num_patches + model.num_prefix_tokens
        with torch.no_grad():
            assert out(imgs[0]).shape == (4, 10)


def test_hand_counted_shapes_params_and_macs_for_deit_tiny_at_half_sparsity():
    torch.manual_seed(0)
    dense = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    images = [torch.randn(2, 3, 224, 224)]
    model, report = compress(dense, images, CompressConfig(s_mlp=0.5, s_attn=0.5))
    C, heads, d, hidden, T, depth, classes = 192, 3, 64, 768, 197, 12, 1000
    kq, kh = 32, 384
    for block in model.blocks:
        assert isinstance(block.attn, PrunedAttention)
        assert block.attn.qkv.weight.shape == (heads * (2 * kq + d), C)
        assert block.attn.proj.weight.shape == (C, heads * d)
        assert block.mlp.fc1.weight.shape == (kh, C) and block.mlp.fc2.weight.shape == (C, kh)
    removed_per_block = (hidden - kh) * (C + 1) + (hidden - kh) * C + 2 * heads * (d - kq) * (C + 1)
    assert report["params"]["dense"] == 5_717_416
    assert report["params"]["compressed"] == 5_717_416 - depth * removed_per_block

    def macs(qk, hid):
        per_block = T * C * heads * (2 * qk + d) + heads * T * T * (qk + d) + T * heads * d * C + 2 * T * C * hid
        return 196 * C * 3 * 16 * 16 + depth * per_block + C * classes

    assert report["macs"]["dense"] == macs(d, hidden) == count_macs(dense, (3, 224, 224))
    assert report["macs"]["compressed"] == macs(kq, kh)
    assert count_params(model) == report["params"]["compressed"]


def test_bad_calibration_input(vit):
    with pytest.raises(CorpError, match="empty"):
        compress(vit, [], CompressConfig())
    with pytest.raises(CorpError, match="NaN"):
        compress(vit, [torch.full((2, 3, 32, 32), float("nan"))], CompressConfig())
    with pytest.raises(CorpError, match="shape"):
        compress(vit, [torch.zeros(3, 32, 32)], CompressConfig())
    with pytest.raises(CorpError, match="differ in image size"):
        compress(vit, [torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 48, 48)], CompressConfig())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(s_mlp=1.0),
        dict(s_attn=-0.1),
        dict(target="x"),
        dict(ranker="x"),
        dict(ridge=-1.0),
        dict(round_to=0),
        dict(calibration="x"),
        dict(device="tpu"),
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(CorpError):
        CompressConfig.from_settings(**kwargs)


def test_unsupported_structures_are_refused(batches, small_vit):
    gated = small_vit(qk_norm=True)
    with pytest.raises(CorpError, match="query/key or value pruning"):
        compress(gated, batches, CompressConfig(target="both"))
    compress(gated, batches, CompressConfig(target="mlp"))  # MLP-only still works


def test_phase_timer_waits_for_the_gpu_at_both_ends_of_a_phase(monkeypatch):
    """Kernels are queued asynchronously on a GPU: without a wait at each boundary a phase's
    kernels would be charged to the next phase that waits. Stand-in clock and synchronize."""
    from corp_deploy import engine

    events, clock = [], iter([1.0, 3.5, 10.0, 10.25])
    monkeypatch.setattr(engine.torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(engine.time, "perf_counter", lambda: next(clock))
    timer = engine._PhaseTimer(torch.device("cuda", 1))
    with timer("solve"):
        events.append(("work",))
    assert events == [("sync", "cuda:1"), ("work",), ("sync", "cuda:1")]
    cpu_timer = engine._PhaseTimer(torch.device("cpu"))
    with cpu_timer("solve"):
        pass
    assert len(events) == 3  # no wait on the CPU
    assert timer.totals() == {"solve": 2.5, "total": 2.5} and cpu_timer.totals() == {"solve": 0.25, "total": 0.25}
