"""Backends that run a model on a batch of images: one :class:`Runner` protocol, one small class
per backend (PyTorch and ONNX Runtime here; TensorRT in :mod:`exporters.tensorrt`).

A runner follows Polygraphy's runners (activate / infer / deactivate) with Python's resource
idiom: constructing it opens (loads) the model on its backend, raising
:class:`BackendUnavailable` when the backend cannot run it here; ``infer(images) -> outputs``
takes float32 NumPy images ``(B, 3, H, W)`` and returns float32 outputs ``(B, features)``, host
memory in and out (so a GPU runner's time includes the copies: host to host); ``close()`` releases
what it holds (a session, an engine's context, a GPU copy of the model), after which ``infer``
refuses. Every runner is a context manager that closes on exit::

    with OnnxRuntimeRunner(path) as runner:
        outputs = runner.infer(images)

A runner on a GPU also says what the device itself does: ``host_images`` puts images where its
copies start fastest (pinned memory), and ``device_call`` stages them on the device once and
returns a call that leaves its outputs there and times itself with CUDA events (device-resident;
the PyTorch runner on CUDA, with or without CUDA graphs).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from corp_deploy import CorpError
from corp_deploy.errors import first_line

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
        self._check_open()
        return self._infer(np.ascontiguousarray(images, np.float32))

    def host_images(self, images: np.ndarray) -> np.ndarray:
        """``images`` as float32 in the host memory this runner copies from fastest (pinned for a
        CUDA runner; as they are for a runner on the CPU): what ``infer`` is timed on."""
        return np.ascontiguousarray(images, np.float32)

    def device_call(self, images: np.ndarray) -> Callable[[], float] | None:
        """A call that runs the model on ``images``, staged on the runner's device once (here),
        leaves the outputs there and returns the seconds the device took (CUDA events around it):
        device-resident timing. None where the runner cannot (on the CPU, where it would be
        ``infer`` again; ONNX Runtime and TensorRT, which hand over host arrays)."""
        self._check_open()
        return None

    def _check_open(self) -> None:
        if self.closed:
            raise CorpError(f"the {self.name} runner is closed")

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
    float16 runs on CUDA only (a CPU has no fast float16 kernels to time; bf16 runs on both).

    With ``cuda_graphs`` (CUDA only), a ``torch.cuda.CUDAGraph`` of the forward is captured for each
    input shape of ``shapes`` (B, 3, H, W) on construction, and each call of that shape replays it:
    one launch for the whole forward instead of one per kernel. A call of another shape is refused.
    On CUDA ``infer`` copies from pinned memory when given it (:meth:`host_images`) and back into
    pinned memory. A subclass readies its forward for ``shapes`` in :meth:`_prepare`."""

    name = "pytorch"

    def __init__(
        self,
        model: nn.Module,
        device: str = "cpu",
        precision: str = "fp32",
        *,
        cuda_graphs: bool = False,
        shapes: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("PyTorch sees no CUDA GPU")
        if precision == "fp16" and device == "cpu":
            raise BackendUnavailable("fp16 is timed on CUDA only (on the CPU, use bf16)")
        if cuda_graphs and device != "cuda":
            raise BackendUnavailable("CUDA graphs run on CUDA only")
        self.device, self.dtype = torch.device(device), TORCH_PRECISIONS[precision]
        copied = device != "cpu" or precision != "fp32"
        self.model = (copy.deepcopy(model) if copied else model).eval().to(self.device, self.dtype)
        #: input shape -> (graph, its input, its output), the tensors the graph reads and writes
        self.graphs = {}
        self._prepare(tuple(tuple(shape) for shape in shapes), cuda_graphs)

    def _prepare(self, shapes: tuple[tuple[int, ...], ...], cuda_graphs: bool) -> None:
        """Ready the forward for each input shape of ``shapes`` before any call is timed (here: with
        ``cuda_graphs``, capture a graph of each); BackendUnavailable when it cannot be."""
        if cuda_graphs:
            self.graphs = {shape: self._capture(shape) for shape in shapes}

    @torch.no_grad()
    def _capture(self, shape: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """The forward at ``shape`` captured as a CUDA graph, after warm-up calls on a side stream
        (what ``torch.cuda.graph`` asks for); BackendUnavailable when the model cannot be captured."""
        x = torch.zeros(shape, device=self.device, dtype=self.dtype)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.model(x)
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(graph):
                y = self.model(x)
        except RuntimeError as exc:  # an op that synchronises with the host, or another capture error
            raise BackendUnavailable(f"CUDA graph capture failed at batch {shape[0]}: {first_line(exc)}") from None
        return graph, x, y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``, copied to the runner's device and dtype (asynchronously from pinned
        memory): with CUDA graphs, copied into the graph of its shape and replayed (the output is
        then the graph's own tensor, overwritten by its next replay)."""
        if not self.graphs:
            return self._run(x.to(self.device, self.dtype, non_blocking=True))
        graph, static_x, static_y = self._graph(x.shape)
        static_x.copy_(x, non_blocking=True)
        graph.replay()
        return static_y

    def _graph(self, shape) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        captured = self.graphs.get(tuple(shape))
        if captured is None:
            raise CorpError(f"no CUDA graph was captured for input shape {tuple(shape)}")
        return captured

    @torch.no_grad()
    def _infer(self, images: np.ndarray) -> np.ndarray:
        y = self._forward(torch.from_numpy(images)).float()
        if self.device.type == "cpu":
            return y.numpy()
        out = torch.empty(y.shape, dtype=torch.float32, pin_memory=True)
        out.copy_(y, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out.numpy()

    def host_images(self, images: np.ndarray) -> np.ndarray:
        images = super().host_images(images)
        return torch.from_numpy(images).pin_memory().numpy() if self.device.type == "cuda" else images

    def device_call(self, images: np.ndarray) -> Callable[[], float] | None:
        self._check_open()
        if self.device.type != "cuda":
            return None
        x = torch.from_numpy(np.ascontiguousarray(images, np.float32)).to(self.device, self.dtype)
        if self.graphs:
            graph, static_x, _ = self._graph(x.shape)
            static_x.copy_(x)
            return cuda_event_timer(graph.replay)
        return cuda_event_timer(torch.no_grad()(lambda: self._run(x)))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``, already on the runner's device and in its dtype."""
        return self.model(x)

    def _release(self) -> None:
        del self.model, self.graphs  # frees a cast or GPU copy; the caller's CPU module is the caller's


def cuda_event_timer(call: Callable[[], object]) -> Callable[[], float]:
    """``call`` timed on the current CUDA stream: each call of the result runs it between two CUDA
    events, waits for the second and returns the seconds between them (what the GPU took, launch
    gaps included: a forward waiting for the host to launch its kernels is waiting)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed() -> float:
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return timed


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
        options.log_severity_level = 4  # fatal only: every error is raised to the caller, which reports it once
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
            reason = first_line(exc)
            raise BackendUnavailable(f"ONNX Runtime ({device}) cannot run {Path(path).name}: {reason}") from None
        if self.session.get_providers()[0] != providers[0]:
            raise BackendUnavailable(f"ONNX Runtime's {providers[0]} is not usable here")
        self.input_name = self.session.get_inputs()[0].name

    def _infer(self, images: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: images})[0]

    def _release(self) -> None:
        del self.session
