"""timm ``VisionTransformer`` on a CNN stem (``HybridEmbed``: the stem's feature map becomes the
tokens), ``vit_*_r_*``: the transformer blocks are those of :mod:`.vit` and are compressed as
such; the stem stays dense."""

from __future__ import annotations

from timm.layers import HybridEmbed
from timm.layers.attention import Attention
from timm.models.vision_transformer import VisionTransformer

from .record import Example, Family, SupportRow, full_attention_macs
from .vit import blocks_problem, is_plain_attention

FAMILY = Family(
    name="hybrid",
    summary="the same blocks on a CNN stem (HybridEmbed): vit_*_r_* hybrids",
    matches=lambda model: isinstance(model, VisionTransformer) and isinstance(model.patch_embed, HybridEmbed),
    problem=blocks_problem,
    rows=(
        SupportRow(
            "the same blocks on a CNN stem (`HybridEmbed`)",
            "`vit_tiny_r_s16_p8_224`, `vit_small_r26_s32_224`, `vit_base_r50_s16_224`",
            "the transformer blocks' MLP hidden channels, query/key and value/output dims; the CNN stem stays dense",
            "all three",
        ),
    ),
    examples={"hybrid-cnn-stem": Example("vit_tiny_r_s16_p8_224", dict(img_size=64, depth=2, num_classes=10), 64)},
    attention_macs={Attention: full_attention_macs},
    prunable_attention=is_plain_attention,
)
