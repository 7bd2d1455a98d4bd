"""Block-by-block calibration and compression of a timm VisionTransformer: CORP, and the
peer methods VBP and ToaSt through the same calibration cache (METHOD.md 5).

Memory: the hidden states at the current block boundary are cached for the whole
calibration set (``images x tokens x width`` float32 on the calibration device,
e.g. 155 MB for DeiT-B with 256 images) and overwritten in place as calibration moves
through a block, so no second copy is held. Attention statistics add per-image query
and key Grams (``images x heads x d x d`` float64 x 2, 100 MB for DeiT-B / 256 images)
for one block at a time; MLP statistics one ``H x H`` float64 matrix.

Cost: independent mode runs each dense block once over the calibration set, collecting
the query/key Grams and the MLP hidden Gram in the same pass. Sequential mode runs, per
block, the dense query/key projection (attention statistics), then the compressed
attention and the dense MLP up-projection (MLP statistics), then the compressed MLP
(next boundary). The MLP Gram (``tokens x H^2``, upper block triangle only) is the largest
single cost. VBP and ToaSt run each dense block once and keep only per-channel statistics.
No gradient is ever taken. Measured numbers: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import copy
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import attention as attn_ops
from . import mlp as mlp_ops
from . import toast as toast_ops
from . import vbp as vbp_ops
from .config import CompressConfig, kept_count
from .cost import count_macs, count_params, peak_memory_mb
from .errors import CorpError
from .layers import block_dims
from .models import check_prunable, check_vit, is_plain_attention, uses_class_token
from .stats import MomentAccumulator, per_image_head_grams


def compress(model: nn.Module, calibration_batches: Iterable[torch.Tensor],
             config: CompressConfig = CompressConfig(), *, progress: bool = False
             ) -> tuple[nn.Module, dict]:
    """Compress a timm ViT with ``config.method`` (CORP by default); the input model is left unchanged.

    Args:
        model: a timm ``VisionTransformer`` (dense).
        calibration_batches: iterable of preprocessed image batches ``(B, 3, H, W)``.
        config: what to prune and how.
        progress: show a progress bar on stderr.
    Returns:
        ``(compressed_model, report)``: the model in eval mode on the CPU, and a dict with
        the method, per-layer diagnostics, parameter/MAC counts, timings and peak memory.
    """
    check_vit(model)
    check_prunable(model, config.prunes_mlp, config.prunes_attn)
    device = _resolve_device(config.device)
    timer = _PhaseTimer()
    dense_params = count_params(model)

    model = copy.deepcopy(model).eval().to(device)  # never modify the caller's model
    with _Progress(progress) as bar, torch.no_grad():
        with timer("embed"):
            cache, n_images = _embed_all(model, calibration_batches, device, bar.images)
        if n_images == 0:
            raise CorpError("the calibration set is empty")
        input_size = cache.input_size
        dense_macs = count_macs(model, input_size)
        bar.start_blocks(len(model.blocks))
        compress_blocks = {"corp": _compress_corp, "vbp": _compress_vbp, "toast": _compress_toast}
        layers = compress_blocks[config.method](model, cache, config, timer, bar.block_done)
    model = model.cpu().eval()
    report = {
        "method": config.method,
        "calibration": {"images": n_images, "tokens_per_image": cache.tokens,
                        "input_size": list(input_size)},
        "params": {"dense": dense_params, "compressed": count_params(model)},
        "macs": {"dense": dense_macs, "compressed": count_macs(model, input_size)},
        "layers": layers,
        "time_s": timer.totals(),
        "peak_memory_mb": peak_memory_mb(device),
    }
    return model, report


class _BoundaryCache:
    """Hidden states entering the current block, one ``(B, N, C)`` tensor per batch."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.input_size: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.batches[0].shape[1] if self.batches else 0


