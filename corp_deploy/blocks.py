"""The forward pass of a timm ``Block``, split where calibration looks inside it, and the cache
of hidden states at the current block boundary.

A block computes ``x + ls1(attn(norm1(x)))`` and then ``x + ls2(mlp(norm2(x)))``. The helpers
below compute exactly that (for the structures ``models.check_prunable`` admits) and show
optional probes what they see on the way: the attention's per-head queries and keys, and the
MLP's hidden activations. Tokens are ``(B, N, C)``; per-head tensors ``(B, H, N, d)``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Sees one batch's per-head queries and keys ``(B, H, N, d)`` each.
QKProbe = Callable[[torch.Tensor, torch.Tensor], None]
#: Sees one batch's MLP hidden activations ``act(fc1(.))``, ``(B, N, hidden)``.
HiddenProbe = Callable[[torch.Tensor], None]


def project_qk(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``(B, H, N, d)`` of timm ``Attention`` on normalised tokens ``x``,
    without computing the values."""
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    rows = 2 * H * d
    bias = attn.qkv.bias[:rows] if attn.qkv.bias is not None else None
    q, k = F.linear(x, attn.qkv.weight[:rows], bias).reshape(B, N, 2, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def attention_forward(attn: nn.Module, x: torch.Tensor, on_qk: QKProbe | None = None) -> torch.Tensor:
    """``attn(x)`` on normalised tokens ``x``. With ``on_qk`` (timm ``Attention`` only) it is
    computed from explicit queries, keys and values so that ``on_qk`` sees them."""
    if on_qk is None:
        return attn(x)
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    on_qk(q, k)
    out = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)
    return attn.proj(out.transpose(1, 2).reshape(B, N, H * d))


def mlp_hidden(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's hidden activations ``act(fc1(norm2(x)))`` for the block's residual stream ``x``."""
    mlp = block.mlp
    return mlp.act(mlp.fc1(block.norm2(x)))


def attention_residual(block: nn.Module, x: torch.Tensor, on_qk: QKProbe | None = None) -> torch.Tensor:
    """The block's first half: ``x + ls1(attn(norm1(x)))``."""
    return x + block.ls1(attention_forward(block.attn, block.norm1(x), on_qk))


def mlp_residual(block: nn.Module, x: torch.Tensor, on_hidden: HiddenProbe | None = None) -> torch.Tensor:
    """The block's second half: ``x + ls2(mlp(norm2(x)))``."""
    if on_hidden is None:
        return x + block.ls2(block.mlp(block.norm2(x)))
    h = mlp_hidden(block, x)
    on_hidden(h)
    return x + block.ls2(block.mlp.fc2(h))


def block_forward(block: nn.Module, x: torch.Tensor, *, on_qk: QKProbe | None = None,
                  on_hidden: HiddenProbe | None = None) -> torch.Tensor:
    """``block(x)``, showing the probes the attention's queries/keys and the MLP's hidden activations."""
    return mlp_residual(block, attention_residual(block, x, on_qk), on_hidden)


class BoundaryCache:
    """The hidden states entering the current block for the whole calibration set, one
    ``(B, N, C)`` tensor per batch, overwritten in place as calibration moves through a block."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.input_size: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.batches[0].shape[1] if self.batches else 0

    @property
    def device(self) -> torch.device:
        return self.batches[0].device

    def advance(self, step: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every batch ``x`` by ``step(x)``."""
        for i, x in enumerate(self.batches):
            self.batches[i] = step(x)
