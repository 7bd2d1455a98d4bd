"""Which inference backends can run here, with a runner per model for each one that can.

Backend names: ``torch-cpu``, ``torch-cuda``, ``ort-cpu``, ``ort-cuda``, ``ort-tensorrt``
(ONNX Runtime's CUDA and TensorRT providers) and ``trt`` (the exported TensorRT engine).
A backend runs only if it can run every model asked for; otherwise it is reported as skipped
with the reason, never dropped silently. Every backend's runner is an
:class:`exporters.runners.Runner`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from exporters import tensorrt as trt_backend
from exporters.runners import BackendUnavailable, OnnxRuntimeRunner, Runner, TorchRunner

FAMILIES = ("torch", "ort", "trt")


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


#: Makes a backend's runner for one model with a CPU thread count (None: the default) and the
#: precision PyTorch backends run in (:data:`exporters.runners.TORCH_PRECISIONS`), or raises
#: BackendUnavailable.
MakeRunner = Callable[[ModelFiles, int | None, str], Runner]


def _torch(device: str) -> MakeRunner:
    return lambda model, threads, precision: TorchRunner(model.torch, device, precision)


def _onnxruntime(device: str) -> MakeRunner:
    def make(model: ModelFiles, threads: int | None, precision: str) -> Runner:
        if model.onnx is None:
            raise BackendUnavailable("no ONNX file (run `corp-deploy export ... --dense` first)")
        return OnnxRuntimeRunner(model.onnx, device, threads)

    return make


def _tensorrt(model: ModelFiles, threads: int | None, precision: str) -> Runner:
    missing = trt_backend.unavailable_reason()
    if missing:
        raise BackendUnavailable(missing)
    if model.engine is None:
        raise BackendUnavailable("no TensorRT engine (run `corp-deploy export ... --trt --dense` on this GPU)")
    return trt_backend.TensorRTRunner(model.engine)


BACKENDS: dict[str, tuple[str, MakeRunner]] = {
    "torch-cpu": ("torch", _torch("cpu")),
    "torch-cuda": ("torch", _torch("cuda")),
    "ort-cpu": ("ort", _onnxruntime("cpu")),
    "ort-cuda": ("ort", _onnxruntime("cuda")),
    "ort-tensorrt": ("ort", _onnxruntime("tensorrt")),
    "trt": ("trt", _tensorrt),
}


def open_runners(
    families: tuple[str, ...],
    models: dict[str, ModelFiles],
    stack: ExitStack,
    threads: int | None = None,
    torch_precision: str = "fp32",
) -> tuple[dict[str, dict[str, Runner]], dict[str, str]]:
    """Runners ``{backend: {model name: runner}}`` for every backend of ``families`` that can
    run all ``models`` (the PyTorch ones in ``torch_precision``; ONNX Runtime and TensorRT run the
    exported files as they are), and ``{backend: reason}`` for those that cannot (naming each model that
    cannot, unless none can for the same reason: an export without ``dense.onnx`` names the dense
    model). The runners are closed
    with ``stack``; those of a backend that cannot run every model, at once."""
    runners, skipped = {}, {}
    for name, (family, make) in BACKENDS.items():
        if family not in families:
            continue
        group, opened, failed = ExitStack(), {}, {}
        for key, model in models.items():
            try:
                opened[key] = group.enter_context(make(model, threads, torch_precision))
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
