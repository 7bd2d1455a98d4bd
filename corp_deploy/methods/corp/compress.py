"""CORP's compression of one block (docs/method.md §2-4): selection and closed-form ridge
compensation of its MLP hidden channels, attention query/key head dims and value/output head
dims, to the kept sizes it is given.

Independent calibration (the paper): one pass of the dense block collects the statistics of
every pruned part and produces the (dense) next boundary; then the parts are compressed.
Sequential: each part is calibrated on the output of the parts compressed before it (query/key,
then values after the compressed query/key, then the MLP after the compressed attention), and
the compressed block gives the next boundary.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import channels
from ...blocks import (
    attention_output,
    attention_residual,
    block_exit,
    block_forward,
    mlp_branch,
    mlp_hidden,
    mlp_residual,
    probe_query_keys,
    residual_weight,
)
from ...layers import block_dims
from ...stats import MLP_HIDDEN, PROJ_INPUTS, MomentAccumulator
from ..base import BlockRun, CompressSettings
from . import qk_pruning, value_pruning
from .qk_statistics import HeadGrams
from .refit import DenseTargets
from .sizes import BlockSizes


def compress_block(
    block: nn.Module, run: BlockRun, config: CompressSettings, sizes: BlockSizes, targets: DenseTargets | None = None
) -> dict:
    """Independent calibration: statistics of the dense block, then compress; ``run.cache``
    advances through the dense block. ``targets``: where to keep what the dense block
    computes, for the drift refit (None: not kept). The query/key dims are folded from
    ``sizes.qk_solutions`` where the budget's curves solved them already."""
    grams = HeadGrams() if sizes.qk is not None and sizes.qk_solutions is None else None
    proj_inputs = (
        MomentAccumulator(block.attn.proj.in_features, run.cache.device, track_positive=False, activations=PROJ_INPUTS)
        if sizes.v is not None
        else None
    )
    moments = _mlp_moments(block, run, config) if sizes.mlp is not None else None

    def dense_step(x: torch.Tensor) -> torch.Tensor:
        a = attention_output(
            block,
            block.norm1(x),
            grams.add if grams is not None else None,
            proj_inputs.update if proj_inputs is not None else None,
        )
        mid = x + block.ls1(a)
        m = mlp_branch(block, mid, moments.update if moments is not None else None)
        if targets is not None:
            targets.add(x, a, m)
        return block_exit(block, mid + block.ls2(m))

    with run.timer("block_statistics"):
        run.cache.advance(dense_step)
        for statistics in (grams, proj_inputs, moments):
            if statistics is not None:
                statistics.all_reduce()
    info: dict = {}
    if grams is not None:
        with run.timer("attention_solve"):
            info["attention"] = compress_attention(block, grams, config, sizes.qk)
    elif sizes.qk is not None:
        info["attention"] = fold_solved_attention(
            block, sizes.orders["qk"][:, : sizes.qk].sort(dim=1).values, sizes.qk_solutions
        )
    if proj_inputs is not None:
        with run.timer("values_solve"):
            info["values"] = compress_values(block, proj_inputs, config, sizes.v, sizes.orders.get("vo"))
    if moments is not None:
        with run.timer("mlp_solve"):
            info["mlp"] = compress_mlp(block, moments, config, sizes.mlp, sizes.orders.get("mlp"))
    info["dims"] = block_dims(block).to_dict()
    return info


def compress_block_sequential(block: nn.Module, run: BlockRun, config: CompressSettings, sizes: BlockSizes) -> dict:
    """Sequential calibration: each part is calibrated on the output of the parts compressed
    before it; ``run.cache`` advances through the compressed block."""
    info: dict = {}
    if sizes.qk is not None:
        grams = HeadGrams()
        with run.timer("attention_statistics"):
            for x in run.cache.batches:
                probe_query_keys(block, x, grams.add)
            grams.all_reduce()
        with run.timer("attention_solve"):
            info["attention"] = compress_attention(block, grams, config, sizes.qk)
    if sizes.v is not None:
        proj_inputs = MomentAccumulator(
            block.attn.proj.in_features, run.cache.device, track_positive=False, activations=PROJ_INPUTS
        )
        with run.timer("values_statistics"):
            for x in run.cache.batches:
                attention_output(block, block.norm1(x), on_proj_input=proj_inputs.update)
            proj_inputs.all_reduce()
        with run.timer("values_solve"):
            info["values"] = compress_values(block, proj_inputs, config, sizes.v)
    if sizes.mlp is not None:
        moments = _mlp_moments(block, run, config)

        def through_attention(x: torch.Tensor) -> torch.Tensor:
            x = attention_residual(block, x)
            moments.update(mlp_hidden(block, x))
            return x

        with run.timer("block_statistics"):
            run.cache.advance(through_attention)
            moments.all_reduce()
        with run.timer("mlp_solve"):
            info["mlp"] = compress_mlp(block, moments, config, sizes.mlp)
        with run.timer("propagate"):
            run.cache.advance(lambda x: block_exit(block, mlp_residual(block, x)))
    else:
        with run.timer("propagate"):
            run.cache.advance(lambda x: block_forward(block, x))
    info["dims"] = block_dims(block).to_dict()
    return info


