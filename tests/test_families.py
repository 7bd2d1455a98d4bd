"""Every supported timm family, small and with random weights: compress (uniform sparsity and a
MAC budget), artifact round trip, ONNX export with ONNX Runtime parity, and params and MACs
against an independent count (torch's FlopCounterMode, which counts the aten ops)."""
import math

import pytest
import timm
import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from corp_deploy import CompressConfig, PrunedAttention, compress, count_macs, load_compressed, save_artifact
from exporters import ExportOptions, export_artifact

#: One small model per family: (timm name, creation arguments, image size).
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32),
    "hybrid-cnn-stem": ("vit_tiny_r_s16_p8_224", dict(img_size=64, depth=2, num_classes=10), 64),
    "relpos": ("vit_relpos_small_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32),
}


def independent_macs(model: torch.nn.Module, image_size: int) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("config", [CompressConfig(s_mlp=0.5, s_attn=0.5), CompressConfig(macs=0.9)],
                         ids=["s0.5", "macs0.9"])
def test_family_compresses_round_trips_and_exports(family, config, tmp_path):
    name, kwargs, size = FAMILIES[family]
    torch.manual_seed(0)
    dense = timm.create_model(name, pretrained=False, **kwargs).eval()
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(8, 3, size, size, generator=generator) for _ in range(2)]
    model, report = compress(dense, images, config)

    assert report["macs"]["dense"] == independent_macs(dense, size)
    assert report["macs"]["compressed"] == independent_macs(model, size) == count_macs(model, (3, size, size))
    assert report["macs"]["compressed"] < report["macs"]["dense"]
    if config.macs is not None:
        assert report["macs"]["compressed"] <= config.macs * report["macs"]["dense"]

    artifact = save_artifact(model, tmp_path / "art", base_model={"name": name, "model_kwargs": kwargs,
                                                                 "weights": {"source": "random"}}, report=report)
    with safe_open(str(artifact / "model.safetensors"), "pt") as weights:
        stored = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    parameter_names = {name for name, _ in model.named_parameters()}
    buffers = sum(v.numel() for name, v in model.state_dict().items() if name not in parameter_names)
    assert report["params"]["compressed"] + buffers == stored
    loaded = load_compressed(artifact)
    with torch.no_grad():
        assert torch.equal(loaded(images[0]), model(images[0]))

    result = export_artifact(artifact, tmp_path / "out", ExportOptions())
    for numbers in result.manifest["models"]["model"]["parity"]["onnxruntime_vs_pytorch"].values():
        assert numbers["max_abs"] < 1e-4, numbers


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("config", [CompressConfig(target="all", s_mlp=0.0, s_attn=0.0, s_vo=0.0),
                                    CompressConfig(method="vbp", s_mlp=0.0),
                                    CompressConfig(method="toast", s_mlp=0.0, s_attn=0.0)], ids=["corp", "vbp", "toast"])
def test_every_method_at_zero_sparsity_reproduces_the_dense_model(family, config):
    """Nothing pruned: the compressed model of every method computes what the dense one does,
    whatever the family adds (a relative position bias, a CNN stem)."""
    name, kwargs, size = FAMILIES[family]
    torch.manual_seed(0)
    dense = timm.create_model(name, pretrained=False, **kwargs).eval()
    images = [torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(2))]
    model, _ = compress(dense, images, config)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [CompressConfig(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5),
                                    CompressConfig(method="toast", s_mlp=0.5, s_attn=0.5)], ids=["corp", "toast"])
def test_pruned_attention_keeps_the_relative_position_bias(config):
    name, kwargs, size = FAMILIES["relpos"]
    torch.manual_seed(0)
    dense = timm.create_model(name, pretrained=False, **kwargs).eval()
    model, _ = compress(dense, [torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(2))], config)
    for block, dense_block in zip(model.blocks, dense.blocks):
        assert isinstance(block.attn, PrunedAttention)
        torch.testing.assert_close(block.attn.logit_bias(), dense_block.attn.rel_pos.get_bias(), rtol=0, atol=0)
