"""The ``torch-compile`` backend (:mod:`exporters.torch_compile`) and the CPU side of the PyTorch
runners' GPU timing (:mod:`exporters.runners`): inductor compiles on the CPU with the machine's C++
compiler, its compile is recorded apart from the timed calls, its parity is checked as every
backend's; where it cannot run, the reason is said."""

import json

import numpy as np
import pytest
import torch

from benchmarks import latency
from benchmarks.backends import DEVICE_RESIDENT, HOST_TO_HOST, ON_THE_CPU, row_timings
from exporters import torch_compile
from exporters.runners import BackendUnavailable, TorchRunner
from exporters.torch_compile import CompiledTorchRunner

FAST = ["--batch", "2", "--min-time", "0.02", "--warmup", "1", "--data-samples", "4"]


def test_a_compiled_model_runs_the_shapes_it_was_compiled_for_and_no_other(small_vit):
    model = small_vit().eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    with CompiledTorchRunner(model, "cpu", shapes=((2, 3, 32, 32),)) as runner:
        assert set(runner.compile_s) == {2} and runner.compile_s[2] > 0
        assert runner.device_call(x) is None  # on the CPU, device-resident is `infer` again
        np.testing.assert_allclose(runner.infer(x), expected, atol=1e-4, rtol=0)  # inductor's own kernels
        with pytest.raises(RuntimeError, match="recompile"):  # never a silent compile inside a timed call
            runner.infer(np.zeros((3, 3, 32, 32), np.float32))


def test_where_inductor_or_cuda_graphs_cannot_run_the_reason_is_said(small_vit, monkeypatch):
    model = small_vit().eval()
    for runner in (TorchRunner, CompiledTorchRunner):
        with pytest.raises(BackendUnavailable, match="CUDA graphs run on CUDA only"):
            runner(model, "cpu", cuda_graphs=True, shapes=((1, 3, 32, 32),))
    monkeypatch.setattr(torch_compile.shutil, "which", lambda name: None)
    reason = torch_compile.inductor_unavailable("cpu")
    assert reason.startswith("inductor needs a C++ compiler for the CPU's kernels") and "not found" in reason
    with pytest.raises(BackendUnavailable, match="inductor needs a C"):
        CompiledTorchRunner(model, "cpu", shapes=((1, 3, 32, 32),))


def test_each_backend_times_its_rows_the_ways_it_can():
    """The figure asked for first where the backend can time it; the CPU's one measurement; ONNX
    Runtime and TensorRT on a GPU hand over host arrays only."""
    assert row_timings("torch-cpu", DEVICE_RESIDENT) == row_timings("ort-cpu", HOST_TO_HOST) == (ON_THE_CPU,)
    assert row_timings("torch-cuda", DEVICE_RESIDENT) == (DEVICE_RESIDENT, HOST_TO_HOST)
    assert row_timings("torch-compile-cuda", HOST_TO_HOST) == (HOST_TO_HOST, DEVICE_RESIDENT)
    assert row_timings("trt", DEVICE_RESIDENT) == row_timings("not-a-backend", DEVICE_RESIDENT) == (HOST_TO_HOST,)


def test_self_timed_calls_record_the_seconds_they_return(monkeypatch):
    """Device-resident calls time themselves (CUDA events): what they return is recorded, not the
    host's wall time around them."""
    monkeypatch.setattr(latency.time, "perf_counter", lambda: 0.0)
    calls = iter(range(1, 100))
    samples = latency.interleaved(
        {"A": lambda: 2.0 * next(calls), "B": lambda: 1.0}, warmup=1, min_rounds=3, min_time=0, timed=True
    )
    assert samples["B"] == [1.0, 1.0, 1.0] and samples["A"] == [4.0, 6.0, 8.0]


@pytest.mark.slow  # about 35 s: inductor compiles two models at two shapes
def test_bench_times_the_compiled_backend_with_its_compile_apart(tiny_artifact, tmp_path, run_cli):
    result, text = run_cli(["bench", tiny_artifact, "--backends", "torch-compile", *FAST, "-o", tmp_path], tmp_path)
    assert result.exit_code == 0, text
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["backends"]["torch-compile-cpu"] == {"status": "ran"}
    (row,) = report["latency"]
    assert row["backend"] == "torch-compile-cpu" and row["timing"] == "cpu"
    assert set(row["compile_s"]) == {"dense", "compressed"} and all(s > 0 for s in row["compile_s"].values())
    for model in ("dense", "compressed"):  # against PyTorch fp32 on the CPU, as every backend
        assert report["parity"][model]["torch-compile-cpu"]["cosine"] > 0.9999
    assert "torch-compile-cpu" not in report.get("attention", {})  # inductor's kernels are its own
    assert "torch-compile-cpu, batch 2: compiled in" in (tmp_path / "bench.md").read_text()
    assert report["gate"]["passed"] is True
