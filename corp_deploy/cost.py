"""Parameter and multiply-accumulate counts, and peak memory."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable

import torch
from torch import nn

from .errors import BadUsage, check_instance, first_line
from .families import attention_macs, standard_copy


def share_text(fraction: float) -> str:
    """``fraction`` (of the dense model's MACs) in three significant digits, or as many more as it
    takes not to write a fraction below 1 as ``1`` or one above 0 as ``0``: ``0.9999``, not ``1``."""
    for digits in range(3, 18):
        text = f"{fraction:.{digits}g}"
        if (float(text) == 1) == (fraction == 1) and (float(text) == 0) == (fraction == 0):
            return text
    return repr(fraction)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, input_size: tuple[int, int, int]) -> int:
    """Multiply-accumulates of one forward pass on one image of ``input_size`` (C, H, W).

    Counted: every ``nn.Linear`` (``rows x in x out``), ``nn.Conv2d`` and the two attention
    matmuls by the formula of the attention's family (:func:`~corp_deploy.families.attention_macs`:
    ``heads x N^2 x (qk_dim + v_dim)`` per image; ``N`` instead of ``N^2`` for CaiT's class
    attention, where only the class token queries). Not counted: normalisation, activations,
    softmax, additions (a few percent of a ViT's total). Models are counted in their standard form
    (:func:`~corp_deploy.families.standard_form`, the same function), because BEiT's and Eva's own
    attentions bypass their ``qkv`` modules.
    """
    check_instance("model", model, nn.Module)
    model = standard_copy(model)
    total = 0

    def linear(mod, args, out):
        nonlocal total
        total += args[0].numel() * mod.out_features

    def conv(mod, args, out):
        nonlocal total
        k = mod.in_channels // mod.groups
        for size in mod.kernel_size:
            k *= size
        total += out.numel() * k

    def hook_of(mod):
        if isinstance(mod, nn.Linear):
            return linear
        if isinstance(mod, nn.Conv2d):
            return conv
        formula = attention_macs(mod)
        if formula is None:
            return None

        def attention(mod, args, out):
            nonlocal total
            total += formula(mod, tuple(args[0].shape))

        return attention

    try:
        forward_blank_image(model, input_size, hook_of)
    except (AssertionError, RuntimeError, ValueError, TypeError) as exc:  # timm's checks of the input's size
        raise BadUsage(f"the model cannot run on one image of input_size {input_size}: {first_line(exc)}") from None
    return total


def forward_blank_image(
    model: nn.Module, input_size: tuple[int, ...], hook_of: Callable[[nn.Module], Callable | None]
) -> None:
    """Run ``model`` on one all-zero image of ``input_size`` ``(C, H, W)`` with the forward hook
    ``hook_of(module)`` (None: no hook) on each of its modules; the hooks are removed afterwards."""
    hooks = [mod.register_forward_hook(hook) for mod in model.modules() if (hook := hook_of(mod)) is not None]
    param = next(model.parameters())
    try:
        with torch.inference_mode():
            model(torch.zeros(1, *input_size, device=param.device, dtype=param.dtype))
    finally:
        for hook in hooks:
            hook.remove()


def peak_memory_mb(device: torch.device) -> dict:
    """Peak process RSS (MB) and, on CUDA, peak allocated GPU memory (MB)."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss_kb / 1024 if sys.platform != "darwin" else rss_kb / 2**20
    out = {"process_rss_peak": round(rss_mb, 1)}
    if device.type == "cuda":
        out["cuda_allocated_peak"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out
