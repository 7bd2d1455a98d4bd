"""CORP's value/output head-dim pruning with centred ridge compensation (docs/method.md §4).

The input of the attention's output projection is ``z = concat_h(A_h V_h)``, ``H * d_v``
channels laid out head-major (channel ``h * d_v + j`` is value dim ``j`` of head ``h``).
Channel ``j`` of head ``h`` depends only on value row ``j`` of that head, so (value rows, proj
columns) is a producer/consumer pair like (fc1 rows, fc2 columns) and
:mod:`corp_deploy.channels` applies unchanged with ``h := z`` and ``W := W_proj``: the predictor
of a pruned channel may use the kept channels of every head, since the fold goes into the whole
proj matrix. Every head keeps the same number of value dims, so the module stays a plain
multi-head attention.
"""

from __future__ import annotations

import torch
from torch import nn

from ...channels import compensated_consumer
from ...layers import PrunedAttention, head_dims


def fold_values(
    attn: nn.Module,
    kept: torch.Tensor,
    pruned: torch.Tensor,
    B: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
) -> PrunedAttention:
    """A :class:`PrunedAttention` keeping the proj-input channels ``kept`` (every head the same
    count) with the compensation folded into the output projection.

    Value rows of the kept channels stay; ``W_proj' = W_proj[:, S] + W_proj[:, P] @ B``,
    ``b_proj' = b_proj + W_proj[:, P] @ c`` (``B``, ``c`` as in
    :func:`corp_deploy.channels.solve_channels`; ``None``: plain slicing). Queries and keys
    (pruned or not) and the softmax scale are unchanged. ``kept`` and ``pruned`` are indices into
    the ``H * d_v`` proj-input channels, each ascending.
    """
    H = attn.num_heads
    qk_dim = head_dims(attn)[0]
    if len(kept) % H:
        raise ValueError(f"{len(kept)} kept value channels cannot be split evenly over {H} heads")
    qkv = attn.qkv
    rows = torch.cat([torch.arange(2 * H * qk_dim, device=kept.device), 2 * H * qk_dim + kept])
    proj = compensated_consumer(attn.proj, kept, pruned, B, c)
    new = PrunedAttention.replacing(attn, qk_dim, len(kept) // H, proj_bias=proj.bias is not None)
    with torch.no_grad():
        new.qkv.weight.copy_(qkv.weight[rows])
        if qkv.bias is not None:
            new.qkv.bias.copy_(qkv.bias[rows])
    new.proj = proj
    return new
