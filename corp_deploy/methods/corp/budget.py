"""Budget mode: measure every unit's error curve on the dense model, allocate the MAC budget,
and hand CORP the per-block sizes (docs/method.md §8)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...blocks import embed_tokens
from ...cost import count_macs, share_text
from ...families import blocks_of
from ...models import model_transform
from ...parts import UNIT_PARTS
from ..base import BlockRun, CompressSettings
from .allocation import Unit, allocate, check_feasible
from .curves import measure_curves, unit_shapes
from .sizes import BlockSizes


def _budget(model: nn.Module, input_size: tuple[int, ...], tokens: int, config: CompressSettings):
    """``(dense MACs, budget MACs, every unit's (total, MACs per dim), fixed MACs)`` of ``model`` at
    ``input_size`` (``tokens`` entering the first block) under ``config``'s budget."""
    dense_macs = count_macs(model, input_size)
    shapes = unit_shapes(model, tokens, config.parts)
    fixed = dense_macs - sum(total * per_dim for total, per_dim in shapes)
    return dense_macs, math.floor(config.options.macs_fraction * dense_macs), shapes, fixed


def check_budget(model: nn.Module, config: CompressSettings) -> None:
    """CorpError, before any calibration, when ``config``'s MAC budget is below what ``model`` needs
    with every unit at its floor (:func:`~.allocation.check_feasible`), measured on a blank image."""
    input_size = tuple(model_transform(model)[1]["input_size"])
    parameter = next(model.parameters())
    with torch.no_grad():
        tokens = embed_tokens(model, torch.zeros(1, *input_size, dtype=parameter.dtype, device=parameter.device))
    _, budget_macs, shapes, fixed = _budget(model, input_size, tokens[0, ..., 0].numel(), config)
    check_feasible(shapes, fixed, budget_macs, config.round_to, config.options.unit_floor)


def plan_budget(model: nn.Module, run: BlockRun, config: CompressSettings) -> tuple[list[BlockSizes], dict]:
    """The kept sizes of every block under ``config``'s MAC budget (checked feasible before the
    calibration: :func:`check_budget`), and the budget's report (every unit's kept size, error and
    distortion). ``run.cache`` is left where it was."""
    options = config.options
    dense_macs, budget_macs, shapes, fixed = _budget(model, run.cache.input_size, run.cache.tokens, config)
    if budget_macs >= dense_macs:
        return _whole_model(model, run, config, dense_macs, budget_macs)
    with run.timer("budget_curves"):
        curves = measure_curves(model, run.cache.clone(), config, run.block_done)
    kept = allocate(
        [Unit(c.total, c.macs_per_dim, c.distortion) for c in curves],
        fixed,
        budget_macs,
        config.round_to,
        options.unit_floor,
    )
    per_block: list[dict] = [{"orders": {}} for _ in blocks_of(model)]
    for curve, size in zip(curves, kept):
        for field in UNIT_PARTS[curve.part].size_fields:
            per_block[curve.block][field] = size
        per_block[curve.block]["orders"].update(curve.orders)
        if curve.qk_solutions and config.compensation:  # only slicing: nothing to reuse
            per_block[curve.block]["qk_solutions"] = curve.qk_solutions[size]
    sizes = [BlockSizes(**parts) for parts in per_block]
    planned = fixed + sum(c.macs_per_dim * k for c, k in zip(curves, kept))
    report = {
        "macs_fraction": options.macs_fraction,
        "dense_macs": dense_macs,
        "budget_macs": budget_macs,
        "planned_macs": planned,
        "distortion": options.distortion,
        "units": [
            {
                "block": c.block,
                "part": c.part,
                "total": c.total,
                "kept": k,
                "error": float(c.error[k]),
                "distortion": float(c.distortion[k]),
            }
            for c, k in zip(curves, kept)
        ],
    }
    return sizes, report


def _whole_model(
    model: nn.Module, run: BlockRun, config: CompressSettings, dense_macs: int, budget_macs: int
) -> tuple[list[BlockSizes], dict]:
    """:func:`plan_budget`'s answer, at once, for a budget that the dense model fits (``--macs 1``,
    ``--speedup 1``): every unit keeps all its dims, with no error; no curve is measured."""
    blocks = blocks_of(model)
    for _ in blocks:
        run.block_done()  # the measuring pass, skipped
    full = [(i, part, part.total(block)) for i, block in enumerate(blocks) for part in config.pruned_parts]
    report = {
        "macs_fraction": config.options.macs_fraction,
        "dense_macs": dense_macs,
        "budget_macs": budget_macs,
        "planned_macs": dense_macs,
        "distortion": config.options.distortion,
        "units": [
            {"block": i, "part": part.name, "total": total, "kept": total, "error": 0.0, "distortion": 0.0}
            for i, part, total in full
        ],
    }
    sizes = [
        BlockSizes(**{field: part.total(block) for part in config.pruned_parts for field in part.size_fields})
        for block in blocks
    ]
    return sizes, report


def allocation_table(budget: dict):
    """The budget report of :func:`plan_budget` as a rich table: per block, the kept dims of every
    unit (of its full size) and its distortion."""
    from rich.table import Table

    parts = list(dict.fromkeys(u["part"] for u in budget["units"]))
    table = Table(
        title=f"budget {share_text(budget['macs_fraction'])} of the dense MACs: "
        f"{budget['planned_macs'] / 1e9:.4g} of {budget['dense_macs'] / 1e9:.4g} GMACs",
        caption=f"kept / full (distortion, {budget['distortion']})",
    )
    table.add_column("block", justify="right", overflow="fold")
    for part in parts:
        table.add_column(UNIT_PARTS[part].short_label, justify="right", overflow="fold")
    by_key = {(u["block"], u["part"]): u for u in budget["units"]}
    for block in sorted({u["block"] for u in budget["units"]}):
        table.add_row(
            str(block),
            *[f"{u['kept']}/{u['total']} ({u['distortion']:.2g})" for u in (by_key[block, part] for part in parts)],
        )
    return table
