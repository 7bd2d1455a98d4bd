"""Layers and rewrites that several families' standard forms share: the scaled-residual pre-norm
block, a relative position bias read from a table, residual scales as timm ``LayerScale``, a fused
attention filled from another's weights, and gated MLPs (any family) as a timm ``Mlp`` whose
``fc1`` is a :class:`~corp_deploy.layers.GatedLinear`."""

from __future__ import annotations

import torch
from timm.layers import GluMlp, LayerScale, Mlp, SwiGLU
from torch import nn

from ..layers import GatedLinear


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

    def __init__(
        self, norm1: nn.Module, attn: nn.Module, ls1: nn.Module, norm2: nn.Module, mlp: nn.Module, ls2: nn.Module
    ) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1 = norm1, attn, ls1
        self.norm2, self.mlp, self.ls2 = norm2, mlp, ls2

    def forward(
        self,
        x: torch.Tensor,
        shared_rel_pos_bias: torch.Tensor | None = None,
        rope: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if shared_rel_pos_bias is not None or attn_mask is not None or is_causal:
            raise ValueError(
                "a shared relative position bias or an attention mask is not supported by the rewritten blocks"
            )
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


def layer_scale(gamma: nn.Parameter | None) -> nn.Module:
    """A residual scale ``gamma`` ``(C,)`` as a timm ``LayerScale`` (the identity without one)."""
    if gamma is None:
        return nn.Identity()
    scale = LayerScale(gamma.shape[0], device=gamma.device, dtype=gamma.dtype)
    with torch.no_grad():
        scale.gamma.copy_(gamma)
    return scale


def filled(attn: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, proj: nn.Linear) -> nn.Module:
    """``attn`` with its fused ``qkv`` set to ``weight`` / ``bias`` and its ``proj`` copied from ``proj``."""
    with torch.no_grad():
        attn.qkv.weight.copy_(weight)
        if bias is not None:
            attn.qkv.bias.copy_(bias)
        attn.proj.load_state_dict(proj.state_dict())
    return attn


def is_gated(mlp: nn.Module | None) -> bool:
    """Whether ``mlp`` is a gated MLP :func:`standard_mlp` rewrites: timm ``SwiGLU``, or a ``GluMlp``
    (e.g. ``SwiGLUPacked``) whose packed fc1 is ``[gate | up]`` along the last dim."""
    return isinstance(mlp, SwiGLU) or (isinstance(mlp, GluMlp) and not mlp.gate_last and mlp.chunk_dim == -1)


def standard_mlp(mlp: nn.Module) -> nn.Module:
    """A gated MLP (:func:`is_gated`) as a timm ``Mlp`` whose ``fc1`` is a :class:`GatedLinear`
    (the same function)."""
    if isinstance(mlp, GluMlp):
        hidden = mlp.fc1.out_features // 2
        gate, up = (
            nn.Linear(
                mlp.fc1.in_features,
                hidden,
                bias=mlp.fc1.bias is not None,
                device=mlp.fc1.weight.device,
                dtype=mlp.fc1.weight.dtype,
            )
            for _ in range(2)
        )
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
