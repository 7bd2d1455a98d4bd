"""Reduced-precision (fp16 / bf16) copies of a ViT for export, kept numerically safe (the graph
builder of the precisions whose :attr:`~exporters.precision.Precision.dtype` is not float32).

TensorRT builds strongly typed networks (always from TensorRT 11 on, with the
strongly-typed flag on 10.x): the types written in the ONNX graph are the types it runs,
and builder precision flags no longer exist. So precision is decided here, in the graph:

* weights, Linear layers, the attention matmuls, GELU and the residual stream run in the
  low precision;
* every LayerNorm and the attention softmax run in float32 (their reductions, a variance and
  a sum of exponentials, are where fp16 overflows or drops small terms) and cast back;
* the patch-embedding convolution runs in float32 (ONNX ``Conv`` has no bfloat16 before
  opset 22; it is under 1 % of a ViT's MACs);
* the graph input and output stay float32, so callers feed the same tensors as for fp32.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from corp_deploy import CorpError, PrunedAttention, blocks_of, head_dims, is_prunable_attention, multi_head_attention

from .precision import TRACED, precision_named


class Float32Island(nn.Module):
    """Runs ``module`` (kept in float32) on a float32 copy of its input; output cast to ``dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module.float()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.float()).to(self.dtype)


class Float32SoftmaxAttention(PrunedAttention):
    """:class:`corp_deploy.PrunedAttention` written out with a float32 softmax; everything
    else runs in the parameters' dtype. Same parameters, layout and fixed ``scale``."""

    @classmethod
    def from_module(cls, attn: nn.Module) -> Float32SoftmaxAttention:
        """Sharing the ``qkv``, ``proj``, relative position and rotary embedding of a
        :class:`PrunedAttention`, a plain timm ``Attention`` or a ``RelPosAttention`` without qk-norm."""
        if not is_prunable_attention(attn):
            raise CorpError(
                f"cannot export attention of type {type(attn).__name__} (qk-norm, "
                "scale-norm or gating) in reduced precision; use --precision fp32"
            )
        new = cls.replacing(attn, *head_dims(attn))
        new.qkv, new.proj = attn.qkv, attn.proj
        return new

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        shared_rel_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if is_causal:
            raise CorpError("causal attention is not supported in reduced-precision export")
        return multi_head_attention(
            self, x, attn_mask=attn_mask, rel_bias=self.logit_bias(shared_rel_pos), kernel=float32_softmax_kernel
        )


def float32_softmax_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The attention kernel (:data:`corp_deploy.layers.AttentionKernel`, not causal) written out:
    logits in the parameters' dtype, then biases, softmax in float32, weights cast back for ``@ v``."""
    logits = ((q * scale) @ k.transpose(-2, -1)).float()
    for bias in (rel_bias, attn_mask):  # Swin's shift mask is an additive attn_mask
        if bias is not None:
            logits = logits + bias.float()
    return logits.softmax(dim=-1).to(v.dtype) @ v


class ReducedPrecisionModel(nn.Module):
    """float32 images in, float32 outputs out; ``model`` runs in low precision inside."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images).float()


def for_export(model: nn.Module, precision: str) -> nn.Module:
    """The module to trace for ``precision`` (one of :data:`exporters.precision.TRACED`):
    ``model`` itself (eval, float32) where its record's dtype is float32, else a converted copy of
    the timm ViT ``model`` following the policy in this module's docstring (``model`` itself is
    unchanged)."""
    dtype = precision_named(precision, among=TRACED).dtype
    if dtype == torch.float32:
        return model.eval().float()
    low = copy.deepcopy(model).eval().to(dtype)
    for block in blocks_of(low):
        block.attn = Float32SoftmaxAttention.from_module(block.attn)
    for parent in list(low.modules()):
        for name, child in parent.named_children():
            if isinstance(child, (nn.LayerNorm, nn.Conv2d)):
                setattr(parent, name, Float32Island(child, dtype))
    return ReducedPrecisionModel(low)
