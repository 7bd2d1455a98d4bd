"""The kept sizes of a block's parts, at uniform sparsities (a MAC budget allocates them
per block: :mod:`.budget`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...dims import kept_count
from ..base import CompressSettings
from .qk_pruning import HeadSolution


@dataclass(frozen=True)
class BlockSizes:
    """Kept dims of one block's parts; None leaves that part dense. ``qk`` and ``v`` are per head.
    ``orders`` (``mlp``, ``vo``, ``qk``) and ``qk_solutions`` (every head's query/key solution at
    size ``qk``): selections and compensations already computed from the dense statistics of this
    block (see :class:`~.curves.UnitCurve`), reused by independent calibration, whose statistics
    are the same."""

    mlp: int | None = None
    qk: int | None = None
    v: int | None = None
    orders: dict[str, torch.Tensor] = field(default_factory=dict)
    qk_solutions: list[HeadSolution] | None = None


def uniform_sizes(block: nn.Module, config: CompressSettings) -> BlockSizes:
    """The kept dims of ``block`` at the config's sparsities, for the parts it prunes."""
    return BlockSizes(
        **{
            field: kept_count(part.total(block), config.sparsity_of(part), config.round_to)
            for part in config.pruned_parts
            for field in part.size_fields
        }
    )
