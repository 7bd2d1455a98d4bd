"""Timm families whose blocks compute the standard pre-norm block in another layout, rewritten
into the layout the engine compresses (docs/method.md §9).

BEiT (timm ``Beit``, BEiT and BEiT-v2) computes ``x + gamma_1 * attn(norm1(x))`` and
``x + gamma_2 * mlp(norm2(x))``, where the attention keeps its query/value biases as separate
parameters (the key bias is a zero buffer) and adds a learned relative position bias, looked
up in a table, to every head's logits. :func:`standard_form` rewrites each block, without
changing what it computes, as a :class:`ScaledResidualBlock` whose attention is timm's
``RelPosAttention`` (one fused ``qkv`` bias ``[q_bias | 0 | v_bias]``, the table as its
``rel_pos`` module) and whose residual scales are timm ``LayerScale``s. From then on a BEiT
block is exactly a relative-position ViT block, which every method compresses.

Eva (timm ``Eva``: EVA-02, EVA-CLIP) differs from a ViT block in four ways, rewritten the same
way: ``gamma`` residual scales (LayerScale); split query/value biases or separate q/k/v
projections (one fused ``qkv``); a gated MLP ``fc2(silu(x W_gate) * (x W_up))`` (a timm ``Mlp``
whose ``fc1`` is a :class:`~corp_deploy.layers.GatedLinear` and whose ``act`` is the identity);
and a rotary position embedding of queries and keys, which the model computes once and passes
to every block: the rewritten attention (a :class:`~corp_deploy.layers.PrunedAttention` of full
width) keeps that tensor and rotates its own queries and keys, so a block computes its output
from its input alone, as calibration needs. Without a rotary embedding the attention becomes a
timm ``RelPosAttention`` without bias, as for BEiT.

CaiT (timm ``Cait``): its self-attention blocks scale their residuals by ``gamma`` (rewritten as
LayerScale; the talking-heads attention is kept as it is, so only the MLPs can be pruned); its
class-attention blocks (``blocks_token_only``) come after ``blocks`` and are left dense.
"""
from __future__ import annotations

import torch
from torch import nn
from timm.layers import GluMlp, LayerScale, Mlp, SwiGLU
from timm.models import beit, cait, eva
from timm.models.vision_transformer_relpos import RelPosAttention

from .layers import GatedLinear, PrunedAttention


class TableRelativePosition(nn.Module):
    """A relative position bias read from a learned table, BEiT's layout.

    ``relative_position_bias_table`` ``(distances, H)`` holds one bias per relative offset and
    head; ``relative_position_index`` ``(N, N)`` (a non-persistent buffer, rebuilt by timm when
    the model is created) says which offset each query/key token pair has. The interface is
    that of timm's relative position modules (``get_bias()``, ``forward(attn)``).
    """

    def __init__(self, table: torch.Tensor, index: torch.Tensor) -> None:
        super().__init__()
        self.relative_position_bias_table = nn.Parameter(table.detach().clone(), requires_grad=table.requires_grad)
        self.register_buffer("relative_position_index", index.detach().clone(), persistent=False)

    def get_bias(self) -> torch.Tensor:
        """The additive logit bias ``(1, H, N, N)``."""
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).unsqueeze(0)

    def forward(self, attn: torch.Tensor, shared_rel_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, H, N, N)`` plus the bias."""
        return attn + self.get_bias()


class ScaledResidualBlock(nn.Module):
    """The pre-norm block ``x + ls1(attn(norm1(x)))``, then ``x + ls2(mlp(norm2(x)))``, called as
    BEiT's, Eva's and CaiT's models call their blocks. BEiT passes ``shared_rel_pos_bias`` (models
    that have one are refused, so it is None here); Eva passes its rotary embedding ``rope``, which
    the attention already holds (the same tensor), so it is not used. Tokens ``(B, N, C)``."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, ls1: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 ls2: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1 = norm1, attn, ls1
        self.norm2, self.mlp, self.ls2 = norm2, mlp, ls2

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: torch.Tensor | None = None,
                rope: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        if shared_rel_pos_bias is not None or attn_mask is not None or is_causal:
            raise ValueError("a shared relative position bias or an attention mask is not supported by the "
                             "rewritten blocks")
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


def in_standard_form(model: nn.Module) -> bool:
    """Whether :func:`standard_form` would leave ``model`` unchanged."""
    return not any(type(block) in (beit.Block, eva.EvaBlock, cait.LayerScaleBlock)
                   or _is_gated(getattr(block, "mlp", None)) for block in getattr(model, "blocks", ()))


def standard_form(model: nn.Module) -> nn.Module:
    """``model`` with its BEiT, Eva and CaiT blocks rewritten as :class:`ScaledResidualBlock` and
    the gated MLPs of any family (also ViTs such as DINOv2 giant) as timm ``Mlp``s with a
    :class:`GatedLinear` fc1 (in place; the same model is returned; other models are unchanged). The rewritten
    model computes the same function; norms and MLPs are moved over, the attention's weights
    and the residual scales copied."""
    if isinstance(model, beit.Beit):
        for i, block in enumerate(model.blocks):
            if type(block) is beit.Block:
                model.blocks[i] = _standard_beit_block(block)
    elif isinstance(model, eva.Eva):
        rope = eva_rotary_embedding(model)
        for i, block in enumerate(model.blocks):
            if type(block) is eva.EvaBlock:
                model.blocks[i] = _standard_eva_block(block, rope)
    elif isinstance(model, cait.Cait):
        for i, block in enumerate(model.blocks):
            if type(block) is cait.LayerScaleBlock:
                model.blocks[i] = ScaledResidualBlock(block.norm1, block.attn, _layer_scale(block.gamma_1), block.norm2,
                                                      block.mlp, _layer_scale(block.gamma_2))
    for block in getattr(model, "blocks", ()):
        if _is_gated(getattr(block, "mlp", None)):
            block.mlp = _standard_mlp(block.mlp)
    return model


