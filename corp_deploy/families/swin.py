"""timm ``SwinTransformer`` (v1): stages of blocks on a ``(B, H, W, C)`` feature map, each block
attending within (shifted) windows with a relative position bias, and patch merging at the start
of every later stage.

Each block's standard form is a :class:`WindowedBlock`: its attention a full-width
:class:`~corp_deploy.layers.PrunedAttention` holding the bias table, the shift, window partition
and shift mask in a :class:`ShiftedWindows`, and the next stage's patch merging moved to the end
of the block (``transition``) so that the blocks, walked in order, are the whole model between the
patch embedding and the final norm. The family's ``token_groups`` (:class:`WindowGroups`) tells
calibration how such a block attends and hands its tokens on; query/key statistics are summed per
group of tokens the shift mask lets attend to each other (docs/method.md §9). Swin V2 is refused
as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.models import swin_transformer as swin
from timm.models.swin_transformer_v2 import SwinTransformerV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
from torch import nn

from ..layers import PrunedAttention
from .record import Example, Family, SupportRow, TokenCounts, TokenGroups, class_path, full_attention_macs
from .shared import ScaledResidualBlock, TableRelativePosition, filled


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

    def __init__(
        self, resolution: tuple[int, int], window: tuple[int, int], shift: tuple[int, int], mask: torch.Tensor | None
    ) -> None:
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

    def attend(
        self, attention: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: torch.Tensor
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

    def __init__(
        self,
        norm1: nn.Module,
        attn: nn.Module,
        norm2: nn.Module,
        mlp: nn.Module,
        windows: ShiftedWindows,
        transition: nn.Module,
    ) -> None:
        super().__init__(norm1, attn, nn.Identity(), norm2, mlp, nn.Identity())
        self.windows, self.transition = windows, transition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.windows.attend(lambda t, mask: self.attn(t, attn_mask=mask), self.norm1(x)))
        return self.transition(x + self.ls2(self.mlp(self.norm2(x))))


class WindowGroups(TokenGroups):
    """The token groups of a :class:`WindowedBlock` (the family's ``token_groups``): attention
    within its (shifted) windows of the ``(B, H, W, C)`` feature map, whose queries, keys and
    values are split into the groups of tokens the shift mask lets attend to each other
    (:meth:`ShiftedWindows.group_heads`), and the patch merging into the next stage
    (``transition``) on the way out."""

    in_place = False  # attention and its probes see window tokens (B * nW, N, C)
    description = "Swin's windowed feature maps"

    def __init__(self, block: WindowedBlock) -> None:
        self.windows, self.transition = block.windows, block.transition

    def attend(
        self, attention: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        return self.windows.attend(attention, x)

    def group_heads(self, t: torch.Tensor) -> torch.Tensor:
        return self.windows.group_heads(t)

    def counts(self, tokens: int) -> TokenCounts:
        """The block's own feature map's tokens for the MLP, those of the map padded to whole
        windows for attention, and a window's tokens as keys (whatever ``tokens``)."""
        windows = self.windows
        return TokenCounts(windows.tokens, windows.padded_tokens, windows.area)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        return self.transition(x)


def _token_groups(block: nn.Module) -> WindowGroups | None:
    return WindowGroups(block) if isinstance(block, WindowedBlock) else None


def _blocks(model: swin.SwinTransformer) -> list[nn.Module]:
    return [block for stage in model.layers for block in stage.blocks]


def _problem(model: swin.SwinTransformer) -> str | None:
    for s, stage in enumerate(model.layers):
        if type(stage) is not swin.SwinTransformerStage:
            return f"stage {s} is a {class_path(stage)}, not timm's SwinTransformerStage"
        for i, block in enumerate(stage.blocks):
            if type(block) is WindowedBlock:
                continue
            if type(block) is not swin.SwinTransformerBlock or type(block.attn) is not swin.WindowAttention:
                return f"stage {s} block {i} is a {class_path(block)}, not timm's SwinTransformerBlock"
            if block.dynamic_mask:
                return (
                    f"stage {s} block {i} computes its shift mask for each input (dynamic_mask=True), "
                    "which is not supported"
                )
    return None


def _standard_form(model: swin.SwinTransformer) -> None:
    stages = list(model.layers)
    for stage in stages:
        for i, block in enumerate(stage.blocks):
            if type(block) is swin.SwinTransformerBlock:
                stage.blocks[i] = _standard_block(block)
    for before, stage in zip(stages, stages[1:]):
        if not isinstance(stage.downsample, nn.Identity):
            before.blocks[-1].transition, stage.downsample = stage.downsample, nn.Identity()


def _in_standard_form(model: swin.SwinTransformer) -> bool:
    stages = list(model.layers)
    return all(isinstance(stage.downsample, nn.Identity) for stage in stages[1:]) and not any(
        type(block) is swin.SwinTransformerBlock for block in _blocks(model)
    )


def _standard_block(block: swin.SwinTransformerBlock) -> WindowedBlock:
    old = block.attn
    weight, heads = old.qkv.weight, old.num_heads
    head_dim = weight.shape[0] // 3 // heads
    attn = PrunedAttention(
        weight.shape[1],
        heads,
        head_dim,
        head_dim,
        old.scale,
        qkv_bias=old.qkv.bias is not None,
        proj_bias=old.proj.bias is not None,
        rel_pos=TableRelativePosition(old.relative_position_bias_table, old.relative_position_index),
    )
    attn = filled(attn.to(weight.device, weight.dtype), weight, old.qkv.bias, old.proj)
    mask = block.attn_mask
    if mask is not None and mask.is_meta:
        # a model built on the meta device has a mask without values, from which no groups can be read:
        # timm computes it again on the CPU, and the windows (mask and groups) then go to the meta device
        mask = block.get_attn_mask(device=torch.device("cpu"), dtype=mask.dtype)
    windows = ShiftedWindows(block.input_resolution, block.window_size, block.shift_size, mask).to(weight.device)
    return WindowedBlock(block.norm1, attn, block.norm2, block.mlp, windows, nn.Identity())


FAMILY = Family(
    name="swin",
    summary="SwinTransformer (swin_*: windowed attention with relative position bias, patch merging kept dense)",
    matches=lambda model: isinstance(model, swin.SwinTransformer),
    problem=_problem,
    rows=(
        SupportRow(
            "`SwinTransformer` (v1: shifted windows, patch merging)",
            "`swin_tiny_patch4_window7_224`, `swin_base_patch4_window12_384`, `swin_s3_tiny_224`",
            "all three in every block (methods corp and vbp; toast refused); patch merging stays dense",
            "all three: per token for MLP and values, query/key statistics summed per group of tokens the "
            "shift mask lets attend to each other (docs/method.md §9)",
        ),
    ),
    # two stages joined by patch merging; the first (14 x 14 tokens, 7 x 7 windows) has a shifted block
    examples={
        "swin": Example(
            "swin_tiny_patch4_window7_224",
            dict(img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10),
            56,
            None,
            ("corp", "vbp"),
        )
    },
    blocks=_blocks,
    standard_form=_standard_form,
    in_standard_form=_in_standard_form,
    attention_macs={PrunedAttention: full_attention_macs},
    token_groups=_token_groups,
)

#: Swin V2 is refused as a whole (its class names the reason).
V2 = Family(
    name="swin-v2",
    summary="Swin V2 (refused)",
    matches=lambda model: isinstance(model, (SwinTransformerV2, SwinTransformerV2Cr)),
    problem=lambda model: (
        f"it builds a timm {type(model).__name__}: its blocks are post-norm and their attention "
        "is a scaled cosine of queries and keys plus a position bias computed by an MLP, so neither "
        "the block layout nor the query/key system of docs/method.md §3 applies; Swin v1 (swin_*) "
        "is supported"
    ),
    refused=("Swin V2 (post-norm, cosine attention)",),
)
