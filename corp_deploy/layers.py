"""Reduced-dimension layers, timm's attention forward (:func:`multi_head_attention`, written once
for timm's and the pruned attention, calibration's probes and reduced-precision export) and the
per-block structure of a compressed ViT."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from torch import nn


class PrunedAttention(nn.Module):
    """Multi-head self-attention whose query/key head dim may differ from the value head dim.

    ``qkv`` is one ``Linear(dim, num_heads * (2 * qk_head_dim + v_head_dim))`` whose output
    is laid out as ``[q | k | v]``, each part head-major (head ``h`` occupies
    ``h * head_dim : (h + 1) * head_dim`` of its part). Logits are
    ``scale * q @ k^T`` with a fixed ``scale`` (the original model's
    ``head_dim ** -0.5``, kept after pruning), so it is passed to SDPA explicitly.
    ``rel_pos``: the relative position module of a timm ``RelPosAttention`` (kept from the dense
    model), whose ``get_bias()`` ``(1, H, N, N)`` is added to the logits.
    ``rope``: a rotary position embedding ``(N - num_prefix_tokens, 2 * qk_head_dim)`` (timm's
    concatenated sin/cos layout; ``rotate_half`` picks its pair layout), applied to the queries
    and keys of every token after the first ``num_prefix_tokens``, as timm's ``EvaAttention``
    does; kept as a non-persistent buffer (it is a function of the image size only).
    Input and output: ``(B, N, dim)``. The call signature matches timm's ``Attention`` and
    ``RelPosAttention``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qk_head_dim: int,
        v_head_dim: int,
        scale: float,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        rel_pos: nn.Module | None = None,
        rope: torch.Tensor | None = None,
        num_prefix_tokens: int = 0,
        rotate_half: bool = False,
    ) -> None:
        super().__init__()
        if rope is not None and rope.shape[-1] != 2 * qk_head_dim:
            raise ValueError(
                f"a rotary embedding of width {rope.shape[-1]} does not fit query/key heads of {qk_head_dim} dims"
            )
        self.num_heads = num_heads
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.scale = float(scale)
        self.qkv = nn.Linear(dim, num_heads * (2 * qk_head_dim + v_head_dim), bias=qkv_bias)
        self.proj = nn.Linear(num_heads * v_head_dim, dim, bias=proj_bias)
        self.rel_pos = rel_pos
        self.register_buffer("rope", rope, persistent=False)
        self.num_prefix_tokens = num_prefix_tokens
        self.rotate_half = rotate_half

    @classmethod
    def replacing(
        cls,
        attn: nn.Module,
        qk_head_dim: int,
        v_head_dim: int,
        *,
        proj_bias: bool | None = None,
        scale: float | None = None,
    ) -> PrunedAttention:
        """An empty module (weights to be filled) to replace ``attn`` (timm ``Attention``,
        ``RelPosAttention`` or a ``PrunedAttention``) with other head dims: same width, heads,
        softmax scale (unless ``scale``), qkv bias, relative position module, rotary embedding,
        device and dtype; ``proj_bias`` defaults to whether ``attn.proj`` has one."""
        qkv = attn.qkv
        return cls(
            qkv.in_features,
            attn.num_heads,
            qk_head_dim,
            v_head_dim,
            attn.scale if scale is None else scale,
            qkv_bias=qkv.bias is not None,
            proj_bias=attn.proj.bias is not None if proj_bias is None else proj_bias,
            rel_pos=getattr(attn, "rel_pos", None),
            rope=getattr(attn, "rope", None),
            num_prefix_tokens=getattr(attn, "num_prefix_tokens", 0),
            rotate_half=getattr(attn, "rotate_half", False),
        ).to(qkv.weight.device, qkv.weight.dtype)

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, N, dim)`` -> q, k ``(B, H, N, qk_head_dim)`` (rotated when there is a rotary
        embedding: what the logits see) and v ``(B, H, N, v_head_dim)``."""
        B, N, _ = x.shape
        H, dqk, dv = self.num_heads, self.qk_head_dim, self.v_head_dim
        qkv = self.qkv(x)  # a new (B, N, width) tensor: every split below is a view of it
        if dqk == dv:  # timm's views: one view, permute and unbind for all three
            q, k, v = qkv.view(B, N, 3, H, dv).permute(2, 0, 3, 1, 4).unbind(0)
        else:  # the same for the queries and keys, and the values' own
            qk, v = qkv.split([2 * H * dqk, H * dv], dim=-1)
            q, k = qk.view(B, N, 2, H, dqk).permute(2, 0, 3, 1, 4).unbind(0)
            v = v.view(B, N, H, dv).transpose(1, 2)
        if self.rope is not None:
            q, k = self._rotate(q).type_as(v), self._rotate(k).type_as(v)
        return q, k, v

    def _rotate(self, t: torch.Tensor) -> torch.Tensor:
        npt = self.num_prefix_tokens
        return torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], self.rope, half=self.rotate_half)], dim=2)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        shared_rel_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attn_mask`` as in timm ``Attention``; ``shared_rel_pos`` as in ``RelPosAttention``
        (used when this module has no ``rel_pos`` of its own)."""
        return multi_head_attention(
            self, x, attn_mask=attn_mask, rel_bias=self.logit_bias(shared_rel_pos), is_causal=is_causal
        )

    def logit_bias(self, shared_rel_pos: torch.Tensor | None = None) -> torch.Tensor | None:
        """The additive logit bias ``(1, H, N, N)``: this module's relative position bias, else
        ``shared_rel_pos`` (None: no bias)."""
        return relative_position_bias(self) if self.rel_pos is not None else shared_rel_pos

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, qk_head_dim={self.qk_head_dim}, "
            f"v_head_dim={self.v_head_dim}, scale={self.scale:.6g}" + (", rotary" if self.rope is not None else "")
        )


