"""The forward pass of a timm ``Block``, split where calibration looks inside it, and the cache
of hidden states at the current block boundary.

A block computes ``x + ls1(attn(norm1(x)))`` and then ``x + ls2(mlp(norm2(x)))``. The helpers
below compute exactly that (for the structures ``families.check_prunable`` admits) and show
optional probes what they see on the way: the attention's per-head queries, keys and values,
the input of its output projection, and the MLP's hidden activations. Tokens are
``(B, N, C)``; per-head tensors ``(B, H, N, d)``. How a block's attention groups its tokens and
what leaves the block is its family's word (:func:`corp_deploy.families.token_groups`): by default
one whole sequence per image, handed on as it is; a Swin block keeps a ``(B, H, W, C)`` feature
map and attends within windows, so that its attention and probes see ``(B * windows, N, C)``
window tokens, its heads probe one group of mutually attending tokens per "image", and its patch
merging hands the map on to the next stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .families import blocks_of, token_groups
from .layers import HeadsProbe, ProjInputProbe, head_dims, multi_head_attention, relative_position_bias

#: Sees one batch's MLP hidden activations ``act(fc1(.))``, ``(B, N, hidden)``.
HiddenProbe = Callable[[torch.Tensor], None]


def project_qk(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``(B, H, N, d)`` of timm ``Attention`` on normalised tokens ``x``,
    without computing the values."""
    B, N, _ = x.shape
    H, d = attn.num_heads, head_dims(attn)[0]
    rows = 2 * H * d
    bias = attn.qkv.bias[:rows] if attn.qkv.bias is not None else None
    q, k = F.linear(x, attn.qkv.weight[:rows], bias).reshape(B, N, 2, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def attention_forward(
    attn: nn.Module,
    x: torch.Tensor,
    on_heads: HeadsProbe | None = None,
    on_proj_input: ProjInputProbe | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attn(x)`` on normalised tokens ``x``; with probes it is computed from explicit queries,
    keys and values (timm ``Attention`` or ``RelPosAttention`` without qk-norm, or
    ``PrunedAttention``; a relative position bias is added to the logits) so that they see them.
    ``attn_mask``: an additive logit mask (a :class:`PrunedAttention`'s, for Swin's shifted windows)."""
    if on_heads is None and on_proj_input is None:
        return attn(x) if attn_mask is None else attn(x, attn_mask=attn_mask)
    return multi_head_attention(
        attn,
        x,
        attn_mask=attn_mask,
        rel_bias=relative_position_bias(attn),
        on_heads=on_heads,
        on_proj_input=on_proj_input,
    )


def attention_output(
    block: nn.Module,
    x: torch.Tensor,
    on_heads: HeadsProbe | None = None,
    on_proj_input: ProjInputProbe | None = None,
    attn: nn.Module | None = None,
) -> torch.Tensor:
    """The block's attention (or ``attn`` in its place) on normalised tokens ``x``, within the
    block's token groups (:func:`~corp_deploy.families.token_groups`); probes as in
    :func:`attention_forward`, ``on_heads`` seeing the heads split into the groups."""
    attn = block.attn if attn is None else attn
    groups = token_groups(block)
    if on_heads is not None:
        probe = on_heads

        def on_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            probe(groups.group_heads(q), groups.group_heads(k), groups.group_heads(v))

    return groups.attend(lambda t, mask: attention_forward(attn, t, on_heads, on_proj_input, mask), x)


def probe_query_keys(block: nn.Module, x: torch.Tensor, on_heads: HeadsProbe) -> None:
    """Show ``on_heads`` the queries and keys of the block's attention for its residual stream
    ``x`` (values: None where they are not computed)."""
    if token_groups(block).in_place:
        on_heads(*project_qk(block.attn, block.norm1(x)), None)
    else:  # each group's queries and keys, as its attention computes them
        attention_output(block, block.norm1(x), on_heads)


def mlp_hidden(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's hidden activations ``act(fc1(norm2(x)))`` for the block's residual stream ``x``."""
    mlp = block.mlp
    return mlp.act(mlp.fc1(block.norm2(x)))


def attention_residual(
    block: nn.Module, x: torch.Tensor, on_heads: HeadsProbe | None = None, on_proj_input: ProjInputProbe | None = None
) -> torch.Tensor:
    """The block's first half: ``x + ls1(attn(norm1(x)))``."""
    return x + block.ls1(attention_output(block, block.norm1(x), on_heads, on_proj_input))


def mlp_branch(block: nn.Module, x: torch.Tensor, on_hidden: HiddenProbe | None = None) -> torch.Tensor:
    """The block's MLP branch ``mlp(norm2(x))`` (before its LayerScale); with a probe (for MLPs
    whose hidden channels go straight into fc2) computed as ``fc2(act(fc1(.)))``."""
    if on_hidden is None:
        return block.mlp(block.norm2(x))
    h = mlp_hidden(block, x)
    on_hidden(h)
    return block.mlp.fc2(h)


def mlp_residual(block: nn.Module, x: torch.Tensor, on_hidden: HiddenProbe | None = None) -> torch.Tensor:
    """The block's second half: ``x + ls2(mlp(norm2(x)))``."""
    return x + block.ls2(mlp_branch(block, x, on_hidden))


def block_forward(
    block: nn.Module,
    x: torch.Tensor,
    *,
    on_heads: HeadsProbe | None = None,
    on_proj_input: ProjInputProbe | None = None,
    on_hidden: HiddenProbe | None = None,
) -> torch.Tensor:
    """``block(x)``, showing the probes what they look at (see the module docstring)."""
    return block_exit(block, mlp_residual(block, attention_residual(block, x, on_heads, on_proj_input), on_hidden))


def block_exit(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's output from its second residual ``x``, as its token groups hand it on (a Swin
    block's patch merging into the next stage; by default ``x`` itself)."""
    return token_groups(block).exit(x)


def residual_weight(layer: nn.Linear, layer_scale: nn.Module) -> torch.Tensor:
    """The weight through which a consumer layer writes into the residual stream, float64
    ``(out, in)``: ``diag(gamma) W`` when a LayerScale ``gamma`` follows it, else ``W``."""
    w = layer.weight.detach().double()
    gamma = getattr(layer_scale, "gamma", None)
    return w if gamma is None else gamma.detach().double()[:, None] * w


class BoundaryCache:
    """The hidden states entering the current block for the whole calibration set (under
    torch.distributed: this rank's batches of it), one ``(B, N, C)`` tensor per batch, overwritten in
    place as calibration moves through a block."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.input_size: tuple[int, ...] = ()
        self.offsets: list[int] = []  # where the batches are not consecutive: see image_offsets

    @property
    def tokens(self) -> int:
        """Tokens per image entering the current block (``N``, or ``H * W`` of a feature map)."""
        return self.batches[0][0, ..., 0].numel() if self.batches else 0

    def image_offsets(self) -> list[int]:
        """Per batch, the index of its first image in the whole calibration set: ``offsets`` where
        the engine recorded them (this rank's batches under torch.distributed), else consecutive."""
        if self.offsets:
            return self.offsets
        sizes = [len(x) for x in self.batches]
        return [sum(sizes[:i]) for i in range(len(sizes))]

    @property
    def device(self) -> torch.device:
        return self.batches[0].device

    def clone(self) -> BoundaryCache:
        """An independent copy (to run ahead through the model and keep this one where it is)."""
        copy = BoundaryCache()
        copy.batches = [x.clone() for x in self.batches]
        copy.input_size, copy.offsets = self.input_size, list(self.offsets)
        return copy

    def advance(self, step: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every batch ``x`` by ``step(x)``."""
        for i, x in enumerate(self.batches):
            self.batches[i] = step(x)


class _StopForward(Exception):
    pass


def embed_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The tokens ``(B, N, C)`` (a Swin's feature map ``(B, H, W, C)``) that enter the first block for ``images``."""
    captured = []

    def grab(module, args):
        captured.append(args[0])
        raise _StopForward

    handle = blocks_of(model)[0].register_forward_pre_hook(grab)
    try:
        model.forward_features(images)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured[0]