def _mlp_moments(block: nn.Module, run: BlockRun, config: CompressSettings) -> MomentAccumulator:
    return MomentAccumulator(
        block.mlp.fc1.out_features,
        run.cache.device,
        track_positive=config.options.ranker == "active",
        activations=MLP_HIDDEN,
    )


def compress_attention(block: nn.Module, grams: HeadGrams, config: CompressSettings, kept: int) -> dict:
    """Rank, solve and fold the query/key dims of ``block.attn`` to ``kept`` per head (replaced
    by a :class:`~corp_deploy.layers.PrunedAttention`); returns its report."""
    sums = grams.heads()
    S, P = qk_pruning.split_head_dims(qk_pruning.qk_dim_scores(sums), kept)
    heads = [
        qk_pruning.solve_head(head, S[h], P[h], config.options.ridge, config.compensation)
        for h, head in enumerate(sums)
    ]
    return fold_solved_attention(block, S, heads)


def fold_solved_attention(block: nn.Module, kept: torch.Tensor, heads: list[qk_pruning.HeadSolution]) -> dict:
    """Fold every head's solution into ``block.attn`` (replaced by a
    :class:`~corp_deploy.layers.PrunedAttention`) keeping the dims ``kept`` ``(H, d')`` (each row
    ascending); returns its report."""
    attn = block.attn
    block.attn = qk_pruning.fold_attention(attn, kept, [s.M for s in heads])
    scale2 = attn.scale**2
    err_unc = sum(s.error_uncompensated for s in heads) * scale2
    err_comp = sum(s.error_compensated for s in heads) * scale2
    energy = sum(s.logit_energy for s in heads) * scale2
    return {
        "qk_head_dim": kept.shape[1],
        "error_uncompensated": err_unc,
        "error_compensated": err_comp,
        "relative_error_uncompensated": err_unc / energy if energy else 0.0,
        "relative_error_compensated": err_comp / energy if energy else 0.0,
        "heads_worse_than_slicing": sum(s.error_compensated > s.error_uncompensated * (1 + 1e-9) for s in heads),
        "ridge_lambda": [s.ridge_lambda for s in heads],
    }


def compress_values(
    block: nn.Module,
    proj_inputs: MomentAccumulator,
    config: CompressSettings,
    kept: int,
    order: torch.Tensor | None = None,
) -> dict:
    """Select, solve and fold the value dims of ``block.attn`` to ``kept`` per head, compensated
    in the output projection (docs/method.md §4); returns its report. ``order``: the selection
    order of the proj-input channels, when already computed from these statistics."""
    attn = block.attn
    H = attn.num_heads
    w = residual_weight(attn.proj, block.ls1)
    if order is None:
        order = channels.keep_order(
            proj_inputs, w, config.options.ranker, config.options.ridge, groups=H, kept=kept * H
        )
    S, P = channels.split_order(order, kept * H)
    sol = channels.solve_channels(proj_inputs, w, S, P, config.options.ridge, config.compensation)
    block.attn = value_pruning.fold_values(attn, sol.kept, sol.pruned, sol.B, sol.c)
    return {"v_head_dim": kept, **_channel_errors(sol)}


def compress_mlp(
    block: nn.Module, moments: MomentAccumulator, config: CompressSettings, kept: int, order: torch.Tensor | None = None
) -> dict:
    """Select, solve and fold the hidden channels of ``block.mlp`` to ``kept`` (in place);
    returns its report. ``order``: the selection order, when already computed from these statistics."""
    w = residual_weight(block.mlp.fc2, block.ls2)
    if order is None:
        order = channels.keep_order(moments, w, config.options.ranker, config.options.ridge, kept=kept)
    S, P = channels.split_order(order, kept)
    sol = channels.solve_channels(moments, w, S, P, config.options.ridge, config.compensation)
    channels.fold_mlp(block.mlp, sol.kept, sol.pruned, sol.B, sol.c)
    return {"hidden": kept, **_channel_errors(sol)}


def _channel_errors(sol: channels.ChannelSolution) -> dict:
    """Errors of a channel solution in residual-stream units per token, absolute and relative
    to the part's output energy."""
    energy = sol.output_energy
    return {
        "error_uncompensated": sol.error_uncompensated,
        "error_compensated": sol.error_compensated,
        "relative_error_uncompensated": sol.error_uncompensated / energy if energy else 0.0,
        "relative_error_compensated": sol.error_compensated / energy if energy else 0.0,
        "ridge_lambda": sol.ridge_lambda,
    }
