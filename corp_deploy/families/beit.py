"""timm ``Beit`` (BEiT, BEiT-v2) whose relative position bias belongs to each block.

A BEiT block computes ``x + gamma_1 * attn(norm1(x))`` and ``x + gamma_2 * mlp(norm2(x))``, where
the attention keeps its query/value biases as separate parameters (the key bias is a zero buffer)
and adds a learned relative position bias, looked up in a table, to every head's logits. Its
standard form, computing the same function, is a
:class:`~corp_deploy.families.shared.ScaledResidualBlock` whose attention is timm's
``RelPosAttention`` (one fused ``qkv`` bias ``[q_bias | k_bias | v_bias]``, the table as its
``rel_pos`` module) and whose residual scales are timm ``LayerScale``s: from then on a BEiT block
is exactly a relative-position ViT block, which every method compresses.
"""

from __future__ import annotations

import torch
from timm.models import beit
from timm.models.vision_transformer_relpos import RelPosAttention

from .record import Example, Family, SupportRow, class_path, full_attention_macs
from .relpos import is_prunable_relpos_attention
from .shared import ScaledResidualBlock, TableRelativePosition, filled, layer_scale


def _problem(model: beit.Beit) -> str | None:
    if model.rel_pos_bias is not None:
        return (
            "it shares one relative position bias across blocks (Beit with use_shared_rel_pos_bias=True), "
            "which is passed to every block and is not supported"
        )
    for i, block in enumerate(model.blocks):
        if type(block) is ScaledResidualBlock:
            continue
        if type(block) is not beit.Block:
            return f"block {i} is a {class_path(block)}, not timm's BEiT Block"
        if block.attn.qkv.out_features != 3 * block.attn.qkv.in_features:
            return (
                f"block {i}'s attention heads are {block.attn.qkv.out_features // 3 // block.attn.num_heads} "
                "wide, not width / heads (attn_head_dim), which is not supported"
            )
    return None


def _standard_form(model: beit.Beit) -> None:
    for i, block in enumerate(model.blocks):
        if type(block) is beit.Block:
            model.blocks[i] = _standard_block(block)


def _standard_block(block: beit.Block) -> ScaledResidualBlock:
    old = block.attn
    weight = old.qkv.weight
    dim, heads = weight.shape[1], old.num_heads
    bias = None if old.q_bias is None else torch.cat((old.q_bias, old.k_bias, old.v_bias))
    attn = filled(
        RelPosAttention(dim, heads, qkv_bias=bias is not None, device=weight.device, dtype=weight.dtype),
        weight,
        bias,
        old.proj,
    )
    if old.relative_position_bias_table is not None:
        attn.rel_pos = TableRelativePosition(old.relative_position_bias_table, old.relative_position_index)
    return ScaledResidualBlock(
        block.norm1, attn, layer_scale(block.gamma_1), block.norm2, block.mlp, layer_scale(block.gamma_2)
    )


FAMILY = Family(
    name="beit",
    summary="Beit with per-block relative position bias (beit_*, beitv2_*)",
    matches=lambda model: isinstance(model, beit.Beit),
    problem=_problem,
    rows=(
        SupportRow(
            "`Beit` with a relative position bias per block",
            "`beit_base_patch16_224`, `beitv2_base_patch16_224`, `beit_large_*`",
            "all three; the bias table is kept",
            "all three (rewritten exactly as relative-position blocks: gamma as LayerScale, q/v biases "
            "fused; docs/method.md §9)",
        ),
    ),
    refused=("BEiT with a shared bias (`use_shared_rel_pos_bias`)",),
    examples={
        "beit": Example(
            "beit_base_patch16_224",
            dict(img_size=32, patch_size=8, depth=2, embed_dim=192, num_heads=3, num_classes=10),
            32,
        )
    },
    standard_form=_standard_form,
    in_standard_form=lambda model: not any(type(block) is beit.Block for block in model.blocks),
    attention_macs={RelPosAttention: full_attention_macs},
    prunable_attention=is_prunable_relpos_attention,
)
