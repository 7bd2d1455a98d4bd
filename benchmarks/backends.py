"""Which inference backends can run here, with a runner per model for each one that can.

Backend names: ``torch-cpu``, ``torch-cuda``, ``ort-cpu``, ``ort-cuda``, ``ort-tensorrt``
(ONNX Runtime's CUDA and TensorRT providers) and ``trt`` (the exported TensorRT engine).
A backend runs only if it can run every model asked for; otherwise it is reported as skipped
with the reason, never dropped silently.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from corp_deploy import CorpError
from exporters import tensorrt as trt_backend
from exporters.runners import BackendUnavailable, OnnxRuntimeRunner, TorchRunner

FAMILIES = ("torch", "ort", "trt")


@dataclass
class ModelFiles:
    """One model in each form ``bench`` can run: the PyTorch module and, where exported, its
    ONNX file and TensorRT engine."""

    torch: nn.Module
    onnx: Path | None = None
    engine: Path | None = None


def _torch(device: str) -> Callable:
    return lambda model, stack, threads: TorchRunner(model.torch, device)


def _onnxruntime(device: str) -> Callable:
    def make(model: ModelFiles, stack: ExitStack, threads: int | None):
        if model.onnx is None:
            raise BackendUnavailable("no ONNX file (run `corp-deploy export ... --dense` first)")
        return OnnxRuntimeRunner(model.onnx, device, threads)
    return make


def _tensorrt(model: ModelFiles, stack: ExitStack, threads: int | None):
    missing = trt_backend.unavailable_reason()
    if missing:
        raise BackendUnavailable(missing)
    if model.engine is None:
        raise BackendUnavailable("no TensorRT engine (run `corp-deploy export ... --trt --dense` on this GPU)")
    return stack.enter_context(trt_backend.TensorRTRunner(model.engine))


BACKENDS: dict[str, tuple[str, Callable]] = {
    "torch-cpu": ("torch", _torch("cpu")),
    "torch-cuda": ("torch", _torch("cuda")),
    "ort-cpu": ("ort", _onnxruntime("cpu")),
    "ort-cuda": ("ort", _onnxruntime("cuda")),
    "ort-tensorrt": ("ort", _onnxruntime("tensorrt")),
    "trt": ("trt", _tensorrt),
}


def parse_families(text: str) -> tuple[str, ...]:
    """``"torch,ort,trt"`` -> the families, validated."""
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in families if f not in FAMILIES]
    if not families or unknown:
        raise CorpError(f"--backends takes a comma-separated subset of {','.join(FAMILIES)}; got {text!r}")
    return families


def open_runners(families: tuple[str, ...], models: dict[str, ModelFiles], stack: ExitStack,
                 threads: int | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """Runners ``{backend: {model name: runner}}`` for every backend of ``families`` that can
    run all ``models``, and ``{backend: reason}`` for those that cannot. Runners that hold
    resources are closed with ``stack``."""
    runners, skipped = {}, {}
    for name, (family, make) in BACKENDS.items():
        if family not in families:
            continue
        try:
            runners[name] = {key: make(model, stack, threads) for key, model in models.items()}
        except BackendUnavailable as exc:
            skipped[name] = str(exc)
    return runners, skipped
