"""timm ``Cait``: self-attention blocks that scale their residuals by ``gamma`` (rewritten with
timm ``LayerScale``s as :class:`~corp_deploy.families.shared.ScaledResidualBlock`s) around a
talking-heads attention, which mixes the heads' logits before and after the softmax and is kept
dense, so only the MLPs are pruned; the class-attention blocks (``blocks_token_only``) come after
``blocks`` and are left dense."""

from __future__ import annotations

from timm.models import cait
from torch import nn

from ..layers import head_dims
from .record import Example, Family, SupportRow, class_path, full_attention_macs
from .shared import ScaledResidualBlock, layer_scale


def class_attention_macs(attn: nn.Module, shape: tuple[int, ...]) -> int:
    """Class attention: only the class token queries the ``N`` tokens, ``B * H * N * (qk_dim + v_dim)``."""
    batch, tokens = shape[0], shape[1]
    return batch * attn.num_heads * tokens * sum(head_dims(attn))


def _problem(model: cait.Cait) -> str | None:
    for i, block in enumerate(model.blocks):
        if type(block) not in (cait.LayerScaleBlock, ScaledResidualBlock):
            return f"block {i} is a {class_path(block)}, not timm's CaiT LayerScaleBlock"
    return None


def _standard_form(model: cait.Cait) -> None:
    for i, block in enumerate(model.blocks):
        if type(block) is cait.LayerScaleBlock:
            model.blocks[i] = ScaledResidualBlock(
                block.norm1, block.attn, layer_scale(block.gamma_1), block.norm2, block.mlp, layer_scale(block.gamma_2)
            )


def _part_problem(block: nn.Module, parts: tuple[str, ...]) -> str | None:
    if ("qk" in parts or "vo" in parts) and type(block.attn) is cait.TalkingHeadAttn:
        return (
            "talking-heads attention mixes the heads' logits before and after the softmax, so the per-head "
            "query/key and value compensation (docs/method.md §3-4) does not apply; use --target mlp"
        )
    return None


FAMILY = Family(
    name="cait",
    summary="Cait (cait_*: MLPs of the self-attention blocks only)",
    matches=lambda model: isinstance(model, cait.Cait),
    problem=_problem,
    rows=(
        SupportRow(
            "`Cait` (talking-heads attention, class-attention blocks)",
            "`cait_xxs24_224`, `cait_s24_224`",
            "MLP hidden channels of the self-attention blocks: `--target mlp`; the talking-heads attention "
            "(refused with the reason) and the class-attention blocks stay dense",
            "MLP",
        ),
    ),
    # talking-heads attention (kept dense) and class-attention blocks (left dense): MLPs only; ToaSt's
    # token weighting needs a plain attention
    examples={
        "cait": Example(
            "cait_xxs24_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32, "mlp", ("corp", "vbp")
        )
    },
    standard_form=_standard_form,
    in_standard_form=lambda model: not any(type(block) is cait.LayerScaleBlock for block in model.blocks),
    attention_macs={cait.TalkingHeadAttn: full_attention_macs, cait.ClassAttn: class_attention_macs},
    part_problem=_part_problem,
)