#: ``kernel(q, k, v, scale, attn_mask, rel_bias, is_causal)``: per-head queries and keys
#: ``(B, H, N, d)`` and values ``(B, H, N, d_v)`` to ``softmax(scale * q k^T + attn_mask + rel_bias) v``,
#: ``(B, H, N, d_v)``; ``attn_mask`` and ``rel_bias`` are additive logit biases or None,
#: ``is_causal`` as in ``scaled_dot_product_attention``.
AttentionKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None", "torch.Tensor | None", bool], torch.Tensor
]
#: Sees one batch's per-head queries, keys and values ``(B, H, N, d)`` each (values may have
#: their own head dim).
HeadsProbe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
#: Sees one batch's input of the attention's output projection, ``concat_h(A_h V_h)``, ``(B, N, H * d_v)``.
ProjInputProbe = Callable[[torch.Tensor], None]


def sdpa_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The :data:`AttentionKernel` of timm's attention: PyTorch's fused
    ``scaled_dot_product_attention`` with the bias ``attn_mask + rel_bias``."""
    if rel_bias is not None:
        attn_mask = rel_bias if attn_mask is None else attn_mask + rel_bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def attention_heads(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head queries, keys and values of timm ``Attention`` or a :class:`PrunedAttention` on
    normalised tokens ``x`` ``(B, N, dim)``: q, k ``(B, H, N, d)``, v ``(B, H, N, d_v)``."""
    if isinstance(attn, PrunedAttention):
        return attn.project_heads(x)
    B, N, _ = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, head_dims(attn)[0]).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def multi_head_attention(
    attn: nn.Module,
    x: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    is_causal: bool = False,
    kernel: AttentionKernel = sdpa_kernel,
    on_heads: HeadsProbe | None = None,
    on_proj_input: ProjInputProbe | None = None,
) -> torch.Tensor:
    """timm's attention forward, ``(B, N, dim)`` -> ``(B, N, dim)``, for timm ``Attention`` (or
    ``RelPosAttention`` without qk-norm) and :class:`PrunedAttention`: ``qkv`` -> heads
    (:func:`attention_heads`) -> ``kernel`` with ``attn.scale`` -> heads concatenated -> ``proj``.
    The probes see the heads and the projection's input on the way."""
    B, N, _ = x.shape
    q, k, v = attention_heads(attn, x)
    if on_heads is not None:
        on_heads(q, k, v)
    z = kernel(q, k, v, attn.scale, attn_mask, rel_bias, is_causal).transpose(1, 2).reshape(B, N, -1)
    if on_proj_input is not None:
        on_proj_input(z)
    return attn.proj(z)


