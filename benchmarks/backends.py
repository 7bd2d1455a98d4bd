"""Which inference backends can run here, with a runner per model for each one that can, and how
each backend's latency rows are timed.

Backend names: ``torch-cpu``, ``torch-cuda``, ``torch-compile-cpu``, ``torch-compile-cuda``
(``torch.compile`` with inductor), ``ort-cpu``, ``ort-cuda``, ``ort-tensorrt`` (ONNX Runtime's CUDA
and TensorRT providers) and ``trt`` (the exported TensorRT engine).
A backend runs only if it can run every model asked for; otherwise it is reported as skipped
with the reason, never dropped silently. Every backend's runner is an
:class:`exporters.runners.Runner`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torch import nn

from exporters import tensorrt as trt_backend
from exporters.runners import BackendUnavailable, OnnxRuntimeRunner, Runner, TorchRunner
from exporters.torch_compile import CompiledTorchRunner

FAMILIES = ("torch", "torch-compile", "ort", "trt")
#: The families ``bench`` and ``sweep`` time unless told otherwise.
DEFAULT_FAMILIES = ("torch", "ort", "trt")
#: The families that run the PyTorch module itself (the others run exported files).
TORCH_FAMILIES = ("torch", "torch-compile")
#: Bytes per activation of the ONNX graphs of each precision (``export.json``'s; float32 unless named).
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2}

#: How a latency row is timed. On a GPU, ``device-resident``: the images staged on the device once,
#: the outputs left there, CUDA events around each call (what the model costs the GPU); or
#: ``host-to-host``: float32 images in pinned host memory in, outputs back in host memory, the
#: copies included (what a pipeline that hands over host arrays pays). On the CPU the host memory
#: is the device's: the two are one measurement, ``cpu``.
DEVICE_RESIDENT, HOST_TO_HOST, ON_THE_CPU = "device-resident", "host-to-host", "cpu"
#: What ``--timing`` chooses between: the figure speedups and gates use on a GPU.
TIMINGS = (DEVICE_RESIDENT, HOST_TO_HOST)


@dataclass
class ModelFiles:
    """One model in each form ``bench`` can run: the PyTorch module and, where exported, its
    ONNX file and TensorRT engine, and their ``precision``, ONNX ``exporter`` and ``opset``
    (``export.json``'s; None: not exported)."""

    torch: nn.Module
    onnx: Path | None = None
    engine: Path | None = None
    precision: str | None = None
    exporter: str | None = None
    opset: int | None = None


@dataclass(frozen=True)
class RunnerSettings:
    """How backends open their runners: CPU ``threads`` (None: the default), the ``precision`` the
    PyTorch backends run in (:data:`exporters.runners.TORCH_PRECISIONS`), whether those on CUDA
    replay ``cuda_graphs``, and the input ``shapes`` (B, 3, H, W) every call will have: graphs are
    captured and inductor compiles for each before any timing."""

    threads: int | None = None
    precision: str = "fp32"
    cuda_graphs: bool = False
    shapes: tuple[tuple[int, ...], ...] = ()


#: Makes a backend's runner for one model, or raises BackendUnavailable.
MakeRunner = Callable[[ModelFiles, RunnerSettings], Runner]


def _torch(device: str, runner: type[TorchRunner] = TorchRunner) -> MakeRunner:
    def make(model: ModelFiles, settings: RunnerSettings) -> Runner:
        graphs = settings.cuda_graphs and device == "cuda"  # the CPU's PyTorch runs as always
        return runner(model.torch, device, settings.precision, cuda_graphs=graphs, shapes=settings.shapes)

    return make


def _onnxruntime(device: str) -> MakeRunner:
    def make(model: ModelFiles, settings: RunnerSettings) -> Runner:
        if model.onnx is None:
            raise BackendUnavailable("no ONNX file (run `corp-deploy export ... --dense` first)")
        return OnnxRuntimeRunner(model.onnx, device, settings.threads)

    return make


def _tensorrt(model: ModelFiles, settings: RunnerSettings) -> Runner:
    missing = trt_backend.unavailable_reason()
    if missing:
        raise BackendUnavailable(missing)
    if model.engine is None:
        raise BackendUnavailable("no TensorRT engine (run `corp-deploy export ... --trt --dense` on this GPU)")
    return trt_backend.TensorRTRunner(model.engine)


class Backend(NamedTuple):
    """A backend's family (what ``--backends`` names), how it makes a runner, and the timings its
    rows can have (:data:`TIMINGS`, or the CPU's one measurement)."""

    family: str
    make: MakeRunner
    timings: tuple[str, ...]


BACKENDS: dict[str, Backend] = {
    "torch-cpu": Backend("torch", _torch("cpu"), (ON_THE_CPU,)),
    "torch-cuda": Backend("torch", _torch("cuda"), TIMINGS),
    "torch-compile-cpu": Backend("torch-compile", _torch("cpu", CompiledTorchRunner), (ON_THE_CPU,)),
    "torch-compile-cuda": Backend("torch-compile", _torch("cuda", CompiledTorchRunner), TIMINGS),
    "ort-cpu": Backend("ort", _onnxruntime("cpu"), (ON_THE_CPU,)),
    "ort-cuda": Backend("ort", _onnxruntime("cuda"), (HOST_TO_HOST,)),  # device-resident not written
    "ort-tensorrt": Backend("ort", _onnxruntime("tensorrt"), (HOST_TO_HOST,)),
    "trt": Backend("trt", _tensorrt, (HOST_TO_HOST,)),
}


def row_timings(backend: str, timing: str) -> tuple[str, ...]:
    """How ``backend``'s latency rows are timed when ``timing`` (:data:`TIMINGS`) is asked for: the
    figure its speedups and gates use first, then the other one reported beside it (a GPU backend
    that can time both); a backend that can time only one way (the CPU's one measurement; ONNX Runtime
    and TensorRT on a GPU, host to host) times that. A backend this version does not know (in a
    report written by hand) is taken as timed host to host."""
    timings = BACKENDS[backend].timings if backend in BACKENDS else (HOST_TO_HOST,)
    return (timing, *(t for t in timings if t != timing)) if timing in timings else timings


def open_runners(
    families: tuple[str, ...],
    models: dict[str, ModelFiles],
    stack: ExitStack,
    settings: RunnerSettings = RunnerSettings(),
) -> tuple[dict[str, dict[str, Runner]], dict[str, str]]:
    """Runners ``{backend: {model name: runner}}`` for every backend of ``families`` that can
    run all ``models`` (opened with ``settings``; ONNX Runtime and TensorRT run the exported files
    as they are), and ``{backend: reason}`` for those that cannot (naming each model that
    cannot, unless none can for the same reason: an export without ``dense.onnx`` names the dense
    model). The runners are closed
    with ``stack``; those of a backend that cannot run every model, at once."""
    runners, skipped = {}, {}
    for name, backend in BACKENDS.items():
        if backend.family not in families:
            continue
        group, opened, failed = ExitStack(), {}, {}
        for key, model in models.items():
            try:
                opened[key] = group.enter_context(backend.make(model, settings))
            except BackendUnavailable as exc:
                failed[key] = str(exc)
        if failed:
            group.close()
            shared = len(failed) == len(models) and len(set(failed.values())) == 1
            skipped[name] = (
                next(iter(failed.values()))
                if shared
                else "; ".join(f"the {key} model: {reason}" for key, reason in failed.items())
            )
        else:
            stack.enter_context(group)
            runners[name] = opened
    return runners, skipped