def eva_rotary_embedding(model: eva.Eva) -> torch.Tensor | None:
    """The rotary embedding ``(patches, 2 * head_dim)`` an Eva model passes to its blocks at its
    fixed image size (None without one), computed as ``Eva._pos_embed`` does."""
    if model.rope is None:
        return None
    if hasattr(model.rope, "feat_shape"):
        return model.rope.get_embed()
    return model.rope.get_embed(shape=model.patch_embed.grid_size)


def _standard_beit_block(block: beit.Block) -> ScaledResidualBlock:
    old = block.attn
    weight = old.qkv.weight
    dim, heads = weight.shape[1], old.num_heads
    bias = None if old.q_bias is None else torch.cat((old.q_bias, old.k_bias, old.v_bias))
    attn = _filled(RelPosAttention(dim, heads, qkv_bias=bias is not None, device=weight.device, dtype=weight.dtype),
                   weight, bias, old.proj)
    if old.relative_position_bias_table is not None:
        attn.rel_pos = TableRelativePosition(old.relative_position_bias_table, old.relative_position_index)
    return ScaledResidualBlock(block.norm1, attn, _layer_scale(block.gamma_1), block.norm2, block.mlp,
                               _layer_scale(block.gamma_2))


def _standard_eva_block(block: eva.EvaBlock, rope: torch.Tensor | None) -> ScaledResidualBlock:
    old = block.attn
    if old.qkv is not None:
        weight = old.qkv.weight
        bias = None if old.q_bias is None else torch.cat((old.q_bias, old.k_bias, old.v_bias))
    else:
        weight = torch.cat((old.q_proj.weight, old.k_proj.weight, old.v_proj.weight))
        bias = None if old.q_proj.bias is None else torch.cat(
            (old.q_proj.bias, torch.zeros_like(old.q_proj.bias), old.v_proj.bias))
    dim, heads, dd = weight.shape[1], old.num_heads, {"device": weight.device, "dtype": weight.dtype}
    if rope is None:
        attn = RelPosAttention(dim, heads, qkv_bias=bias is not None, **dd)
    else:
        attn = PrunedAttention(dim, heads, old.head_dim, old.head_dim, old.scale, qkv_bias=bias is not None,
                               proj_bias=old.proj.bias is not None, rope=rope,
                               num_prefix_tokens=old.num_prefix_tokens, rotate_half=old.rotate_half).to(**dd)
    attn = _filled(attn, weight, bias, old.proj)
    return ScaledResidualBlock(block.norm1, attn, _layer_scale(block.gamma_1), block.norm2, block.mlp,
                               _layer_scale(block.gamma_2))


def _filled(attn: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, proj: nn.Linear) -> nn.Module:
    """``attn`` with its fused ``qkv`` set to ``weight`` / ``bias`` and its ``proj`` copied from ``proj``."""
    with torch.no_grad():
        attn.qkv.weight.copy_(weight)
        if bias is not None:
            attn.qkv.bias.copy_(bias)
        attn.proj.load_state_dict(proj.state_dict())
    return attn


def _is_gated(mlp: nn.Module | None) -> bool:
    """Whether ``mlp`` is a gated MLP :func:`_standard_mlp` rewrites: timm ``SwiGLU``, or a ``GluMlp``
    (e.g. ``SwiGLUPacked``) whose packed fc1 is ``[gate | up]`` along the last dim."""
    return isinstance(mlp, SwiGLU) or (isinstance(mlp, GluMlp) and not mlp.gate_last and mlp.chunk_dim == -1)


def _standard_mlp(mlp: nn.Module) -> nn.Module:
    """A gated MLP (:func:`_is_gated`) as a timm ``Mlp`` whose ``fc1`` is a :class:`GatedLinear`
    (the same function)."""
    if isinstance(mlp, GluMlp):
        hidden = mlp.fc1.out_features // 2
        gate, up = (nn.Linear(mlp.fc1.in_features, hidden, bias=mlp.fc1.bias is not None,
                              device=mlp.fc1.weight.device, dtype=mlp.fc1.weight.dtype) for _ in range(2))
        with torch.no_grad():
            for part, rows in ((gate, slice(0, hidden)), (up, slice(hidden, None))):
                part.weight.copy_(mlp.fc1.weight[rows])
                if mlp.fc1.bias is not None:
                    part.bias.copy_(mlp.fc1.bias[rows])
        fc1 = GatedLinear(gate, up, mlp.act)
    else:
        fc1 = GatedLinear(mlp.fc1_g, mlp.fc1_x, mlp.act)
    standard = Mlp(fc1.in_features, 1, mlp.fc2.out_features)
    standard.fc1, standard.act, standard.norm, standard.fc2 = fc1, nn.Identity(), mlp.norm, mlp.fc2
    return standard


def _layer_scale(gamma: nn.Parameter | None) -> nn.Module:
    if gamma is None:
        return nn.Identity()
    scale = LayerScale(gamma.shape[0], device=gamma.device, dtype=gamma.dtype)
    with torch.no_grad():
        scale.gamma.copy_(gamma)
    return scale
