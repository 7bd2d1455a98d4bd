"""CORP (docs/method.md §2-3): per-layer ranking and closed-form ridge compensation of MLP hidden
channels and attention query/key head dims, block by block.

Independent calibration (the paper): one pass of the dense block collects the query/key Grams
and the MLP hidden moments and produces the (dense) next boundary; then both parts are
compressed. Sequential: (1) query/key Grams of the dense attention, compress the attention;
(2) the compressed attention's output gives the MLP moments; compress the MLP; (3) the
compressed MLP gives the next boundary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import attention as attn_ops
from .. import mlp as mlp_ops
from ..blocks import attention_residual, block_forward, mlp_hidden, mlp_residual, project_qk
from ..dims import kept_count
from ..layers import block_dims
from ..stats import MomentAccumulator, per_image_head_grams
from .base import BlockRun, Method

if TYPE_CHECKING:
    from ..config import CompressConfig


class Corp(Method):
    name = "corp"
    summary = "ranking plus closed-form compensation."
    prunes = "MLP hidden channels and attention query/key dims"
    targets = ("mlp", "attn", "both")
    default_target = "both"
    options = ("ranker", "ridge", "calibration")

    def compress_blocks(self, model: nn.Module, run: BlockRun, config: "CompressConfig") -> list[dict]:
        compress_block = _compress_block_sequential if config.calibration == "sequential" else _compress_block
        layers = []
        for block in model.blocks:
            layers.append(compress_block(block, run, config))
            run.block_done()
        return layers


def _compress_block(block: nn.Module, run: BlockRun, config: "CompressConfig") -> dict:
    """Independent calibration: statistics of the dense block, then compress; ``run.cache``
    advances through the dense block."""
    grams = HeadGrams() if config.prunes_attn else None
    moments = _mlp_moments(block, config) if config.prunes_mlp else None
    with run.timer("block_statistics"):
        run.cache.advance(lambda x: block_forward(block, x, on_qk=grams.add if grams is not None else None,
                                                  on_hidden=moments.update if moments is not None else None))
    info: dict = {}
    if grams is not None:
        with run.timer("attention_solve"):
            info["attention"] = compress_attention(block, grams, config)
    if moments is not None:
        with run.timer("mlp_solve"):
            info["mlp"] = compress_mlp(block, moments, config)
    info["dims"] = block_dims(block).to_dict()
    return info


def _compress_block_sequential(block: nn.Module, run: BlockRun, config: "CompressConfig") -> dict:
    """Sequential calibration: each part is calibrated on the output of the parts compressed
    before it; ``run.cache`` advances through the compressed block."""
    info: dict = {}
    if config.prunes_attn:
        grams = HeadGrams()
        with run.timer("attention_statistics"):
            for x in run.cache.batches:
                grams.add(*project_qk(block.attn, block.norm1(x)))
        with run.timer("attention_solve"):
            info["attention"] = compress_attention(block, grams, config)
    if config.prunes_mlp:
        moments = _mlp_moments(block, config)

        def through_attention(x: torch.Tensor) -> torch.Tensor:
            x = attention_residual(block, x)
            moments.update(mlp_hidden(block, x))
            return x
        with run.timer("block_statistics"):
            run.cache.advance(through_attention)
        with run.timer("mlp_solve"):
            info["mlp"] = compress_mlp(block, moments, config)
        with run.timer("propagate"):
            run.cache.advance(lambda x: mlp_residual(block, x))
    else:
        with run.timer("propagate"):
            run.cache.advance(lambda x: block_forward(block, x))
    info["dims"] = block_dims(block).to_dict()
    return info


def _mlp_moments(block: nn.Module, config: "CompressConfig") -> MomentAccumulator:
    return MomentAccumulator(block.mlp.fc1.out_features, block.mlp.fc1.weight.device,
                             track_positive=config.ranker == "active")


class HeadGrams:
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


def compress_attention(block: nn.Module, grams: HeadGrams, config: "CompressConfig") -> dict:
    """Rank, solve and fold the query/key dims of ``block.attn`` (replaced by a
    :class:`~corp_deploy.layers.PrunedAttention`); returns its report."""
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


def compress_mlp(block: nn.Module, moments: MomentAccumulator, config: "CompressConfig") -> dict:
    """Rank, solve and fold the hidden channels of ``block.mlp`` (in place); returns its report."""
    mlp = block.mlp
    hidden = mlp.fc1.out_features
    kept = kept_count(hidden, config.s_mlp, config.round_to)
    w2 = mlp.fc2.weight.detach()
    S, P = mlp_ops.split_channels(mlp_ops.channel_scores(moments, w2, config.ranker), kept)
    sol = mlp_ops.solve_mlp(moments, w2, S, P, config.ridge, config.compensation)
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
