"""Block-by-block calibration and compression of a timm VisionTransformer with one of the
methods of :mod:`corp_deploy.methods` (CORP by default).

The engine embeds the calibration images once, then hands the method the hidden states at
the first block boundary; the method moves them through the model block by block while it
collects statistics and compresses (see each method's module for its passes and costs). Under
torch.distributed (``torchrun``) every process is given the same batches and embeds its share of
them; CORP sums its statistics over the processes (:mod:`corp_deploy.distributed`).

Memory: the hidden states at the current block boundary are cached for the whole
calibration set (``images x tokens x width`` float32 on the calibration device,
e.g. 155 MB for DeiT-B with 256 images) and overwritten in place as calibration moves
through a block, so no second copy is held. CORP's attention statistics add per-image query
and key Grams (``images x heads x d x d`` float32 x 2, 100 MB for DeiT-B / 256 images; past
1056 images their Kronecker sums instead, 415 MB: :class:`~corp_deploy.methods.corp.qk_statistics.HeadGrams`)
for one block at a time; its MLP statistics one ``H x H`` float64 matrix. CORP's drift refit
(docs/method.md §10) adds a second cache of the same size (the compressed model's hidden
states) and, for one block at a time, two targets formed from the dense block's input, attention
and MLP outputs, and the compressed attention's output-projection inputs (three more, at most).
No gradient is taken, except by the optional recovery after compression (:mod:`corp_deploy.recovery`).
Measured numbers: lab/RESULTS.md.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from . import distributed
from .blocks import BoundaryCache, embed_tokens
from .calibration import BATCHES, check_batch
from .config import CompressConfig
from .cost import count_macs, count_params, peak_memory_mb
from .dims import kept_count
from .errors import CorpError, SettingError, check_flags, check_instance, first_line
from .families import blocks_of, check_prunable, standard_form
from .methods import METHODS, BlockRun
from .models import check_finite, check_vit, model_transform
from .parts import Part
from .progress import CompressionProgress
from .recovery import RecoveryConfig, RecoveryImages, recover
from .resources import FLOAT32, inference_bytes


def compress(
    model: nn.Module,
    calibration_batches: Iterable[torch.Tensor],
    config: CompressConfig = CompressConfig(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    progress: bool = False,
    in_place: bool = False,
    on_measure: Callable[[int, nn.Module], None] | None = None,
) -> tuple[nn.Module, dict]:
    """Compress a timm ViT with ``config.method`` (CORP by default), then recover it if
    ``config.recovery`` is on (:func:`_compress_and_recover`); the input model is left unchanged
    unless ``in_place``.

    Args:
        model: a timm ``VisionTransformer`` (dense).
        calibration_batches: iterable of preprocessed image batches ``(B, 3, H, W)``.
        config: what to prune and how.
        progress: show progress on stderr: bars on a terminal; elsewhere (a CI log) one line per
            validation measurement of a recovery.
        in_place: compress ``model`` itself instead of a copy (the returned model is ``model``; after
            a failure it is left part-compressed): one copy of the weights less in memory (a
            recovery still copies the dense model, its teacher, and returns that copy compressed
            again when it kept no step).
        on_measure: given to :func:`~corp_deploy.recovery.recover` (for studies and logging).
    Returns:
        ``(compressed_model, report)``: the model in eval mode on the CPU, and a dict with
        the method, per-layer diagnostics, parameter/MAC counts, timings and peak memory.
    """
    check_instance("config", config, CompressConfig)
    check_instance("calibration_batches", calibration_batches, Iterable, BATCHES)
    check_flags(progress=progress, in_place=in_place)
    check_vit(model)
    check_finite(model, "the model to compress")
    if config.recovery.enabled:
        return _compress_and_recover(model, calibration_batches, config, progress, in_place, on_measure)
    model = standard_form(model if in_place else copy.deepcopy(model)).eval()
    dense_params = count_params(model)  # in the form the compressed model's parameters are counted in
    check_prunable(model, config.parts)
    method = METHODS[config.method]
    if distributed.active() and not method.runs_distributed:
        runs = " and ".join(name for name, m in METHODS.items() if m.runs_distributed)
        raise SettingError(
            f"{{setting}} {config.method} does not run under torch.distributed yet ({runs} do); run it in one process",
            "method",
        )
    method.check_model(model, config)
    check_kept_sizes(model, config)
    device = resolve_device(config.device)
    timer = _PhaseTimer(device)
    model = model.to(device)
    with CompressionProgress(progress) as bar, torch.no_grad():
        with timer("embed"):
            cache, n_images = embed_all(model, calibration_batches, device, bar.images)
        images_per_rank = distributed.gather_counts(n_images)
        n_images = sum(images_per_rank)
        if n_images == 0:
            raise CorpError("the calibration set is empty")
        if min(images_per_rank) == 0:
            raise CorpError(
                f"the {n_images} calibration images come in fewer batches than there are processes "
                f"({distributed.world_size()}): give every process at least one batch (a smaller "
                "batch size or more images)"
            )
        input_size = cache.input_size
        dense_macs = count_macs(model, input_size)
        bar.start_blocks(method.block_steps(model, config))
        run = BlockRun(cache, timer, bar.block_done)
        layers = method.compress_blocks(model, run, config)
    model = model.cpu().eval()
    report = {
        "method": config.method,
        "calibration": {"images": n_images, "tokens_per_image": cache.tokens, "input_size": list(input_size)},
        "params": {"dense": dense_params, "compressed": count_params(model)},
        "macs": {"dense": dense_macs, "compressed": count_macs(model, input_size)},
        "layers": layers,
        **run.report,
        **(
            {"distributed": {"world_size": distributed.world_size(), "images_per_rank": images_per_rank}}
            if distributed.active()
            else {}
        ),
        "time_s": timer.totals(),
        "peak_memory_mb": peak_memory_mb(device),
    }
    return model, report


def _compress_and_recover(
    model: nn.Module,
    calibration_batches: Iterable[torch.Tensor],
    config: CompressConfig,
    progress: bool,
    in_place: bool,
    on_measure: Callable[[int, nn.Module], None] | None,
) -> tuple[nn.Module, dict]:
    """:func:`compress` with ``config.recovery`` (docs/method.md §11): compression fits on the
    images of the sources recovery trains on, then recovery distils from the dense model and keeps
    the weights of its best step on the held-out ones (:func:`~corp_deploy.recovery.recover`). If
    it kept none, the model is compressed again on all the images: exactly what compress gives
    without recovery. The report is that of the compression returned, with the recovery's under
    ``"recovery"`` and its time (with the first compression's, when there were two) under
    ``time_s["recover"]``."""
    images = RecoveryImages(calibration_batches, model_transform(model)[1], config.recovery)
    fit = images.fit_batches()
    if len(fit) < distributed.world_size():  # compress's own message would not say why there are so few
        training, held = images.sources
        raise CorpError(
            f"recovery holds out {held} of the {training + held} calibration sources for validation, and the "
            f"{sum(len(batch) for batch in fit)} images of the others, which compression fits on, come in "
            f"{len(fit)} batch{'es' if len(fit) != 1 else ''}: fewer than there are processes "
            f"({distributed.world_size()}); give every process at least one batch (a smaller batch size or more images)"
        )
    plain, device = replace(config, recovery=RecoveryConfig()), resolve_device(config.device)
    teacher = standard_form(copy.deepcopy(model))
    began = time.perf_counter()
    student, report = compress(model, fit, plain, progress=progress, in_place=in_place)
    recovery = recover(student.to(device), teacher, images, config.recovery, progress=progress, on_measure=on_measure)
    recovering = time.perf_counter() - began
    if recovery["best_step"]:
        recovering -= report["time_s"]["total"]
    else:  # nothing gained: the model compress gives without recovery, fitted on every image
        del student
        student, report = compress(teacher, images.batches, plain, progress=progress, in_place=True)
    report["recovery"] = recovery
    report["time_s"]["recover"] = round(recovering, 4)
    report["time_s"]["total"] = round(report["time_s"]["total"] + recovering, 4)
    report["peak_memory_mb"] = peak_memory_mb(device)
    return student.cpu().eval(), report


def check_kept_sizes(model: nn.Module, config: CompressConfig) -> None:
    """SettingError, before any calibration, when the kept sizes cannot be what ``config`` asks:
    ``round_to`` exceeds the dims of a part to be pruned, or a sparsity above 0 keeps every dim
    of a part once rounded (to a whole number of dims, or to a multiple of ``round_to``): the
    model would be labelled with a sparsity it does not have. VBP's sparsity is one global rate
    over every block's MLP (per-layer counts follow the data): refused when it removes no channel
    of the whole model."""
    per_layer = METHODS[config.method].per_layer_sparsity
    blocks = blocks_of(model)
    for part in config.pruned_parts:
        sparsity = config.sparsity_of(part)
        for i, block in enumerate(blocks):
            total = part.total(block)
            if config.round_to > total:
                raise SettingError(
                    f"{{setting}} {config.round_to} is larger than the {total} {part.label} of block {i}: "
                    f"nothing could be pruned there; use {{setting}} {total} or less",
                    "round_to",
                    "round_to",
                )
            if per_layer and sparsity and kept_count(total, sparsity, config.round_to) == total:
                _refuse_pruning_nothing(config, part, sparsity, total, f"block {i}")
        whole = sum(part.total(block) for block in blocks)
        if not per_layer and sparsity and kept_count(whole, sparsity) == whole:
            _refuse_pruning_nothing(config, part, sparsity, whole, "the model")


def _refuse_pruning_nothing(config: CompressConfig, part: Part, sparsity: float, total: int, where: str) -> None:
    """The SettingError of :func:`check_kept_sizes` for a sparsity that keeps all ``total`` dims of
    ``part`` in ``where`` (a block, or the whole model)."""
    setting = config.sparsity_setting(part)
    if config.round_to == 1:
        raise SettingError(
            f"{{setting}} {sparsity:g} keeps all {total} {part.label} of {where} ({sparsity:g} x {total} = "
            f"{sparsity * total:.3g} rounds to none removed): nothing would be pruned; raise the sparsity",
            setting,
        )
    raise SettingError(
        f"{{setting}} {sparsity:g} keeps all {total} {part.label} of {where} once rounded to a multiple of "
        f"{config.round_to} ({{setting}}): nothing would be pruned; raise the sparsity or lower the rounding",
        setting,
        "round_to",
    )


def _embedded(model: nn.Module, images: torch.Tensor):
    """:func:`embed_tokens` of one calibration batch; CorpError when the model cannot take images
    of its shape (channels or size other than the model's)."""
    try:
        return embed_tokens(model, images)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise CorpError(
            f"the model cannot take calibration images of shape {tuple(images.shape[1:])}: {first_line(exc)}"
        ) from None


def embed_all(
    model: nn.Module, batches: Iterable[torch.Tensor], device: torch.device, on_batch: Callable[[int], None]
) -> tuple[BoundaryCache, int]:
    """Run each batch up to the first block (patch + position embedding, prefix tokens); under
    torch.distributed only this rank's batches (batch ``b`` goes to rank ``b mod world size``;
    every batch is checked on every rank, so that a bad one stops all ranks alike). Returns the
    cache and the number of images in it."""
    cache = BoundaryCache()
    n = seen = 0
    for index, images in enumerate(batches):
        check_batch(images)
        if cache.input_size and tuple(images.shape[1:]) != cache.input_size:
            raise CorpError(
                f"calibration batches differ in image size: {tuple(images.shape[1:])} after {cache.input_size}"
            )
        cache.input_size = tuple(images.shape[1:])
        if index % distributed.world_size() == distributed.rank():
            cache.batches.append(_embedded(model, images.to(device, torch.float32)))
            cache.offsets.append(seen)
            n += images.shape[0]
        seen += images.shape[0]
        on_batch(images.shape[0])
    return cache, n


def compress_bytes(model: nn.Module, input_size: tuple[int, ...], images: int, batch: int) -> int:
    """A lower bound on the memory compressing the loaded ``model`` in place on ``images`` images in
    batches of ``batch`` adds: the hidden states of every image at a block boundary (the calibration
    cache) and one batch's inference."""
    parameter = next(model.parameters())
    with torch.no_grad():
        tokens = embed_tokens(model, torch.zeros(1, *input_size, device=parameter.device, dtype=parameter.dtype))
    return images * tokens.numel() * FLOAT32 + inference_bytes(model, input_size, min(batch, images))


def resolve_device(name: str) -> torch.device:
    """The torch device ``cpu``, ``cuda`` or ``cuda:N`` names; CorpError when it is a GPU this
    machine does not have (the one check the CLI and the library share)."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CorpError(f"--device {name} was requested but no CUDA GPU is available; use --device cpu")
        index = torch.device(name).index
        if index is not None and index >= torch.cuda.device_count():
            raise CorpError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)


class _PhaseTimer:
    """Accumulates wall time per named phase. On a CUDA ``device`` each phase waits for the GPU
    at its start and end, so that kernels still queued are charged to the phase that queued them."""

    def __init__(self, device: torch.device) -> None:
        self._totals: dict[str, float] = defaultdict(float)
        self._device = device

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._totals[phase] += self._now() - start

    def totals(self) -> dict[str, float]:
        out = {k: round(v, 4) for k, v in self._totals.items()}
        out["total"] = round(sum(self._totals.values()), 4)
        return out
