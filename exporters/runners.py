"""Backends that run a model on a batch of images, one small class per backend.

Every runner has ``infer(images) -> outputs`` on float32 numpy arrays ``(B, 3, H, W)`` ->
``(B, features)``, host memory in and out (so a GPU runner's time includes the copies).
The TensorRT runner lives in :mod:`exporters.tensorrt`.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from corp_deploy import CorpError

#: ONNX Runtime execution providers by device name, most preferred first.
ORT_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


class BackendUnavailable(CorpError):
    """A backend cannot run here (missing package, GPU or kernels); the message says why."""


class TorchRunner:
    """A PyTorch module in eval mode, float32, on ``device`` (``cpu`` is the parity reference;
    for another device a copy of the module is moved there)."""

    def __init__(self, model: nn.Module, device: str = "cpu") -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("PyTorch sees no CUDA GPU")
        self.device = torch.device(device)
        self.model = (model if device == "cpu" else copy.deepcopy(model)).eval().float().to(self.device)

    @torch.no_grad()
    def infer(self, images: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(images, np.float32)).to(self.device)
        return self.model(x).cpu().numpy()


class OnnxRuntimeRunner:
    """An ONNX file on ONNX Runtime.

    ``device="cpu"`` uses the CPU provider (always present); ``"cuda"`` and ``"tensorrt"``
    the CUDA and TensorRT providers, and fail with :class:`BackendUnavailable` unless that
    provider really is the one in use (ONNX Runtime otherwise falls back to the CPU silently).
    """

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None) -> None:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only; failures are raised below
        if threads:
            options.intra_op_num_threads = threads
        providers = ORT_PROVIDERS[device]
        if device != "cpu":
            if providers[0] not in ort.get_available_providers():
                raise BackendUnavailable(f"this ONNX Runtime build has no {providers[0]}")
            if not torch.cuda.is_available():
                raise BackendUnavailable(f"ONNX Runtime's {providers[0]} needs a CUDA GPU; none is visible")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types (e.g. NOT_IMPLEMENTED kernels)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendUnavailable(f"ONNX Runtime ({device}) cannot run {Path(path).name}: {reason}") from None
        if self.session.get_providers()[0] != providers[0]:
            raise BackendUnavailable(f"ONNX Runtime's {providers[0]} is not usable here")
        self.input_name = self.session.get_inputs()[0].name

    def infer(self, images: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: np.ascontiguousarray(images, np.float32)})[0]