def _embed_all(model: nn.Module, batches: Iterable[torch.Tensor], device: torch.device,
               on_batch: Callable[[int], None]) -> tuple[_BoundaryCache, int]:
    """Run each batch up to the first block (patch + position embedding, prefix tokens)."""
    cache = _BoundaryCache()
    n = 0
    for images in batches:
        if not isinstance(images, torch.Tensor) or images.ndim != 4:
            raise CorpError("calibration batches must be image tensors of shape (B, 3, H, W)")
        if not torch.isfinite(images).all():
            raise CorpError("calibration batch contains NaN or infinite values")
        if cache.input_size and tuple(images.shape[1:]) != cache.input_size:
            raise CorpError(f"calibration batches differ in image size: {tuple(images.shape[1:])} "
                            f"after {cache.input_size}")
        cache.input_size = tuple(images.shape[1:])
        cache.batches.append(embed_tokens(model, images.to(device, torch.float32)))
        n += images.shape[0]
        on_batch(images.shape[0])
    return cache, n


class _StopForward(Exception):
    pass


def embed_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The token sequence ``(B, N, C)`` that enters ``model.blocks[0]`` for ``images``."""
    captured = []

    def grab(module, args):
        captured.append(args[0])
        raise _StopForward

    handle = model.blocks[0].register_forward_pre_hook(grab)
    try:
        model.forward_features(images)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured[0]


def _compress_corp(model: nn.Module, cache: _BoundaryCache, config: CompressConfig, timer: "_PhaseTimer",
                   block_done: Callable[[], None]) -> list[dict]:
    layers = []
    for block in model.blocks:
        layers.append(_compress_block(block, cache, config, timer))
        block_done()
    return layers


def _compress_vbp(model: nn.Module, cache: _BoundaryCache, config: CompressConfig, timer: "_PhaseTimer",
                  block_done: Callable[[], None]) -> list[dict]:
    """VBP: hidden-channel moments of every dense MLP, one global variance ranking, mean fold."""
    moments = []
    with timer("block_statistics"):
        for block in model.blocks:
            stats = vbp_ops.ChannelMoments(block.mlp.fc1.out_features, cache.batches[0].device)
            _dense_pass(block, cache, lambda x, h: stats.update(h))
            moments.append(stats)
            block_done()
    layers = []
    with timer("mlp_solve"):
        counts = vbp_ops.global_kept_counts([m.variance for m in moments], config.s_mlp, config.layer_floor,
                                            config.round_to)
        for block, stats, kept in zip(model.blocks, moments, counts):
            S, P = mlp_ops.split_channels(stats.variance, kept)
            mlp_ops.fold_mlp(block.mlp, S, P, c=stats.mean[P] if config.compensation else None)
            total_variance = float(stats.variance.sum())
            layers.append({"mlp": {"hidden": kept,
                                   "pruned_variance_fraction": float(stats.variance[P].sum()) / total_variance
                                   if total_variance else 0.0},
                           "dims": block_dims(block).to_dict()})
    return layers


def _compress_toast(model: nn.Module, cache: _BoundaryCache, config: CompressConfig, timer: "_PhaseTimer",
                    block_done: Callable[[], None]) -> list[dict]:
    """ToaSt: FFN channels by token channel selection on the dense block's activations;
    query/key and value/proj dims by distance to each head's geometric median (weights only)."""
    class_token = uses_class_token(model)
    sampler = torch.Generator().manual_seed(0)  # token samples: reproducible
    layers = []
    for block in model.blocks:
        info: dict = {}
        if config.prunes_mlp:
            if class_token and not is_plain_attention(block.attn):
                raise CorpError("toast's FFN channel selection weights tokens by the class token's attention, "
                                f"which needs timm's plain Attention; this model has {type(block.attn).__name__}")
            importance = toast_ops.TokenChannelImportance(block.mlp.fc1.out_features, model.num_prefix_tokens,
                                                          class_token, config.token_fraction, sampler)
            attn = block.attn
            with timer("block_statistics"):
                _dense_pass(block, cache, lambda x, h: importance.update(
                    h, toast_ops.class_token_attention(attn, x) if class_token else None))
            with timer("mlp_solve"):
                kept = kept_count(block.mlp.fc1.out_features, config.s_mlp, config.round_to)
                S, P = mlp_ops.split_channels(importance.scores, kept)
                mlp_ops.fold_mlp(block.mlp, S, P)
            info["mlp"] = {"hidden": kept}
        # (attention only: the ranking reads weights, so the calibration tokens need not move on)
        if config.prunes_attn:
            with timer("attention_solve"):
                kept = kept_count(block.attn.head_dim, config.s_attn, config.round_to)
                qk, v = toast_ops.head_dim_importance(block.attn)
                block.attn = toast_ops.prune_heads(block.attn, toast_ops.top_dims(qk, kept),
                                                   toast_ops.top_dims(v, kept))
            info["attention"] = {"qk_head_dim": kept, "v_head_dim": kept}
        info["dims"] = block_dims(block).to_dict()
        layers.append(info)
        block_done()
    return layers


