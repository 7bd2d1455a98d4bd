"""CORP (docs/method.md §2-4, §8): per-layer selection and closed-form ridge compensation of MLP
hidden channels, attention query/key head dims and value/output head dims, block by block, at
uniform sparsities or at the per-block sizes a MAC budget allocates.

Modules: :mod:`.options` (its settings), :mod:`.sizes` (kept sizes at uniform sparsities),
:mod:`.budget` (a MAC budget: :mod:`.curves` measures every unit's error curve, :mod:`.allocation`
spends the budget over them), :mod:`.compress` (one block's compression to given sizes: MLP
channels through :mod:`corp_deploy.channels`, query/key dims through :mod:`.qk_pruning` on the
statistics of :mod:`.qk_statistics`, value/output dims through :mod:`.value_pruning`),
:mod:`.refit` (the drift-correcting refit).
"""

from __future__ import annotations

from torch import nn

from ...families import blocks_of
from ..base import BlockRun, CompressSettings, Method
from .budget import allocation_table, check_budget, plan_budget
from .compress import compress_block, compress_block_sequential
from .options import CorpOptions
from .refit import REFIT_LAYERS, DriftRefit
from .sizes import uniform_sizes


class Corp(Method):
    name = "corp"
    runs_distributed = True
    summary = "ranking plus closed-form compensation; sparsities or a MAC budget."
    prunes = "MLP hidden channels, attention query/key dims and value/output dims"
    targets = ("mlp", "attn", "vo", "both", "mlp-vo", "all")
    default_target = "both"
    options_class = CorpOptions

    def block_steps(self, model: nn.Module, config: CompressSettings) -> int:
        return len(blocks_of(model)) * (2 if config.has_budget else 1)  # a budget first measures every block

    def check_model(self, model: nn.Module, config: CompressSettings) -> None:
        if config.has_budget:
            check_budget(model, config)

    def compress_blocks(self, model: nn.Module, run: BlockRun, config: CompressSettings) -> list[dict]:
        if config.has_budget:
            sizes, run.report["budget"] = plan_budget(model, run, config)
        else:
            sizes = [uniform_sizes(block, config) for block in blocks_of(model)]
        options = config.options
        # CorpOptions.check leaves the refit "none" with sequential calibration or without compensation
        refit = (
            DriftRefit(model, run.cache, REFIT_LAYERS[options.refit], options.refit_shrink)
            if options.refit != "none"
            else None
        )
        if refit is not None:
            run.report["refit"] = {"layers": list(refit.layers), "shrink": options.refit_shrink}
        compress = compress_block_sequential if options.calibration == "sequential" else compress_block
        layers = []
        for block, size in zip(blocks_of(model), sizes):
            if refit is None:
                layers.append(compress(block, run, config, size))
            else:
                targets = refit.targets(block)
                layers.append(compress_block(block, run, config, size, targets))
                with run.timer("refit"):
                    layers[-1]["refit"] = refit.refit_block(block, targets)
            run.block_done()
        return layers

    def report_tables(self, report: dict) -> list:
        return [allocation_table(report["budget"])] if "budget" in report else []


__all__ = ["Corp", "CorpOptions"]
