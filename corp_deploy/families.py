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

Swin (timm ``SwinTransformer``): stages of blocks on an ``(B, H, W, C)`` feature map, each block
attending within (shifted) windows with a relative position bias, and patch merging at the
start of every later stage. Each block is rewritten as a :class:`WindowedBlock`: its attention
a full-width :class:`~corp_deploy.layers.PrunedAttention` holding the bias table, the shift,
window partition and shift mask in a :class:`ShiftedWindows`, and the next stage's patch merging
moved to the end of the block (``transition``) so that the blocks, walked in order, are the
whole model between the patch embedding and the final norm (:func:`blocks_of`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import GluMlp, LayerScale, Mlp, SwiGLU
from timm.models import beit, cait, eva, swin_transformer as swin
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


class ShiftedWindows(nn.Module):
    """Swin's (shifted) windows on a ``(B, H, W, C)`` feature map of fixed ``resolution``
    ``(H, W)``: the map is rolled by ``-shift``, padded to whole windows of ``window`` ``(wh, ww)``
    and cut into ``nW`` windows of ``N = wh * ww`` tokens, image-major as timm's
    ``window_partition``. With a shift, ``mask`` ``(nW, N, N)`` (timm's, 0 or -100; a
    non-persistent buffer) keeps tokens from different regions of the unrolled map apart.

    The tokens that attend to each other form groups: a whole window without a shift, else the
    tokens of one region in one window (the rows of ``mask`` that are 0 for the same tokens).
    :meth:`group_heads` splits per-head tensors into these groups (zeroing the other tokens), so
    that statistics summed per group are those of the logits the softmax actually mixes
    (docs/method.md §9)."""

    def __init__(self, resolution: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
                 mask: torch.Tensor | None) -> None:
        super().__init__()
        self.resolution, self.window, self.shift = tuple(resolution), tuple(window), tuple(shift)
        self.register_buffer("mask", mask, persistent=False)
        groups = windows = None
        if mask is not None:
            n = mask.shape[-1]
            first = (mask == 0).float().argmax(-1)  # (nW, N): the first token each token attends to
            members = first[:, None, :] == torch.arange(n, device=mask.device)[None, :, None]  # (nW, group, N)
            used = members.any(-1)
            groups, windows = members[used].to(mask.dtype), used.nonzero()[:, 0]
        self.register_buffer("group_members", groups, persistent=False)  # (G, N): 1 for the group's tokens
        self.register_buffer("group_window", windows, persistent=False)  # (G,): the window of each group

    @property
    def area(self) -> int:
        """Tokens per window, ``N``."""
        return self.window[0] * self.window[1]

    @property
    def tokens(self) -> int:
        """Tokens of one image, ``H * W``."""
        return self.resolution[0] * self.resolution[1]

    @property
    def padded_tokens(self) -> int:
        """Tokens of one image after padding to whole windows (what attention and its projections see)."""
        (h, w), (wh, ww) = self.resolution, self.window
        return math.ceil(h / wh) * wh * math.ceil(w / ww) * ww

    def attend(self, attention: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: torch.Tensor
               ) -> torch.Tensor:
        """``attention(windows, mask)`` of the windows of ``x`` ``(B, H, W, C)``, put back in place:
        ``windows`` ``(B * nW, N, C)``, ``mask`` ``(B * nW, 1, N, N)`` (None without a shift), and
        ``attention`` returns ``(B * nW, N, C')``."""
        B, H, W, _ = x.shape
        (wh, ww), (sh, sw) = self.window, self.shift
        if sh or sw:
            x = torch.roll(x, shifts=(-sh, -sw), dims=(1, 2))
        x = F.pad(x, (0, 0, 0, (ww - W % ww) % ww, 0, (wh - H % wh) % wh))
        Hp, Wp = x.shape[1:3]
        mask = None
        if self.mask is not None:
            mask = self.mask.unsqueeze(0).expand(B, -1, -1, -1).reshape(-1, 1, self.area, self.area)
        y = attention(swin.window_partition(x, self.window).view(-1, self.area, x.shape[-1]), mask)
        y = swin.window_reverse(y.view(-1, wh, ww, y.shape[-1]), self.window, Hp, Wp)[:, :H, :W, :].contiguous()
        return torch.roll(y, shifts=(sh, sw), dims=(1, 2)) if sh or sw else y

    def group_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Per-window, per-head ``t`` ``(B * nW, H, N, d)`` -> per group ``(B * G, H, N, d)``
        (tokens outside the group zeroed); unchanged without a shift."""
        if self.mask is None:
            return t
        t = t.unflatten(0, (-1, self.mask.shape[0]))[:, self.group_window]
        return (t * self.group_members[:, None, :, None].to(t.dtype)).flatten(0, 1)

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, window={self.window}, shift={self.shift}"


class WindowedBlock(ScaledResidualBlock):
    """A Swin block: ``x + attn(norm1(x))`` with attention within the (shifted) ``windows``, then
    ``x + mlp(norm2(x))``, then ``transition`` (the next stage's patch merging, or the identity).
    ``attn``: a :class:`~corp_deploy.layers.PrunedAttention` with the window's relative position
    bias as ``rel_pos``; ``ls1``/``ls2`` are identities. Tokens ``(B, H, W, C)``."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 windows: ShiftedWindows, transition: nn.Module) -> None:
        super().__init__(norm1, attn, nn.Identity(), norm2, mlp, nn.Identity())
        self.windows, self.transition = windows, transition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.windows.attend(lambda t, mask: self.attn(t, attn_mask=mask), self.norm1(x)))
        return self.transition(x + self.ls2(self.mlp(self.norm2(x))))


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` in forward order: ``model.blocks``, or every stage's
    blocks of a Swin (in standard form, the blocks carry the patch merging between stages)."""
    if isinstance(model, swin.SwinTransformer):
        return [block for stage in model.layers for block in stage.blocks]
    return list(getattr(model, "blocks", ()))


def in_standard_form(model: nn.Module) -> bool:
    """Whether :func:`standard_form` would leave ``model`` unchanged."""
    if isinstance(model, swin.SwinTransformer) and any(
            not isinstance(stage.downsample, nn.Identity) for stage in list(model.layers)[1:]):
        return False
    return not any(type(block) in (beit.Block, eva.EvaBlock, cait.LayerScaleBlock, swin.SwinTransformerBlock)
                   or _is_gated(getattr(block, "mlp", None)) for block in blocks_of(model))


def standard_form(model: nn.Module) -> nn.Module:
    """``model`` with its BEiT, Eva and CaiT blocks rewritten as :class:`ScaledResidualBlock`, its Swin
    blocks as :class:`WindowedBlock` (patch merging moved into the block before it), and
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
    elif isinstance(model, swin.SwinTransformer):
        _standard_swin(model)
    for block in blocks_of(model):
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


def _standard_swin(model: swin.SwinTransformer) -> None:
    stages = list(model.layers)
    for stage in stages:
        for i, block in enumerate(stage.blocks):
            if type(block) is swin.SwinTransformerBlock:
                stage.blocks[i] = _standard_swin_block(block)
    for before, stage in zip(stages, stages[1:]):
        if not isinstance(stage.downsample, nn.Identity):
            before.blocks[-1].transition, stage.downsample = stage.downsample, nn.Identity()


def _standard_swin_block(block: swin.SwinTransformerBlock) -> WindowedBlock:
    old = block.attn
    weight, heads = old.qkv.weight, old.num_heads
    head_dim = weight.shape[0] // 3 // heads
    attn = PrunedAttention(weight.shape[1], heads, head_dim, head_dim, old.scale, qkv_bias=old.qkv.bias is not None,
                           proj_bias=old.proj.bias is not None,
                           rel_pos=TableRelativePosition(old.relative_position_bias_table, old.relative_position_index))
    attn = _filled(attn.to(weight.device, weight.dtype), weight, old.qkv.bias, old.proj)
    windows = ShiftedWindows(block.input_resolution, block.window_size, block.shift_size, block.attn_mask)
    return WindowedBlock(block.norm1, attn, block.norm2, block.mlp, windows, nn.Identity())


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
