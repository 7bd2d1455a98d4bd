"""timm ``VisionTransformer`` of standard pre-norm ``Block``s on a ``PatchEmbed``: DeiT, DeiT-III,
most ViTs, DINOv2 (with registers, and giant's packed gated MLP), distilled DeiT. Already the
block the engine compresses; nothing to rewrite (a gated MLP becomes a timm ``Mlp`` with a
:class:`~corp_deploy.layers.GatedLinear` ``fc1``, as in every family)."""

from __future__ import annotations

from timm.layers import HybridEmbed, PatchEmbed
from timm.layers.attention import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from .record import Example, Family, SupportRow, class_path, full_attention_macs


def is_plain_attention(attn: nn.Module) -> bool:
    """Whether ``attn`` is timm's standard ``Attention`` without qk-norm, scale-norm or gating:
    ``softmax(scale * q k^T) v`` on one fused ``qkv`` projection, then ``proj``."""
    return (
        type(attn) is Attention
        and isinstance(attn.q_norm, nn.Identity)
        and isinstance(attn.k_norm, nn.Identity)
        and isinstance(attn.norm, nn.Identity)
        and getattr(attn, "gate", None) is None
    )


def blocks_problem(model: VisionTransformer) -> str | None:
    """Why ``model``'s blocks are not timm's standard pre-norm ``Block`` (the first that is not)."""
    for i, block in enumerate(model.blocks):
        if type(block) is not Block:
            return f"block {i} is a {type(block).__name__}, not timm's standard pre-norm Block"
    return None


def _problem(model: VisionTransformer) -> str | None:
    if not isinstance(model.patch_embed, PatchEmbed):  # (a HybridEmbed is the hybrid family's)
        return (
            f"its patch embedding is a {class_path(model.patch_embed)}, neither timm's PatchEmbed nor its HybridEmbed"
        )
    return blocks_problem(model)


FAMILY = Family(
    name="vit",
    summary=(
        "timm VisionTransformer models built from its standard Block (Attention + Mlp) on a PatchEmbed: "
        "deit_*, deit3_*, most vit_*, *_dinov2 (incl. distilled DeiT)"
    ),
    matches=lambda model: isinstance(model, VisionTransformer) and not isinstance(model.patch_embed, HybridEmbed),
    problem=_problem,
    rows=(
        SupportRow(
            "`VisionTransformer` with standard `Block` (`Attention` + `Mlp`)",
            "`deit_*`, `deit3_*`, `vit_*_patch*`, `*_dinov2` (registers too), distilled DeiT, CLIP/SigLIP "
            "ViTs, gap-pooled ViTs, FlexiViT",
            "MLP hidden channels, query/key dims, value/output dims",
            "all three (docs/method.md §2-4)",
        ),
        SupportRow(
            "attention with qk-norm, scale-norm or gating",
            "`vit_*` built with `qk_norm=True`",
            "MLP only (`--target mlp`)",
            "MLP",
        ),
    ),
    examples={
        "vit": Example("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32),
        # DINOv2 giant's layout: a ViT with a packed gated MLP (SwiGLUPacked)
        "vit-swiglu": Example(
            "vit_giant_patch14_dinov2",
            dict(img_size=28, patch_size=7, depth=2, embed_dim=192, num_heads=3, num_classes=10),
            28,
        ),
    },
    attention_macs={Attention: full_attention_macs},
    prunable_attention=is_plain_attention,
)
