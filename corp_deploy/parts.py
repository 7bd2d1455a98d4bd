"""The parts of a transformer block that can be pruned, as records (like families and methods).

A block has three prunable parts: the MLP's hidden channels (``mlp``), the query/key dims of every
attention head (``qk``) and the value dims of every head with their output-projection columns
(``vo``). Each :class:`Part` holds every name the part goes by: its key in reports and budgets, its
sparsity setting and command-line option, the :class:`~corp_deploy.methods.corp.sizes.BlockSizes`
field its kept count sets, its key in a compress report's per-layer entries, and its labels.
A *target* (``--target``) names the set of parts a compression prunes (:data:`TARGET_PARTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .layers import head_dims


@dataclass(frozen=True)
class Part:
    """One prunable part of a block.

    Attributes:
        name: its key in targets, budgets and allocations (``mlp``, ``qk``, ``vo``; ``qkvo`` for
            a budget unit that ties query/key to value dims).
        label: what its dims are (``MLP hidden channels``), in messages.
        short_label: the same in a table column or a plot legend.
        setting: the :class:`~corp_deploy.config.CompressConfig` sparsity field that prunes it
            (``s_mlp``); None for ``qkvo``, which only a budget sizes.
        size_fields: the ``BlockSizes`` fields its kept count sets (``vo`` sets ``v``).
        tag: how it is written in a default output folder name (``mlp0.5-attn0.3``).
        report_key: its key in a compress report's per-layer entries, with ``error_label`` the
            output whose error is reported there.
        total: the dims it has in one block (per head for attention parts).
    """

    name: str
    label: str
    short_label: str
    setting: str | None
    size_fields: tuple[str, ...]
    tag: str
    report_key: str
    error_label: str
    total: Callable[[nn.Module], int]

    @property
    def option(self) -> str | None:
        """The command-line option of its sparsity (``--s-mlp``)."""
        return None if self.setting is None else "--" + self.setting.replace("_", "-")


MLP = Part(
    "mlp",
    "MLP hidden channels",
    "MLP hidden",
    "s_mlp",
    ("mlp",),
    "mlp",
    "mlp",
    "MLP output",
    lambda block: block.mlp.fc1.out_features,
)
QUERY_KEY = Part(
    "qk",
    "query/key dims per head",
    "query/key dims",
    "s_attn",
    ("qk",),
    "attn",
    "attention",
    "attention logits",
    lambda block: head_dims(block.attn)[0],
)
VALUE_OUTPUT = Part(
    "vo",
    "value dims per head",
    "value dims",
    "s_vo",
    ("v",),
    "vo",
    "values",
    "value/output",
    lambda block: head_dims(block.attn)[1],
)
#: A budget unit of a head's query/key and value dims kept equal (``--equal-head-dims``).
TIED_QK_VO = Part(
    "qkvo",
    "query/key = value dims per head",
    "query/key = value dims",
    None,
    ("qk", "v"),
    "qkvo",
    "attention",
    "attention logits",
    lambda block: head_dims(block.attn)[0],
)

#: The parts a target can prune, in block order.
PARTS = {part.name: part for part in (MLP, QUERY_KEY, VALUE_OUTPUT)}
#: Every kind of budget unit: the parts, and query/key tied to value dims.
UNIT_PARTS = {**PARTS, TIED_QK_VO.name: TIED_QK_VO}

#: Which parts each target prunes (``attn``: the query/key dims; ToaSt prunes value dims with
#: them, as its ``s_attn`` says).
TARGET_PARTS = {
    "mlp": ("mlp",),
    "attn": ("qk",),
    "vo": ("vo",),
    "both": ("mlp", "qk"),
    "mlp-vo": ("mlp", "vo"),
    "all": ("mlp", "qk", "vo"),
}
TARGETS = tuple(TARGET_PARTS)
