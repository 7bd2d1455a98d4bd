"""Which attention kernel PyTorch runs: ``scaled_dot_product_attention`` dispatches each call to
one of its backends (flash, memory-efficient, cuDNN, or the unfused math path) by the inputs'
device, dtype and head dims, and a pruned model whose query/key head dims differ from its value
head dims may lose a fused kernel the dense model has.

:func:`attention_kernels` runs a model once and names the backend of each call: the fused
backends by the ATen operator the call dispatched to, the math path by the absence of one (it is
a composition of matmuls and a softmax, with no operator of its own below the call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from corp_deploy.layers import block_head_dims, unfusable_heads, unfusable_heads_text

#: The name of each fused backend by the ATen operator ``scaled_dot_product_attention`` dispatches
#: to (the CPU's flash kernel has its own operator).
FUSED_OPERATORS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "fused (other device)",
}
#: A call that reached none of :data:`FUSED_OPERATORS`.
MATH = "math"


class _FusedOperators(TorchDispatchMode):
    """Records the fused attention operators that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in FUSED_OPERATORS:
            self.seen.append(FUSED_OPERATORS[name])
        return func(*args, **(kwargs or {}))


class _AttentionCalls(TorchFunctionMode):
    """Names the backend of every ``scaled_dot_product_attention`` call under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        with _FusedOperators() as fused:
            out = func(*args, **(kwargs or {}))
        self.kernels.append(fused.seen[0] if fused.seen else MATH)
        return out


@torch.no_grad()
def attention_kernels(model: torch.nn.Module, images: torch.Tensor) -> list[str]:
    """The backend of each ``scaled_dot_product_attention`` call of ``model(images)``, in call order
    (one per attention layer; empty for a model that does not call it): ``flash``, ``efficient``,
    ``cudnn`` or ``math``. ``images`` must be on the model's device and in its dtype; the kernel
    PyTorch picks depends on both (and on the ``torch.nn.attention.sdpa_kernel`` context in force)."""
    with _AttentionCalls() as calls:
        model(images)
    return calls.kernels


def kernel_summary(kernels: list[str]) -> str:
    """``["flash", "flash", "math"]`` -> ``"flash x2, math x1"`` (each backend with its count, in
    order of first use); ``"no SDPA call"`` for an empty list."""
    if not kernels:
        return "no SDPA call"
    counts = {name: kernels.count(name) for name in dict.fromkeys(kernels)}
    return ", ".join(f"{name} x{count}" for name, count in counts.items())


def lost_fused_kernels(attention: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{backend: what changed}`` for each backend of a bench report's ``attention``
    (``{backend: {model: kernel_summary}}``) on which the compressed model runs the unfused math
    path and the dense model does not."""
    return {
        backend: f"the compressed model's attention runs {k['compressed']}, the dense model's {k['dense']}"
        for backend, k in attention.items()
        if MATH in k["compressed"] and MATH not in k["dense"]
    }


def lost_kernel_warnings(attention: dict[str, dict[str, str]], compressed: nn.Module, dense: nn.Module) -> list[str]:
    """One warning per backend of :func:`lost_fused_kernels`, with the reason ``compressed`` runs
    attention unfused there where ``dense`` (its dense base) does not and the compress option that
    keeps a fused kernel (lab/RESULTS.md "Half precision on a CUDA GPU"): on CUDA, head dims
    pruned to sizes that are not multiples of 8; on the CPU, whose only fused kernel is flash,
    query/key head dims unlike the value head dims."""
    unfusable = unfusable_heads(compressed, block_head_dims(dense))
    unequal = (
        "its query/key head dims differ from its value head dims, which PyTorch's flash kernel (the CPU's "
        "only fused one) refuses; for PyTorch on the CPU compress with --target all --equal-head-dims "
        "(on CUDA the cuDNN and memory-efficient kernels take unequal dims that are multiples of 8)"
    )
    return [
        f"on {backend} {change}: "
        + (f"it has {unfusable_heads_text(unfusable)}" if backend != "torch-cpu" and unfusable else unequal)
        for backend, change in lost_fused_kernels(attention).items()
    ]
