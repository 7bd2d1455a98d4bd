"""Which Linear layers an int8 graph keeps in float (``export --int8-keep-float auto|N``).

A per-tensor int8 range cannot hold both the outlier activations that some layers' inputs carry
and the resolution the other values need (the dense DINOv2, lab/RESULTS.md "INT8").
:func:`linear_sensitivity` ranks the Linear layers by their own int8 rounding error; ``N`` keeps
the first N in float. ``auto`` (the default) chooses N by measurement: the activation ranges are
calibrated without every :data:`HOLD_BACK_EVERY`-th calibration image, and N grows over
:func:`keep_float_ladder` (0, 1, 2, 4, ... up to a quarter of the Linear layers) until the int8
graph meets the export gate's tolerance against the float PyTorch model on every calibration
image: those its ranges came from, where rounding outliers and crushed resolution show, and the
held-back ones, where the clipping of unseen images shows too. The minimum over this larger set
is stricter than the gate's over 9 images, and meant to be. With N chosen, the graph is
quantized again with ranges from every calibration image. The held-out photos of the gate
itself are never used to choose: the gate judges the final graph afterwards, and fails it as
usual when no N within the ladder was enough.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corp_deploy.resources import release_freed_memory

from .parity import Tolerance, compare_outputs
from .quantize import DEFAULT_ACTIVATIONS, quantize_int8
from .runners import OnnxRuntimeRunner, TorchRunner
from .smoothing import DEFAULT_ALPHA, linear_input_scales

AUTO = "auto"
#: With ``auto``, every 4th calibration image checks the int8 graph instead of calibrating it.
HOLD_BACK_EVERY = 4
#: ``auto`` keeps at most this share of the Linear layers in float.
MAX_FLOAT_SHARE = 0.25


def quantize_keeping_float(
    model: nn.Module,
    fp32_path: Path,
    out_path: Path,
    batches: Iterable[torch.Tensor],
    keep: int | str,
    method: str,
    tolerance: Tolerance,
    log: Callable[[str], None] = lambda message: None,
    smoothing: float | None = DEFAULT_ALPHA,
    activations: str = DEFAULT_ACTIVATIONS,
) -> dict:
    """Quantize ``fp32_path`` (the float32 export of ``model``) to ``out_path`` with ``keep``
    (a count or :data:`AUTO`) Linear layers in float, and the Linear layers' inputs smoothed with
    strength ``smoothing`` (:mod:`exporters.smoothing`; ``None``: not smoothed), the scales chosen
    on the images the ranges come from, and the activations of type ``activations``
    (:data:`exporters.quantize.ACTIVATION_TYPES`; the ranking models the signed symmetric rounding).

    Args:
        batches: the calibration images, ``(B, C, H, W)`` float32 batches; iterated several times
            (a re-iterable such as :class:`~corp_deploy.calibration.SpooledBatches`), one batch in
            memory at a time.
    Returns:
        :func:`quantize_int8`'s record plus ``kept_float`` (module paths) and, for ``auto``,
        ``keep_float_search``: the checked and held-back image counts and each try's numbers.
    """
    name = out_path.stem
    scales_of: dict[int, dict | None] = {}  # per calibration view, computed once

    def scales(calibration: Iterable[torch.Tensor]) -> dict | None:
        if smoothing is not None and id(calibration) not in scales_of:
            log(f"{name}: choosing the smoothing scales of the Linear layers' inputs (alpha {smoothing}) ...")
            scales_of[id(calibration)] = linear_input_scales(model, calibration, smoothing)
            release_freed_memory()  # the PyTorch pass's activations
        return scales_of.get(id(calibration))

    def quantize(calibration: Iterable[torch.Tensor], ranking: list[str], count: int) -> dict:
        kept, input_scales = set(ranking[:count]), scales(calibration)
        log(f"{name}: quantizing to int8 ({method} ranges, Linear layers in float: {count}) ...")
        int8 = quantize_int8(
            fp32_path, out_path, (b.numpy() for b in calibration), method, kept, input_scales, activations=activations
        )
        return {**int8, "kept_float": sorted(kept), "smoothing_alpha": smoothing}

    def rank(calibration: Iterable[torch.Tensor]) -> list[str]:
        log(f"{name}: ranking the Linear layers by their int8 rounding error ...")
        return linear_sensitivity(model, calibration, scales(calibration))

    if keep != AUTO:
        return quantize(batches, rank(batches) if keep else [], keep)
    fit = HeldBack(batches)
    with TorchRunner(model) as torch_runner:
        reference = np.concatenate([torch_runner.infer(batch.numpy()) for batch in batches])
    images, held_back = len(reference), fit.held_back(len(reference))
    linears = sum(isinstance(module, nn.Linear) for module in model.modules())
    ranking, tries = [], []
    for count in keep_float_ladder(linears):
        ranking = ranking or (rank(fit) if count else [])
        int8 = quantize(fit, ranking, count)
        with OnnxRuntimeRunner(out_path, "cpu") as runner:
            outputs = np.concatenate([runner.infer(batch.numpy()) for batch in batches])
        release_freed_memory()  # the session's weights and buffers, before the next graph is loaded
        result = compare_outputs(reference, outputs, top1=model.num_classes > 0)
        failed = tolerance.violations(result)
        tries.append(
            {"kept": count, "cosine": result.cosine, "top1_agreement": result.top1_agreement, "passed": not failed}
        )
        log(
            f"{name}: {count} in float: min cosine {result.cosine:.4f} on the {images} calibration images "
            f"({held_back} held back from the ranges)"
            + (f": {'; '.join(failed)}" if failed else ": meets the gate's tolerance")
        )
        if not failed:
            break
    if held_back:  # the choice made, the ranges are refitted on every calibration image
        int8 = quantize(batches, ranking, count)
    return {**int8, "keep_float_search": {"checked_images": images, "held_back_images": held_back, "tries": tries}}


def keep_float_ladder(linear_layers: int) -> list[int]:
    """The numbers of Linear layers ``auto`` tries in float, in order: 0, 1, 2, 4, ... and last
    :data:`MAX_FLOAT_SHARE` of ``linear_layers`` (12 of a ViT-S's 49)."""
    cap = int(linear_layers * MAX_FLOAT_SHARE)
    ladder = [0]
    while ladder[-1] < cap:
        ladder.append(min(cap, max(1, 2 * ladder[-1])))
    return ladder


class HeldBack:
    """The range-calibration view of ``batches``: every :data:`HOLD_BACK_EVERY`-th image (counted
    across the batches) left out. Re-iterable like ``batches`` itself."""

    def __init__(self, batches: Iterable[torch.Tensor]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        start = 0
        for batch in self._batches:
            held = torch.arange(start, start + len(batch)) % HOLD_BACK_EVERY == HOLD_BACK_EVERY - 1
            start += len(batch)
            if (~held).any():
                yield batch[~held]

    @staticmethod
    def held_back(images: int) -> int:
        """How many of ``images`` images are held back."""
        return images // HOLD_BACK_EVERY


def linear_sensitivity(
    model: nn.Module, batches: Iterable[torch.Tensor], input_scales: dict | None = None, error_batches: int = 2
) -> list[str]:
    """Module paths of ``model``'s Linear layers, the most hurt by this recipe first: each layer's
    relative output error ``||Q(x) Q(W)^T - x W^T||^2 / ||x W^T||^2`` when only its own input
    (symmetric, per tensor, range = the calibration maximum, as minmax sets it) and weight
    (symmetric, per output channel) are rounded to int8, on the first ``error_batches`` batches;
    with ``input_scales`` (by module path) the rounded ones are the smoothed ``x / s`` and
    ``W diag(s)``.
    Local errors, not the model output's: they find the layers whose inputs carry outliers that
    a per-tensor range clips or crushes."""
    if iter(batches) is batches:  # read twice below: a one-pass iterator is materialised
        batches = list(batches)
    linears = {module: name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    peak: dict[str, float] = {}
    errors: dict[str, list[float]] = {name: [0.0, 0.0] for name in linears.values()}

    def smoothed(module, x):
        name = linears[module]
        scale = (input_scales or {}).get(name)
        return (x, module.weight, name) if scale is None else (x / scale, module.weight * scale, name)

    def record_peak(module, args, out):
        x, _, name = smoothed(module, args[0])
        peak[name] = max(peak.get(name, 0.0), float(x.abs().max()))

    def record_error(module, args, out):
        x, w, name = smoothed(module, args[0])
        step = max(peak[name], 1e-30) / 127
        w_step = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        rounded = F.linear((x / step).round().clamp(-127, 127) * step, (w / w_step).round() * w_step)
        exact = F.linear(x, w)
        errors[name][0] += float((rounded - exact).double().square().sum())
        errors[name][1] += float(exact.double().square().sum())

    with torch.no_grad():
        for hook, used in ((record_peak, batches), (record_error, itertools.islice(batches, error_batches))):
            handles = [module.register_forward_hook(hook) for module in linears]
            try:
                for batch in used:
                    model(batch)
            finally:
                for handle in handles:
                    handle.remove()
    return sorted(errors, key=lambda name: -errors[name][0] / max(errors[name][1], 1e-30))
