"""timm ``Eva`` of pre-norm ``EvaBlock``s (EVA-02, EVA-CLIP, DINOv3, timm's rope ViTs).

An Eva block differs from a ViT block in four ways, each rewritten into the standard form
without changing what it computes: ``gamma`` residual scales (timm ``LayerScale``); split
query/value biases or separate q/k/v projections (one fused ``qkv``); a gated MLP
``fc2(silu(x W_gate) * (x W_up))`` (a timm ``Mlp`` whose ``fc1`` is a
:class:`~corp_deploy.layers.GatedLinear`, as in every family); and a rotary position embedding of
queries and keys, which the model computes once and passes to every block: the rewritten attention
(a :class:`~corp_deploy.layers.PrunedAttention` of full width) keeps that tensor and rotates its
own queries and keys, so a block computes its output from its input alone, as calibration needs.
Without a rotary embedding the attention becomes a timm ``RelPosAttention`` without bias, as for
BEiT. Query/key dims cannot be pruned under a rotary embedding (docs/method.md §9).
"""

from __future__ import annotations

import torch
from timm.models import eva
from timm.models.vision_transformer_relpos import RelPosAttention
from torch import nn

from ..layers import PrunedAttention, head_dims
from .record import Example, Family, SupportRow, class_path, full_attention_macs
from .relpos import is_prunable_relpos_attention
from .shared import ScaledResidualBlock, filled, layer_scale


def rotary_embedding(model: eva.Eva) -> torch.Tensor | None:
    """The rotary embedding ``(patches, 2 * head_dim)`` an Eva model passes to its blocks at its
    fixed image size (None without one), computed as ``Eva._pos_embed`` does."""
    if model.rope is None:
        return None
    if hasattr(model.rope, "feat_shape"):
        return model.rope.get_embed()
    return model.rope.get_embed(shape=model.patch_embed.grid_size)


def _problem(model: eva.Eva) -> str | None:
    if model.dynamic_img_size:
        return (
            "it is built with dynamic_img_size=True, whose rotary embedding changes with the image size; "
            "fix the size with --model-arg dynamic_img_size=false"
        )
    if model.rope is not None:
        rope = rotary_embedding(model)
        if (
            getattr(model, "rope_mixed", False)
            or rope.dim() != 2
            or rope.shape[-1] != 2 * head_dims(model.blocks[0].attn)[0]
        ):
            return (
                f"its rotary embedding ({class_path(model.rope)}) is not one (patches, 2 x head dim) table "
                "shared by every block"
            )
    for i, block in enumerate(model.blocks):
        if type(block) is ScaledResidualBlock:
            continue
        if type(block) is not eva.EvaBlock:
            return f"block {i} is a {class_path(block)}, not timm's pre-norm EvaBlock"
        attn = block.attn
        if type(attn) is not eva.EvaAttention:
            return f"block {i}'s attention is a {class_path(attn)}, not timm's EvaAttention"
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.norm, nn.Identity) and attn.gate is None):
            return (
                f"block {i}'s attention has qk-norm, an inner norm (scale_attn_inner) or a gate, which the "
                "rewritten attention does not compute"
            )
        if attn.head_dim * attn.num_heads != attn.proj.out_features:
            return f"block {i}'s attention heads are {attn.head_dim} wide, not width / heads (attn_head_dim)"
    return None


def _standard_form(model: eva.Eva) -> None:
    rope = rotary_embedding(model)
    for i, block in enumerate(model.blocks):
        if type(block) is eva.EvaBlock:
            model.blocks[i] = _standard_block(block, rope)


def _standard_block(block: eva.EvaBlock, rope: torch.Tensor | None) -> ScaledResidualBlock:
    old = block.attn
    if old.qkv is not None:
        weight = old.qkv.weight
        bias = None if old.q_bias is None else torch.cat((old.q_bias, old.k_bias, old.v_bias))
    else:
        projections = (old.q_proj, old.k_proj, old.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = (
            None
            if all(p.bias is None for p in projections)
            else torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in projections])
        )
    dim, heads, dd = weight.shape[1], old.num_heads, {"device": weight.device, "dtype": weight.dtype}
    if rope is None:
        attn = RelPosAttention(dim, heads, qkv_bias=bias is not None, **dd)
    else:
        attn = PrunedAttention(
            dim,
            heads,
            old.head_dim,
            old.head_dim,
            old.scale,
            qkv_bias=bias is not None,
            proj_bias=old.proj.bias is not None,
            rope=rope,
            num_prefix_tokens=old.num_prefix_tokens,
            rotate_half=old.rotate_half,
        ).to(**dd)
    attn = filled(attn, weight, bias, old.proj)
    return ScaledResidualBlock(
        block.norm1, attn, layer_scale(block.gamma_1), block.norm2, block.mlp, layer_scale(block.gamma_2)
    )


