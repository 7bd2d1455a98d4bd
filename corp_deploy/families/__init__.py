"""The timm model families corp-deploy compresses, one module each, and what the rest of the
library asks of them.

Each module (:mod:`.vit`, :mod:`.hybrid`, :mod:`.relpos`, :mod:`.beit`, :mod:`.eva`, :mod:`.cait`,
:mod:`.swin`) fills in one :class:`~corp_deploy.families.record.Family`: which timm models it
matches, why a structure it cannot compress is refused, the exact rewrite of its blocks into the
standard pre-norm block the engine compresses (docs/method.md §9), the MAC formula of its
attentions, which parts can be pruned and why the others cannot, how its blocks group their tokens
for attention where they do not attend over one whole sequence, its rows of the table in docs/models.md, and
its small test models. Everything below is driven by :data:`FAMILIES`: adding a family is one
module and one entry there.
"""

from __future__ import annotations

import copy

from timm.layers import Mlp
from torch import nn

from ..errors import CorpError
from ..layers import GatedLinear, PrunedAttention
from . import beit, cait, eva, hybrid, relpos, swin, vit
from .record import WHOLE_SEQUENCE, AttentionMacs, Example, Family, TokenGroups, describe, full_attention_macs
from .shared import ScaledResidualBlock, TableRelativePosition, is_gated, standard_mlp
from .swin import ShiftedWindows, WindowedBlock
from .vit import is_plain_attention

__all__ = [
    "FAMILIES",
    "Example",
    "Family",
    "ScaledResidualBlock",
    "ShiftedWindows",
    "TableRelativePosition",
    "TokenGroups",
    "WindowedBlock",
    "attention_macs",
    "blocks_of",
    "check_prunable",
    "examples",
    "family_of",
    "in_standard_form",
    "is_plain_attention",
    "is_prunable_attention",
    "standard_copy",
    "standard_form",
    "structure_problem",
    "supported_summary",
    "supported_table",
    "token_groups",
]

#: Every family, in the order they are tried (the first that matches a model is its family).
FAMILIES: tuple[Family, ...] = (
    vit.FAMILY,
    hybrid.FAMILY,
    relpos.FAMILY,
    beit.FAMILY,
    eva.FAMILY,
    cait.FAMILY,
    swin.FAMILY,
    swin.V2,
)


