"""Every supported timm family, small and with random weights: compress (uniform sparsity and a
MAC budget), artifact round trip, ONNX export with ONNX Runtime parity, and params and MACs
against an independent count (torch's FlopCounterMode, which counts the aten ops)."""
import math

import pytest
import timm
import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from corp_deploy import CompressConfig, compress, count_macs, load_compressed, save_artifact
from exporters import ExportOptions, export_artifact

#: One small model per family: (timm name, creation arguments, image size).
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32),
    "hybrid-cnn-stem": ("vit_tiny_r_s16_p8_224", dict(img_size=64, depth=2, num_classes=10), 64),
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
    buffers = sum(b.numel() for b in model.buffers())
    assert report["params"]["compressed"] + buffers == stored
    loaded = load_compressed(artifact)
    with torch.no_grad():
        assert torch.equal(loaded(images[0]), model(images[0]))

    result = export_artifact(artifact, tmp_path / "out", ExportOptions())
    for numbers in result.manifest["models"]["model"]["parity"]["onnxruntime_vs_pytorch"].values():
        assert numbers["max_abs"] < 1e-4, numbers
