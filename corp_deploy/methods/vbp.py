"""VBP, variance-based MLP pruning (docs/method.md §5), one-shot.

Per MLP, the mean and variance of every post-activation hidden channel ``h_j`` (Welford);
channels are ranked by variance **globally across all MLPs** for one global pruning
rate, with a per-layer floor; each pruned activation is replaced by its mean, which folds
into the fc2 bias: ``b2' = b2 + W2[:, P] @ mu_P``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import channels, distributed
from ..blocks import block_forward
from ..errors import SettingError, check_setting_types
from ..families import blocks_of
from ..layers import block_dims
from ..parts import PARTS
from ..stats import MLP_HIDDEN, check_finite_sums
from .base import BlockRun, CompressSettings, Method, MethodOptions, option


@dataclass(frozen=True)
class VbpOptions(MethodOptions):
    """VBP's settings. ``layer_floor``: every MLP keeps at least this fraction of its channels
    (the global variance ranking would otherwise empty low-variance layers)."""

    layer_floor: float = option(0.1, "fraction of every MLP's channels always kept.")

    def __post_init__(self) -> None:
        check_setting_types(self)
        if not 0.0 <= self.layer_floor <= 1.0:
            raise SettingError(f"{{setting}} must be in [0, 1], got {self.layer_floor!r}", "layer_floor")


class Vbp(Method):
    name = "vbp"
    summary = "variance-based MLP pruning, global ranking, mean folded into the bias."
    prunes = "MLP hidden channels"
    targets = ("mlp",)
    default_target = "mlp"
    options_class = VbpOptions
    per_layer_sparsity = False
    runs_distributed = True

    def check_model(self, model: nn.Module, config: CompressSettings) -> None:
        """SettingError, before any calibration, when the per-layer floor leaves fewer removable
        channels than the sparsity removes (the model would be labelled with a sparsity it does not
        have; a floor of 1 keeps every channel)."""
        sizes = [block.mlp.fc1.out_features for block in blocks_of(model)]
        removable = sum(size - max(1, math.ceil(config.options.layer_floor * size)) for size in sizes)
        to_remove = math.floor(config.s_mlp * sum(sizes) + 0.5)
        if removable < to_remove:
            raise SettingError(
                f"{{setting}} {config.options.layer_floor:g} keeps so many channels of every MLP that at most "
                f"{removable} of the model's {sum(sizes)} MLP hidden channels can be removed, fewer than the "
                f"{to_remove} that {{setting}} {config.s_mlp:g} removes; lower one of them",
                "layer_floor",
                config.sparsity_setting(PARTS["mlp"]),
            )

    def compress_blocks(self, model: nn.Module, run: BlockRun, config: CompressSettings) -> list[dict]:
        """Hidden-channel moments of every dense MLP, one global variance ranking, mean fold."""
        moments = []
        with run.timer("block_statistics"):
            for block in blocks_of(model):
                stats = ChannelMoments(block.mlp.fc1.out_features, run.cache.device)
                run.cache.advance(lambda x: block_forward(block, x, on_hidden=stats.update))
                stats.all_reduce()
                moments.append(stats)
                run.block_done()
        layers = []
        with run.timer("mlp_solve"):
            counts = global_kept_counts(
                [m.variance for m in moments], config.s_mlp, config.options.layer_floor, config.round_to
            )
            for block, stats, kept in zip(blocks_of(model), moments, counts):
                S, P = channels.split_channels(stats.variance, kept)
                channels.fold_mlp(block.mlp, S, P, c=stats.mean[P] if config.compensation else None)
                total_variance = float(stats.variance.sum())
                layers.append(
                    {
                        "mlp": {
                            "hidden": kept,
                            "pruned_variance_fraction": float(stats.variance[P].sum()) / total_variance
                            if total_variance
                            else 0.0,
                        },
                        "dims": block_dims(block).to_dict(),
                    }
                )
        return layers


class ChannelMoments:
    """Per-channel mean and population variance of ``d``-dim samples, streamed (Welford).

    Batches are merged with Chan et al.'s parallel update: a batch's own mean and sum of
    squared deviations (float64) are combined with the running totals, so no large sums of
    raw squares are ever formed.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64, device=device)
        self._m2 = torch.zeros(dim, dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` of shape ``(..., d)`` (leading dims are flattened)."""
        x = x.reshape(-1, x.shape[-1]).double()
        m = x.shape[0]
        if m == 0:
            return
        batch_mean = x.mean(0)
        batch_m2 = (x - batch_mean).square().sum(0)
        total = self.n + m
        delta = batch_mean - self.mean
        self.mean += delta * (m / total)
        self._m2 += batch_m2 + delta.square() * (self.n * m / total)
        self.n = total

    def all_reduce(self) -> None:
        """The moments of every rank's samples under torch.distributed (no-op in one process): the
        same parallel update over the ranks, ``mu = sum_r n_r mu_r / n`` and
        ``M2 = sum_r (M2_r + n_r (mu_r - mu)^2)``."""
        if not distributed.active():
            return
        weighted = distributed.all_reduce_sum(torch.cat([self.mean * self.n, self.mean.new_tensor([self.n])]))
        total = int(weighted[-1])
        mean = weighted[:-1] / max(total, 1)
        self._m2 = distributed.all_reduce_sum(self._m2 + self.n * (self.mean - mean).square())
        self.mean, self.n = mean, total

    @property
    def variance(self) -> torch.Tensor:
        """Population variance ``E[(h - mu)^2]`` per channel, float64 ``(d,)``, checked to be finite
        with the mean (:func:`~corp_deploy.stats.check_finite_sums`)."""
        check_finite_sums(MLP_HIDDEN, self.mean, self._m2)
        return self._m2 / max(self.n, 1)


def global_kept_counts(variances: list[torch.Tensor], sparsity: float, floor: float, round_to: int = 1) -> list[int]:
    """How many channels each layer keeps under one global variance ranking.

    ``round(sparsity * total)`` channels are removed over all layers together (the
    lowest variances, ties broken by layer order), except that layer ``l`` always keeps at
    least ``ceil(floor * H_l)`` (and at least one) channel. Counts are then rounded to the
    nearest multiple of ``round_to`` within ``[round_to, H_l]``, which can move the total a
    little.
    """
    sizes = [len(v) for v in variances]
    total = sum(sizes)
    to_remove = math.floor(sparsity * total + 0.5)
    floors = [max(1, math.ceil(floor * size)) for size in sizes]
    # Each layer's removable channels are its lowest-variance ones beyond its floor.
    candidates = []
    for layer, (var, keep_at_least) in enumerate(zip(variances, floors)):
        removable = torch.sort(var.double()).values[: len(var) - keep_at_least]
        candidates += [(float(value), layer) for value in removable]
    candidates.sort(key=lambda item: item[0])
    kept = list(sizes)
    for _, layer in candidates[:to_remove]:
        kept[layer] -= 1
    if round_to > 1:
        kept = [max(round_to, min(size, round_to * math.floor(k / round_to + 0.5))) for k, size in zip(kept, sizes)]
    return kept