def family_of(model: nn.Module) -> Family | None:
    """The family of a timm model (dense or in standard form); None when no family matches."""
    return next((family for family in FAMILIES if family.matches(model)), None)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` in forward order (in standard form, a Swin's blocks
    carry the patch merging between stages)."""
    family = family_of(model)
    return family.blocks(model) if family is not None else list(getattr(model, "blocks", ()))


def standard_form(model: nn.Module) -> nn.Module:
    """``model`` with its blocks rewritten by its family into the standard pre-norm block (see each
    family's module) and the gated MLPs of any family (also ViTs such as DINOv2 giant) as timm
    ``Mlp``s with a :class:`GatedLinear` fc1; in place, the same model is returned. The rewritten
    model computes the same function; norms and MLPs are moved over, attention weights and
    residual scales copied."""
    family = family_of(model)
    if family is not None:
        family.standard_form(model)
    for block in blocks_of(model):
        if is_gated(getattr(block, "mlp", None)):
            block.mlp = standard_mlp(block.mlp)
    return model


def standard_copy(model: nn.Module) -> nn.Module:
    """``model`` itself when it is in standard form, else a copy of it rewritten into it
    (:func:`standard_form`); ``model`` is left as it is."""
    return model if in_standard_form(model) else standard_form(copy.deepcopy(model))


def in_standard_form(model: nn.Module) -> bool:
    """Whether :func:`standard_form` would leave ``model`` unchanged."""
    family = family_of(model)
    if family is not None and not family.in_standard_form(model):
        return False
    return not any(is_gated(getattr(block, "mlp", None)) for block in blocks_of(model))


def structure_problem(model: nn.Module) -> str | None:
    """Why corp-deploy cannot compress ``model`` (a phrase naming the first class or structure its
    family does not support, or what timm built when no family matches); None when it can."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is not None and min(grid) < 1:
        return (
            f"its patch grid is {tuple(grid)}: the patches are larger than the image "
            "(check the img_size and patch_size --model-arg values)"
        )
    family = family_of(model)
    if family is None:
        return describe(model)
    if family.supported and not family.blocks(model):
        return "it has no transformer blocks (depth 0)"
    return family.problem(model)


def check_prunable(model: nn.Module, parts: tuple[str, ...]) -> None:
    """CorpError if a part asked to be pruned (``mlp``: MLP hidden channels, ``qk``: query/key
    dims, ``vo``: value/output dims) of a block of ``model`` (in standard form) does not have the
    structure CORP assumes, saying why and which ``--target`` works."""
    family = family_of(model)
    for i, block in enumerate(blocks_of(model)):
        if "mlp" in parts:
            m = block.mlp
            if type(m) is not Mlp or not isinstance(m.fc1, (nn.Linear, GatedLinear)):
                raise CorpError(
                    f"block {i}: MLP of type {type(m).__name__} is not supported for MLP pruning "
                    "(needs timm Mlp: fc1 -> elementwise act -> fc2, or a gated MLP); use --target attn"
                )
            if not isinstance(m.norm, nn.Identity):
                raise CorpError(
                    f"block {i}: the MLP normalises its hidden channels before fc2 (sub-LN, timm "
                    "scale_mlp), so removing channels changes the kept ones and the compensation of "
                    "docs/method.md §2 does not hold; use --target vo (or attn where the model allows)"
                )
        problem = family.part_problem(block, parts) if family is not None else None
        if problem is not None:
            raise CorpError(f"block {i}: {problem}")
        attn = block.attn
        if ("qk" in parts or "vo" in parts) and not is_prunable_attention(attn):
            raise CorpError(
                f"block {i}: attention of type {type(attn).__name__} (or with qk-norm, "
                "scale-norm or gating) is not supported for query/key or value pruning; "
                "use --target mlp"
            )
        if (
            "qk" in parts
            and isinstance(attn, PrunedAttention)
            and (attn.qk_head_dim != attn.v_head_dim or attn.scale != attn.qk_head_dim**-0.5)
        ):
            raise CorpError(
                f"block {i}: the attention's query/key dims are already pruned; compress the dense model instead"
            )


def is_prunable_attention(attn: nn.Module) -> bool:
    """Whether CORP can prune ``attn``'s query/key and value dims: a :class:`PrunedAttention` (the
    rewritten attention of Eva models with a rotary embedding and of Swin, or an attention
    compressed before; whether its query/key dims can be pruned: :func:`check_prunable`), or an
    attention some family declares prunable (timm's plain ``Attention``, ``RelPosAttention``
    without qk-norm)."""
    return isinstance(attn, PrunedAttention) or any(family.prunable_attention(attn) for family in FAMILIES)


def token_groups(block: nn.Module) -> TokenGroups:
    """How ``block`` (in standard form) groups its tokens for attention and hands them on: what the
    family whose blocks it is says (:attr:`Family.token_groups`), else one whole sequence per image
    (:data:`~corp_deploy.families.record.WHOLE_SEQUENCE`)."""
    for family in FAMILIES:
        groups = family.token_groups(block)
        if groups is not None:
            return groups
    return WHOLE_SEQUENCE


def attention_macs(module: nn.Module) -> AttentionMacs | None:
    """The formula for the MACs of ``module``'s two attention matmuls, when it is an attention of
    some family (or a :class:`PrunedAttention`); else None."""
    if isinstance(module, PrunedAttention):
        return full_attention_macs
    for family in FAMILIES:
        for kind, formula in family.attention_macs.items():
            if isinstance(module, kind):
                return formula
    return None


def examples() -> dict[str, Example]:
    """Every family's small test models by test id."""
    return {key: example for family in FAMILIES for key, example in family.examples.items()}


def supported_summary() -> str:
    """The supported families in one sentence, for messages."""
    return "; ".join(family.summary for family in FAMILIES if family.supported)


def supported_table() -> str:
    """The table of supported models in docs/models.md (Markdown), one row per family row and a last row of
    what is refused."""
    lines = ["| family (timm class) | example models | pruned | compensated |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for family in FAMILIES for row in family.rows]
    refused = ", ".join(text for family in FAMILIES for text in family.refused)
    lines.append(f"| {refused} | | refused, with the class or structure that is not supported and why | |")
    return "\n".join(lines)