def _part_problem(block: nn.Module, parts: tuple[str, ...]) -> str | None:
    if "qk" in parts and isinstance(block.attn, PrunedAttention) and block.attn.rope is not None:
        return (
            "the attention rotates queries and keys by a rotary position embedding; the query/key "
            "compensation of docs/method.md §3 mixes dims across rotation pairs, which does not commute with "
            "the rotation (docs/method.md §9). Prune the MLP and value/output dims instead: --target mlp-vo "
            "(or mlp, vo)"
        )
    return None


_SMALL = dict(depth=2, embed_dim=192, num_heads=3, num_classes=10)

FAMILY = Family(
    name="eva",
    summary=(
        "Eva of pre-norm EvaBlocks with EvaAttention without qk-norm or inner norm (eva02_* image models, "
        "eva_giant_*, *_dinov3 with dynamic_img_size=False, vit_*_rope_reg*; MLP and value/output dims where "
        "there is a rotary embedding)"
    ),
    matches=lambda model: isinstance(model, eva.Eva),
    problem=_problem,
    rows=(
        SupportRow(
            "`Eva` without rotary embedding (EVA-CLIP vision towers)",
            "`eva_giant_patch14_224`",
            "all three",
            "all three",
        ),
        SupportRow(
            "`Eva` with rotary embedding (EVA-02 with its gated MLP, DINOv3, timm's rope ViTs)",
            "`eva02_tiny_patch14_224`, `eva02_small_patch14_224`, `vit_small_patch16_dinov3` (with "
            "`--model-arg dynamic_img_size=false`), `vit_medium_patch16_rope_reg1_gap_256`",
            "MLP hidden channels (gate and up rows together) and value/output dims: `--target mlp-vo`; "
            "query/key dims stay dense (refused with the reason)",
            "both (§2 ridge at the down projection; §4)",
        ),
        SupportRow(
            "`Eva` whose gated MLP normalises its hidden channels (EVA-02 B/L: `scale_mlp`)",
            "`eva02_base_patch14_224`, `eva02_large_patch14_224`",
            "value/output dims only: `--target vo` (MLP and query/key refused with the reason)",
            "value/output",
        ),
    ),
    refused=(
        "Eva with post-norm blocks (`EvaBlockPostNorm`), qk-norm, inner attention norm, gated attention, "
        "`AttentionRope` (`vit_*_rope_*` of naver, PE) or a per-block (mixed) rotary embedding",
    ),
    examples={
        # rotary embedding + gated MLP (packed GluMlp): query/key dims stay dense
        "eva02": Example(
            "eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, depth=2, num_classes=10), 28, "mlp-vo"
        ),
        # DINOv3: rotary embedding with half-split pairs, four register tokens, plain MLP
        "dinov3": Example(
            "vit_small_patch16_dinov3", dict(img_size=32, patch_size=8, dynamic_img_size=False, **_SMALL), 32, "mlp-vo"
        ),
        # + separate q/k/v projections and a normalised gated MLP (SwiGLU with sub-LN): values only
        "eva02-sub-ln": Example(
            "eva02_base_patch14_224", dict(img_size=28, patch_size=7, **_SMALL), 28, "vo", ("corp",)
        ),
        # EVA-CLIP's vision tower: no rotary embedding, plain MLP, split q/v biases
        "eva-clip": Example("eva_giant_patch14_224", dict(img_size=28, patch_size=7, mlp_ratio=4.0, **_SMALL), 28),
    },
    standard_form=_standard_form,
    in_standard_form=lambda model: not any(type(block) is eva.EvaBlock for block in model.blocks),
    attention_macs={RelPosAttention: full_attention_macs},
    prunable_attention=is_prunable_relpos_attention,
    part_problem=_part_problem,
)
