"""timm ``VisionTransformerRelPos`` of pre-norm ``RelPosBlock``s whose relative position bias
belongs to each block (``vit_relpos_*``): the bias is additive in the logits and does not change
the query/key system (docs/method.md §9), so the blocks are compressed as they are and the bias
module is kept."""

from __future__ import annotations

from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, VisionTransformerRelPos
from torch import nn

from .record import Example, Family, SupportRow, class_path, full_attention_macs


def is_prunable_relpos_attention(attn: nn.Module) -> bool:
    """Whether ``attn`` is timm's ``RelPosAttention`` without qk-norm (the form BEiT's and Eva's
    attentions without a rotary embedding are rewritten into, too)."""
    return (
        type(attn) is RelPosAttention and isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)
    )


def _problem(model: VisionTransformerRelPos) -> str | None:
    if model.shared_rel_pos is not None:
        return (
            "it shares one relative position bias across blocks (VisionTransformerRelPos with "
            "use_shared_rel_pos=True), which is passed to every block and is not supported"
        )
    for i, block in enumerate(model.blocks):
        if type(block) is not RelPosBlock:
            return f"block {i} is a {class_path(block)}, not timm's pre-norm RelPosBlock"
    return None


FAMILY = Family(
    name="relpos",
    summary="VisionTransformerRelPos with per-block relative position bias (vit_relpos_*)",
    matches=lambda model: isinstance(model, VisionTransformerRelPos),
    problem=_problem,
    rows=(
        SupportRow(
            "`VisionTransformerRelPos` with a relative position bias per block (`RelPosBlock`)",
            "`vit_relpos_small_patch16_224`, `vit_relpos_base_patch16_clsgap_224`",
            "all three; the bias module is kept",
            "all three: the bias is additive and does not change the query/key system (docs/method.md §9)",
        ),
    ),
    refused=("relative-position ViTs with a shared bias (`vit_srelpos_*`) or post-norm blocks (`*_rpn_*`)",),
    examples={
        "relpos": Example("vit_relpos_small_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32)
    },
    attention_macs={RelPosAttention: full_attention_macs},
    prunable_attention=is_prunable_relpos_attention,
)
