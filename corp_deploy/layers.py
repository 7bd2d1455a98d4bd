"""Reduced-dimension layers and the per-block structure of a compressed ViT."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
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
    Input and output: ``(B, N, dim)``. The call signature matches timm's ``Attention`` and
    ``RelPosAttention``.
    """

    def __init__(self, dim: int, num_heads: int, qk_head_dim: int, v_head_dim: int, scale: float,
                 qkv_bias: bool = True, proj_bias: bool = True, rel_pos: nn.Module | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.scale = float(scale)
        self.qkv = nn.Linear(dim, num_heads * (2 * qk_head_dim + v_head_dim), bias=qkv_bias)
        self.proj = nn.Linear(num_heads * v_head_dim, dim, bias=proj_bias)
        self.rel_pos = rel_pos

    @classmethod
    def replacing(cls, attn: nn.Module, qk_head_dim: int, v_head_dim: int, *, proj_bias: bool | None = None,
                  scale: float | None = None) -> "PrunedAttention":
        """An empty module (weights to be filled) to replace ``attn`` (timm ``Attention``,
        ``RelPosAttention`` or a ``PrunedAttention``) with other head dims: same width, heads,
        softmax scale (unless ``scale``), qkv bias, relative position module, device and dtype;
        ``proj_bias`` defaults to whether ``attn.proj`` has one."""
        qkv = attn.qkv
        return cls(qkv.in_features, attn.num_heads, qk_head_dim, v_head_dim, attn.scale if scale is None else scale,
                   qkv_bias=qkv.bias is not None,
                   proj_bias=attn.proj.bias is not None if proj_bias is None else proj_bias,
                   rel_pos=getattr(attn, "rel_pos", None)).to(qkv.weight.device, qkv.weight.dtype)

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, N, dim)`` -> q, k ``(B, H, N, qk_head_dim)`` and v ``(B, H, N, v_head_dim)``."""
        B, N, _ = x.shape
        H, dqk, dv = self.num_heads, self.qk_head_dim, self.v_head_dim
        q, k, v = self.qkv(x).split([H * dqk, H * dqk, H * dv], dim=-1)
        return (q.reshape(B, N, H, dqk).transpose(1, 2), k.reshape(B, N, H, dqk).transpose(1, 2),
                v.reshape(B, N, H, dv).transpose(1, 2))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                shared_rel_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_mask`` as in timm ``Attention``; ``shared_rel_pos`` as in ``RelPosAttention``
        (used when this module has no ``rel_pos`` of its own)."""
        B, N, _ = x.shape
        q, k, v = self.project_heads(x)
        bias = self.logit_bias(shared_rel_pos)
        if bias is not None:
            attn_mask = bias if attn_mask is None else attn_mask + bias
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           scale=self.scale)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))

    def logit_bias(self, shared_rel_pos: torch.Tensor | None = None) -> torch.Tensor | None:
        """The additive logit bias ``(1, H, N, N)``: this module's relative position bias, else
        ``shared_rel_pos`` (None: no bias)."""
        return relative_position_bias(self) if self.rel_pos is not None else shared_rel_pos

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, qk_head_dim={self.qk_head_dim}, "
                f"v_head_dim={self.v_head_dim}, scale={self.scale:.6g}")


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
        return BlockDims(block.mlp.fc1.out_features, attn.num_heads, attn.qk_head_dim,
                         attn.v_head_dim, "pruned", attn.scale)
    return BlockDims(block.mlp.fc1.out_features, attn.num_heads, attn.head_dim, attn.head_dim)


def reshape_block(block: nn.Module, dims: BlockDims, *, fc2_bias: bool | None = None,
                  proj_bias: bool | None = None) -> None:
    """Replace a block's layers by empty ones of the sizes in ``dims`` (weights to be loaded).

    ``fc2_bias`` / ``proj_bias`` force whether the new fc2 / attention output projection has a
    bias (compensation may add one); by default they follow the current layers.
    """
    mlp = block.mlp
    dim = mlp.fc1.in_features
    if dims.mlp_hidden != mlp.fc1.out_features or fc2_bias is not None:
        has_fc2_bias = mlp.fc2.bias is not None if fc2_bias is None else fc2_bias
        mlp.fc1 = nn.Linear(dim, dims.mlp_hidden, bias=mlp.fc1.bias is not None)
        mlp.fc2 = nn.Linear(dims.mlp_hidden, mlp.fc2.out_features, bias=has_fc2_bias)
    if dims.attention == "pruned":
        block.attn = PrunedAttention.replacing(block.attn, dims.qk_head_dim, dims.v_head_dim, proj_bias=proj_bias,
                                               scale=dims.scale)
