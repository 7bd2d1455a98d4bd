"""What one forward of a model asks of the host: the ATen operators it dispatches and, on CUDA, the
kernels it launches, counted with ``torch.profiler``.

Every operator is a call through PyTorch's dispatcher, host time on any device (a view as much as a
matmul); on CUDA every kernel is also a launch, which the GPU waits for when the batch is small. A
model whose forward dispatches more of either than another's is slower than it at small batches,
whatever its MACs (issue 63: the compressed DeiT-B ran batch 1 at 0.65-0.89x of the dense one on an
H200).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class ForwardOps:
    """One forward's count: ``operators``, every ATen operator dispatched (those an operator calls
    itself included: a composite such as ``linear`` and the ``addmm`` it runs are two); ``top_level``,
    those the model's own code dispatched; ``kernels``, the CUDA kernels launched (None on the CPU;
    copies and fills between memories not counted)."""

    operators: int
    top_level: int
    kernels: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def forward_ops(model: Callable[[torch.Tensor], object], x: torch.Tensor) -> ForwardOps:
    """The count of ``model(x)`` (a module, or any function of one tensor) without gradients, on
    ``x``'s device, after one uncounted call (so that nothing done once, such as choosing a kernel,
    is counted)."""
    cuda = x.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.no_grad():
        model(x)
        if cuda:
            torch.cuda.synchronize(x.device)
        with profile(activities=activities) as prof:
            model(x)
            if cuda:
                torch.cuda.synchronize(x.device)
    events = prof.events()
    operators = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    top_level = [e for e in operators if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return ForwardOps(len(operators), len(top_level), len(kernels) if cuda else None)
