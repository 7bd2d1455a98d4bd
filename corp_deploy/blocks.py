"""The forward pass of a timm ``Block``, split where calibration looks inside it, and the cache
of hidden states at the current block boundary.

A block computes ``x + ls1(attn(norm1(x)))`` and then ``x + ls2(mlp(norm2(x)))``. The helpers
below compute exactly that (for the structures ``models.check_prunable`` admits) and show
optional probes what they see on the way: the attention's per-head queries, keys and values,
the input of its output projection, and the MLP's hidden activations. Tokens are
``(B, N, C)``; per-head tensors ``(B, H, N, d)``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .layers import PrunedAttention, relative_position_bias

#: Sees one batch's per-head queries, keys and values ``(B, H, N, d)`` each (values may have
#: their own head dim).
HeadsProbe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
#: Sees one batch's input of the attention's output projection, ``concat_h(A_h V_h)``, ``(B, N, H * d_v)``.
ProjInputProbe = Callable[[torch.Tensor], None]
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


def attention_heads(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head queries, keys and values of timm ``Attention`` or a
    :class:`~corp_deploy.layers.PrunedAttention` on normalised tokens ``x``."""
    if isinstance(attn, PrunedAttention):
        return attn.project_heads(x)
    B, N, _ = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def attention_forward(attn: nn.Module, x: torch.Tensor, on_heads: HeadsProbe | None = None,
                      on_proj_input: ProjInputProbe | None = None) -> torch.Tensor:
    """``attn(x)`` on normalised tokens ``x``; with probes it is computed from explicit queries,
    keys and values (timm ``Attention`` or ``RelPosAttention`` without qk-norm, or
    ``PrunedAttention``; a relative position bias is added to the logits) so that they see them."""
    if on_heads is None and on_proj_input is None:
        return attn(x)
    B, N, _ = x.shape
    q, k, v = attention_heads(attn, x)
    if on_heads is not None:
        on_heads(q, k, v)
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=relative_position_bias(attn), scale=attn.scale)
    z = z.transpose(1, 2).reshape(B, N, -1)
    if on_proj_input is not None:
        on_proj_input(z)
    return attn.proj(z)


def mlp_hidden(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's hidden activations ``act(fc1(norm2(x)))`` for the block's residual stream ``x``."""
    mlp = block.mlp
    return mlp.act(mlp.fc1(block.norm2(x)))


def attention_residual(block: nn.Module, x: torch.Tensor, on_heads: HeadsProbe | None = None,
                       on_proj_input: ProjInputProbe | None = None) -> torch.Tensor:
    """The block's first half: ``x + ls1(attn(norm1(x)))``."""
    return x + block.ls1(attention_forward(block.attn, block.norm1(x), on_heads, on_proj_input))


def mlp_residual(block: nn.Module, x: torch.Tensor, on_hidden: HiddenProbe | None = None) -> torch.Tensor:
    """The block's second half: ``x + ls2(mlp(norm2(x)))``."""
    if on_hidden is None:
        return x + block.ls2(block.mlp(block.norm2(x)))
    h = mlp_hidden(block, x)
    on_hidden(h)
    return x + block.ls2(block.mlp.fc2(h))


def block_forward(block: nn.Module, x: torch.Tensor, *, on_heads: HeadsProbe | None = None,
                  on_proj_input: ProjInputProbe | None = None, on_hidden: HiddenProbe | None = None
                  ) -> torch.Tensor:
    """``block(x)``, showing the probes what they look at (see the module docstring)."""
    return mlp_residual(block, attention_residual(block, x, on_heads, on_proj_input), on_hidden)


def residual_weight(layer: nn.Linear, layer_scale: nn.Module) -> torch.Tensor:
    """The weight through which a consumer layer writes into the residual stream, float64
    ``(out, in)``: ``diag(gamma) W`` when a LayerScale ``gamma`` follows it, else ``W``."""
    w = layer.weight.detach().double()
    gamma = getattr(layer_scale, "gamma", None)
    return w if gamma is None else gamma.detach().double()[:, None] * w


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

    def clone(self) -> "BoundaryCache":
        """An independent copy (to run ahead through the model and keep this one where it is)."""
        copy = BoundaryCache()
        copy.batches = [x.clone() for x in self.batches]
        copy.input_size = self.input_size
        return copy

    def advance(self, step: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every batch ``x`` by ``step(x)``."""
        for i, x in enumerate(self.batches):
            self.batches[i] = step(x)