def _dense_pass(block: nn.Module, cache: _BoundaryCache,
                probe: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """Advance ``cache`` through the (still dense) ``block``, showing ``probe`` each batch's
    normalised attention input ``(B, N, C)`` and MLP hidden activations ``(B, N, H)``."""
    mlp = block.mlp
    for i, x in enumerate(cache.batches):
        xn = block.norm1(x)
        x = x + block.ls1(block.attn(xn))
        if probe is None:
            x = x + block.ls2(mlp(block.norm2(x)))
        else:
            h = mlp.act(mlp.fc1(block.norm2(x)))
            probe(xn, h)
            x = x + block.ls2(mlp.fc2(h))
        cache.batches[i] = x


def _compress_block(block: nn.Module, cache: _BoundaryCache, config: CompressConfig,
                    timer: "_PhaseTimer") -> dict:
    """Calibrate and compress one block; advance ``cache`` to the block's output.

    Sequential: (1) query/key Grams of the dense attention, compress the attention;
    (2) compressed attention, MLP statistics; compress the MLP; (3) compressed MLP gives
    the next boundary. Independent: one pass of the dense block collects both
    statistics and produces the (dense) next boundary; then both parts are compressed.
    """
    sequential = config.calibration == "sequential"
    mlp_stats = MomentAccumulator(block.mlp.fc1.out_features, cache.batches[0].device,
                                  track_positive=config.ranker == "active") \
        if config.prunes_mlp else None
    grams = _HeadGrams() if config.prunes_attn else None
    info: dict = {}
    if grams is not None and sequential:
        with timer("attention_statistics"):
            for x in cache.batches:
                _collect_qk_grams(block.attn, block.norm1(x), grams)
        with timer("attention_solve"):
            info["attention"] = _compress_attention(block, grams, config)
        grams = None

    fc1, fc2 = block.mlp.fc1, block.mlp.fc2  # dense until the MLP is compressed below
    with timer("block_statistics"):
        for i, x in enumerate(cache.batches):
            xn = block.norm1(x)
            x = x + block.ls1(_attend(block.attn, xn, grams) if grams is not None else block.attn(xn))
            if mlp_stats is None:
                x = x + block.ls2(block.mlp(block.norm2(x)))
            else:
                h = block.mlp.act(fc1(block.norm2(x)))
                mlp_stats.update(h)
                if not sequential:
                    x = x + block.ls2(fc2(h))
            cache.batches[i] = x
    if grams is not None:
        with timer("attention_solve"):
            info["attention"] = _compress_attention(block, grams, config)
    if mlp_stats is not None:
        with timer("mlp_solve"):
            info["mlp"] = _compress_mlp(block, mlp_stats, config)
        if sequential:
            with timer("propagate"):
                for i, x in enumerate(cache.batches):
                    cache.batches[i] = x + block.ls2(block.mlp(block.norm2(x)))
    info["dims"] = block_dims(block).to_dict()
    return info


class _HeadGrams:
    """Per-image query and key Grams of one attention layer, collected batch by batch."""

    def __init__(self) -> None:
        self.query: list[torch.Tensor] = []
        self.key: list[torch.Tensor] = []

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """``q``, ``k``: ``(B, H, N, d)``."""
        self.query.append(per_image_head_grams(q))
        self.key.append(per_image_head_grams(k))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N_images, H, d, d)`` float64 each."""
        return torch.cat(self.query), torch.cat(self.key)


def _collect_qk_grams(attn: nn.Module, x: torch.Tensor, grams: _HeadGrams) -> None:
    """Record the q/k Grams of timm ``Attention`` on normalised tokens ``x`` (B, N, C),
    projecting queries and keys only."""
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    rows = 2 * H * d
    bias = attn.qkv.bias[:rows] if attn.qkv.bias is not None else None
    q, k = F.linear(x, attn.qkv.weight[:rows], bias).reshape(B, N, 2, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    grams.add(q, k)


def _attend(attn: nn.Module, x: torch.Tensor, grams: _HeadGrams) -> torch.Tensor:
    """timm ``Attention`` on normalised tokens ``x`` (B, N, C), recording q/k Grams.

    Computes what ``attn(x)`` computes (its structure is checked by ``check_prunable``),
    reusing the query/key projections for the statistics.
    """
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    grams.add(q, k)
    out = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)
    return attn.proj(out.transpose(1, 2).reshape(B, N, H * d))


def _compress_attention(block: nn.Module, grams: _HeadGrams, config: CompressConfig) -> dict:
    attn = block.attn
    a_full, g_full = grams.stacked()  # head-major below: a_full[h] is contiguous (N, d, d)
    a_full, g_full = a_full.transpose(0, 1).contiguous(), g_full.transpose(0, 1).contiguous()
    H, d = attn.num_heads, attn.head_dim
    kept = kept_count(d, config.s_attn, config.round_to)
    scores = attn_ops.qk_dim_scores(a_full.transpose(0, 1), g_full.transpose(0, 1))
    S, P = attn_ops.split_head_dims(scores, kept)
    heads = [attn_ops.solve_head(a_full[h], g_full[h], S[h], P[h], config.ridge,
                                 config.compensation) for h in range(H)]
    block.attn = attn_ops.fold_attention(attn, S, [s.M for s in heads])
    scale2 = attn.scale ** 2
    err_unc = sum(s.error_uncompensated for s in heads) * scale2
    err_comp = sum(s.error_compensated for s in heads) * scale2
    energy = sum(s.logit_energy for s in heads) * scale2
    return {
        "qk_head_dim": kept,
        "error_uncompensated": err_unc,
        "error_compensated": err_comp,
        "relative_error_uncompensated": err_unc / energy if energy else 0.0,
        "relative_error_compensated": err_comp / energy if energy else 0.0,
        "heads_worse_than_slicing": sum(s.error_compensated > s.error_uncompensated * (1 + 1e-9)
                                        for s in heads),
        "ridge_lambda": [s.ridge_lambda for s in heads],
    }


def _compress_mlp(block: nn.Module, stats: MomentAccumulator, config: CompressConfig) -> dict:
    mlp = block.mlp
    hidden = mlp.fc1.out_features
    kept = kept_count(hidden, config.s_mlp, config.round_to)
    w2 = mlp.fc2.weight.detach()
    S, P = mlp_ops.split_channels(mlp_ops.channel_scores(stats, w2, config.ranker), kept)
    sol = mlp_ops.solve_mlp(stats, w2, S, P, config.ridge, config.compensation)
    mlp_ops.fold_mlp(mlp, sol.kept, sol.pruned, sol.B, sol.c)
    energy = sol.output_energy
    return {
        "hidden": kept,
        "error_uncompensated": sol.error_uncompensated,
        "error_compensated": sol.error_compensated,
        "relative_error_uncompensated": sol.error_uncompensated / energy if energy else 0.0,
        "relative_error_compensated": sol.error_compensated / energy if energy else 0.0,
        "ridge_lambda": sol.ridge_lambda,
    }


def _resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CorpError("--device cuda was requested but no CUDA GPU is available; use --device cpu")
    return torch.device(name)


class _PhaseTimer:
    """Accumulates wall time per named phase."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[phase] += time.perf_counter() - start

    def totals(self) -> dict[str, float]:
        out = {k: round(v, 4) for k, v in self._totals.items()}
        out["total"] = round(sum(self._totals.values()), 4)
        return out


class _Progress:
    """Progress on stderr: images loaded and embedded, then blocks calibrated (no-op if disabled)."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True))
            self._images = self._bar.add_task("loading calibration images", total=None)

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def images(self, count: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._images, count)

    def start_blocks(self, total: int) -> None:
        if self._bar is not None:
            done = self._bar.tasks[0].completed
            self._bar.update(self._images, total=done, completed=done)
            self._blocks = self._bar.add_task("calibrating blocks", total=total)

    def block_done(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._blocks)
