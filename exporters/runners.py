"""Backends that run a model on a batch of images: one :class:`Runner` protocol, one small class
per backend (PyTorch and ONNX Runtime here; TensorRT in :mod:`exporters.tensorrt`).

A runner follows Polygraphy's runners (activate / infer / deactivate) with Python's resource
idiom: constructing it opens (loads) the model on its backend, raising
:class:`BackendUnavailable` when the backend cannot run it here; ``infer(images) -> outputs``
takes float32 NumPy images ``(B, 3, H, W)`` and returns float32 outputs ``(B, features)``, host
memory in and out (so a GPU runner's time includes the copies); ``close()`` releases what it
holds (a session, an engine's context, a GPU copy of the model), after which ``infer`` refuses.
Every runner is a context manager that closes on exit::

    with OnnxRuntimeRunner(path) as runner:
        outputs = runner.infer(images)
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
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


class Runner(ABC):
    """The runner protocol (see the module docstring); a backend implements ``_infer`` on
    contiguous float32 images and, when it holds anything, ``_release``.

    ``name`` is the backend's name in the export's parity records (``onnxruntime_vs_pytorch``).
    """

    name: str
    closed: bool = False

    def infer(self, images: np.ndarray) -> np.ndarray:
        """``(B, 3, H, W)`` float32 images -> ``(B, features)`` float32 outputs, on the host."""
        if self.closed:
            raise CorpError(f"the {self.name} runner is closed")
        return self._infer(np.ascontiguousarray(images, np.float32))

    def close(self) -> None:
        """Release the backend's resources; closing twice does nothing."""
        if not self.closed:
            self._release()
            self.closed = True

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abstractmethod
    def _infer(self, images: np.ndarray) -> np.ndarray:
        """``infer`` on contiguous float32 images."""

    def _release(self) -> None:
        """Drop what the runner holds (nothing by default)."""


#: PyTorch's floating-point precisions by name (``bench --torch-precision``).
TORCH_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TorchRunner(Runner):
    """A PyTorch module in eval mode on ``device`` in ``precision`` (:data:`TORCH_PRECISIONS`:
    the module and the images cast to it, the outputs cast back to float32). The caller's module
    runs as it is for ``cpu`` and ``fp32`` (the parity reference); otherwise a cast copy runs.
    float16 runs on CUDA only (a CPU has no fast float16 kernels to time; bf16 runs on both)."""

    name = "pytorch"

    def __init__(self, model: nn.Module, device: str = "cpu", precision: str = "fp32") -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("PyTorch sees no CUDA GPU")
        if precision == "fp16" and device == "cpu":
            raise BackendUnavailable("fp16 is timed on CUDA only (on the CPU, use bf16)")
        self.device, self.dtype = torch.device(device), TORCH_PRECISIONS[precision]
        copied = device != "cpu" or precision != "fp32"
        self.model = (copy.deepcopy(model) if copied else model).eval().to(self.device, self.dtype)

    @torch.no_grad()
    def _infer(self, images: np.ndarray) -> np.ndarray:
        return self.model(torch.from_numpy(images).to(self.device, self.dtype)).float().cpu().numpy()

    def _release(self) -> None:
        del self.model  # frees a cast or GPU copy; the caller's CPU module is the caller's


class OnnxRuntimeRunner(Runner):
    """An ONNX file on ONNX Runtime.

    ``device="cpu"`` uses the CPU provider (always present); ``"cuda"`` and ``"tensorrt"``
    the CUDA and TensorRT providers, and fail with :class:`BackendUnavailable` unless that
    provider really is the one in use (ONNX Runtime otherwise falls back to the CPU silently).
    """

    name = "onnxruntime"

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

    def _infer(self, images: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: images})[0]

    def _release(self) -> None:
        del self.session
