"""The runner protocol (:mod:`exporters.runners`): every CPU runner opens on construction, infers,
works as a context manager and refuses to infer once closed."""

import numpy as np
import pytest
import torch

from corp_deploy import CorpError
from exporters.onnx_export import export_onnx
from exporters.runners import OnnxRuntimeRunner, Runner, TorchRunner


@pytest.fixture(scope="module")
def model_and_graph(tmp_path_factory, small_vit):
    model = small_vit().eval()
    path = tmp_path_factory.mktemp("runner") / "m.onnx"
    export_onnx(model, path, (3, 32, 32), exporter="torchscript")
    return model, path


@pytest.mark.parametrize("backend", ["pytorch", "onnxruntime"])
def test_each_cpu_runner_is_a_context_manager_that_closes(model_and_graph, image_batches, backend):
    model, path = model_and_graph
    x = image_batches(1, 3)[0]
    with torch.no_grad():
        expected = model(x).numpy()
    runner = TorchRunner(model) if backend == "pytorch" else OnnxRuntimeRunner(path, "cpu")
    assert isinstance(runner, Runner) and runner.name == backend
    with runner as opened:
        assert opened is runner and not runner.closed
        out = runner.infer(x.numpy().astype(np.float64))  # any float input is fed as contiguous float32
        assert out.dtype == np.float32 and out.shape == expected.shape
        np.testing.assert_allclose(out, expected, atol=1e-4, rtol=0)
    assert runner.closed
    with pytest.raises(CorpError, match=f"the {backend} runner is closed"):
        runner.infer(x.numpy())
    runner.close()  # closing again does nothing


def test_a_backend_that_cannot_run_one_model_names_it(model_and_graph):
    """An export without ``dense.onnx``: ONNX Runtime is skipped, and the reason says which model
    has no file, also when it comes first; when no model can run for one reason, it names none."""
    from contextlib import ExitStack

    from benchmarks.backends import ModelFiles, open_runners

    model, path = model_and_graph
    with ExitStack() as stack:
        runners, skipped = open_runners(
            ("torch", "ort"), {"compressed": ModelFiles(model, onnx=path), "dense": ModelFiles(model)}, stack
        )
        assert set(runners["torch-cpu"]) == {"compressed", "dense"} and "ort-cpu" not in runners
        assert skipped["ort-cpu"].startswith("the dense model: no ONNX file")
        _, skipped = open_runners(
            ("ort",), {"dense": ModelFiles(model), "compressed": ModelFiles(model, onnx=path)}, stack
        )
        assert skipped["ort-cpu"].startswith("the dense model: no ONNX file")
        _, skipped = open_runners(("ort",), {"dense": ModelFiles(model), "compressed": ModelFiles(model)}, stack)
        assert skipped["ort-cpu"].startswith("no ONNX file")