class GatedLinear(nn.Module):
    """The hidden channels of a gated MLP (SwiGLU): ``act(x W_gate^T + b_gate) * (x W_up^T + b_up)``,
    ``(..., in_features)`` -> ``(..., out_features)``. Hidden channel ``j`` is row ``j`` of both
    ``gate`` and ``up``, so keeping a channel keeps both rows (:func:`keep_rows`). Used as the ``fc1``
    of a timm ``Mlp`` whose ``act`` is the identity."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, act: nn.Module) -> None:
        super().__init__()
        self.gate, self.up, self.act = gate, up, act

    @property
    def in_features(self) -> int:
        return self.gate.in_features

    @property
    def out_features(self) -> int:
        return self.gate.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.gate(x)) * self.up(x)


def keep_rows(layer: nn.Module, kept: torch.Tensor | None = None, count: int | None = None) -> nn.Module:
    """A producer layer (``nn.Linear`` or :class:`GatedLinear`) with only the output channels ``kept``
    (weights copied), or with ``count`` outputs and empty weights; same device and dtype."""
    if isinstance(layer, GatedLinear):
        return GatedLinear(keep_rows(layer.gate, kept, count), keep_rows(layer.up, kept, count), layer.act)
    out = nn.Linear(
        layer.in_features,
        len(kept) if kept is not None else count,
        bias=layer.bias is not None,
        device=layer.weight.device,
        dtype=layer.weight.dtype,
    )
    if kept is not None:
        with torch.no_grad():
            out.weight.copy_(layer.weight[kept])
            if layer.bias is not None:
                out.bias.copy_(layer.bias[kept])
    return out


def head_dims(attn: nn.Module) -> tuple[int, int]:
    """``(query/key, value)`` dims per head of a :class:`PrunedAttention` or a timm attention (width /
    heads where it keeps no ``head_dim``, as CaiT's)."""
    if isinstance(attn, PrunedAttention):
        return attn.qk_head_dim, attn.v_head_dim
    head_dim = getattr(attn, "head_dim", None) or attn.proj.in_features // attn.num_heads
    return head_dim, head_dim


#: PyTorch's fused attention kernels on CUDA (flash, memory-efficient, cuDNN) take head dims that
#: are multiples of this only; other head dims run the unfused math path there (lab/RESULTS.md
#: "Half precision on a CUDA GPU"; the CPU's flash kernel takes any equal dims).
FUSED_HEAD_DIM_MULTIPLE = 8


def block_head_dims(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``{block index: (query/key, value) head dims}`` of the attention of every block in
    ``model.blocks`` (:func:`head_dims`; empty for a model without ``blocks``)."""
    return {
        i: head_dims(block.attn)
        for i, block in enumerate(getattr(model, "blocks", ()))
        if isinstance(getattr(block, "attn", None), nn.Module)
    }


def unfusable_heads(model: nn.Module, dense_head_dims: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """``{block index: (query/key, value) head dims}`` of the blocks of ``model`` where compression
    changed a head dim from the dense model's (``dense_head_dims``, :func:`block_head_dims` of the
    dense model) to one that is not a multiple of :data:`FUSED_HEAD_DIM_MULTIPLE`: PyTorch runs
    their attention unfused on CUDA. Dims the dense model has itself are not counted (no compress
    option changes them)."""
    return {
        i: dims
        for i, dims in block_head_dims(model).items()
        if any(
            kept != dense and kept % FUSED_HEAD_DIM_MULTIPLE
            for kept, dense in zip(dims, dense_head_dims.get(i, dims), strict=True)
        )
    }


def unfusable_heads_text(heads: dict[int, tuple[int, int]]) -> str:
    """What :func:`unfusable_heads` found, in words, with the option that avoids it."""
    shown = ", ".join(f"block {i}: {qk}/{v}" for i, (qk, v) in list(heads.items())[:3])
    more = f" and {len(heads) - 3} more" if len(heads) > 3 else ""
    return (
        f"head dims (query/key/value) pruned to sizes that are not multiples of {FUSED_HEAD_DIM_MULTIPLE} "
        f"({shown}{more}): "
        "PyTorch's fused attention kernels on CUDA refuse them and the unfused path is slow (in half "
        "precision it made the compressed model slower than the dense one); for CUDA, compress with "
        f"--round-to {FUSED_HEAD_DIM_MULTIPLE}"
    )


def relative_position_bias(attn: nn.Module) -> torch.Tensor | None:
    """The additive logit bias ``(1, H, N, N)`` of an attention with a relative position module
    (timm ``RelPosAttention``, :class:`PrunedAttention` made from one), else None."""
    rel_pos = getattr(attn, "rel_pos", None)
    return rel_pos.get_bias() if rel_pos is not None else None


@dataclass(frozen=True)
class BlockDims:
    """The shape of one transformer block after compression.

    ``attention`` is ``"timm"`` when the block keeps timm's own attention module (not
    pruned) and ``"pruned"`` when it is a :class:`PrunedAttention` with ``qk_head_dim``
    query/key dims and ``v_head_dim`` value dims per head and softmax ``scale``.
    """

    mlp_hidden: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    attention: str = "timm"
    scale: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def block_dims(block: nn.Module) -> BlockDims:
    """Read the current dims of a timm ``Block`` (dense or compressed)."""
    attn = block.attn
    if isinstance(attn, PrunedAttention):
        return BlockDims(
            block.mlp.fc1.out_features, attn.num_heads, attn.qk_head_dim, attn.v_head_dim, "pruned", attn.scale
        )
    return BlockDims(block.mlp.fc1.out_features, attn.num_heads, *head_dims(attn))


def reshape_block(
    block: nn.Module, dims: BlockDims, *, fc2_bias: bool | None = None, proj_bias: bool | None = None
) -> None:
    """Replace a block's layers by empty ones of the sizes in ``dims`` (weights to be loaded).

    ``fc2_bias`` / ``proj_bias`` force whether the new fc2 / attention output projection has a
    bias (compensation may add one); by default they follow the current layers.
    """
    mlp = block.mlp
    if dims.mlp_hidden != mlp.fc1.out_features or fc2_bias is not None:
        has_fc2_bias = mlp.fc2.bias is not None if fc2_bias is None else fc2_bias
        mlp.fc1 = keep_rows(mlp.fc1, count=dims.mlp_hidden)
        mlp.fc2 = nn.Linear(
            dims.mlp_hidden,
            mlp.fc2.out_features,
            bias=has_fc2_bias,
            device=mlp.fc2.weight.device,
            dtype=mlp.fc2.weight.dtype,
        )
    if dims.attention == "pruned":
        block.attn = PrunedAttention.replacing(
            block.attn, dims.qk_head_dim, dims.v_head_dim, proj_bias=proj_bias, scale=dims.scale
        )
