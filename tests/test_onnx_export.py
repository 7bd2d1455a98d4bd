"""ONNX export of dense and compressed ViTs, checked against ONNX Runtime (first step of export)."""
import numpy as np
import onnx
import pytest
import torch

from corp_deploy import CompressConfig, compress
from exporters.onnx_export import export_onnx
from exporters.parity import compare_outputs, onnxruntime_outputs
from tests.conftest import image_batches, small_vit


@pytest.mark.parametrize("compressed", [False, True])
def test_onnx_runtime_parity_at_batch_sizes_other_than_traced(tmp_path, compressed):
    model = small_vit()
    if compressed:
        model, _ = compress(model, image_batches(2, 4), CompressConfig(s_mlp=0.5, s_attn=0.5))
    info = export_onnx(model, tmp_path / "m.onnx", (3, 32, 32), trace_batch=2)
    assert info["inputs"] == [{"name": "images", "shape": ["batch", 3, 32, 32]}]
    assert info["outputs"][0]["shape"][0] == "batch"
    onnx.checker.check_model(str(tmp_path / "m.onnx"))
    for batch in (1, 5):
        x = image_batches(1, batch, seed=batch)[0]
        with torch.no_grad():
            ref = model(x).numpy()
        result = compare_outputs(ref, onnxruntime_outputs(tmp_path / "m.onnx", x.numpy()))
        assert result["max_abs"] < 1e-4 and result["top1_agreement"] == 1.0, result
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_failed_export_leaves_nothing(tmp_path):
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("cannot trace")
    with pytest.raises(RuntimeError):
        export_onnx(Broken(), tmp_path / "m.onnx", (3, 8, 8))
    assert list(tmp_path.iterdir()) == []


def test_compare_outputs_on_known_inputs():
    a = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    same = compare_outputs(a, a.copy())
    assert same == {"max_abs": 0.0, "max_rel": 0.0, "cosine": pytest.approx(1.0), "top1_agreement": 1.0}
    b = np.array([[1.0, 2.0, 3.5], [0.0, 1.0, 0.0]])
    diff = compare_outputs(a, b)
    assert diff["max_abs"] == 3.0 and diff["top1_agreement"] == 0.5
    assert diff["cosine"] == pytest.approx(1 / np.sqrt(10))
    assert diff["max_rel"] == pytest.approx(1.0)
