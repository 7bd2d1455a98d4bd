"""What a model family tells the rest of corp-deploy: the :class:`Family` record that every module
of this package fills in once, and the helpers their refusal messages share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ..layers import head_dims


class Example(NamedTuple):
    """One small model of a family for the tests: timm ``model`` built with ``kwargs`` (random
    weights), square images of ``size`` pixels, the ``target`` that prunes every part the family
    allows (None: all three) and the ``methods`` that apply to it."""

    model: str
    kwargs: dict
    size: int
    target: str | None = None
    methods: tuple[str, ...] = ("corp", "vbp", "toast")


class SupportRow(NamedTuple):
    """One row of the table of supported models in docs/models.md (Markdown cells)."""

    family: str
    examples: str
    pruned: str
    compensated: str


#: MACs per image of an attention's two matmuls (logits and attention-weighted values), from the
#: module and the shape ``(B, N, C)`` of its input.
AttentionMacs = Callable[[nn.Module, tuple[int, ...]], int]


def full_attention_macs(attn: nn.Module, shape: tuple[int, ...]) -> int:
    """Every one of ``N`` tokens queries every token: ``B * H * N^2 * (qk_dim + v_dim)``."""
    batch, tokens = shape[0], shape[1]
    return batch * attn.num_heads * tokens * tokens * sum(head_dims(attn))


class TokenCounts(NamedTuple):
    """Tokens per image that the parts of one block see: ``mlp`` (the MLP and the residual stream),
    ``attention`` (the attention's projections) and ``keys`` (the keys each query attends to)."""

    mlp: int
    attention: int
    keys: int


class TokenGroups:
    """How a block in standard form groups its tokens for attention, and hands them on.

    This default is every family's unless it says otherwise (:attr:`Family.token_groups`): the
    block's tokens ``(B, N, C)`` are one group per image that attends as a whole, in place, and
    leave the block as they are. A family whose blocks attend within parts of their tokens or
    change them on the way out (Swin: windows of a feature map, patch merging) returns a subclass.
    """

    #: whether attention sees the block's own tokens, one whole sequence per image, so that its
    #: queries, keys and the input of its output projection line up with the residual stream's tokens
    in_place = True
    #: what the block's tokens are, for refusals of methods that need a token sequence
    description = "a token sequence"

    def attend(
        self, attention: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """``attention(tokens, mask)`` of the groups of the block's normalised tokens ``x``, put
        back in place: ``tokens`` ``(B', N', C)`` are the groups' tokens, ``mask`` an additive
        logit mask or None. Here ``attention(x, None)``."""
        return attention(x, None)

    def group_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Per-head ``t`` ``(B', H, N', d)`` as :meth:`attend` shows it, split so that each "image"
        is one group of tokens that attend to each other (statistics summed per image are those of
        the logits the softmax mixes). Here ``t`` itself."""
        return t

    def counts(self, tokens: int) -> TokenCounts:
        """The tokens per image the block's parts see, given ``tokens`` entering the model's first
        block. Here ``tokens`` for every part."""
        return TokenCounts(tokens, tokens, tokens)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output from its second residual ``x``. Here ``x``."""
        return x


#: The token groups of every block whose family says nothing else.
WHOLE_SEQUENCE = TokenGroups()


def _blocks_attribute(model: nn.Module) -> list[nn.Module]:
    return list(getattr(model, "blocks", ()))


@dataclass(frozen=True)
class Family:
    """A timm model family: everything corp-deploy knows about it, in one place.

    Attributes:
        name: short name (``vit``, ``swin``, ...), also the module's name.
        summary: which timm models it covers, one phrase for messages.
        matches: whether a timm model (dense, or already in standard form) belongs to it.
        problem: why a model of the family cannot be compressed (a phrase naming the class or
            structure that is not supported), or None.
        rows: its rows of the table of supported models (docs/models.md); none for a family refused as a whole.
        refused: variants refused as a whole, for the table's last row.
        examples: small test models by test id.
        blocks: its transformer blocks in forward order (default ``model.blocks``).
        standard_form: rewrites its blocks in place into the pre-norm block the engine compresses
            (docs/method.md §9), computing the same function; default: nothing to rewrite.
        in_standard_form: whether ``standard_form`` would leave the model unchanged.
        attention_macs: the MAC formula of each attention class its (standard-form) blocks use.
        prunable_attention: whether one of its attention modules has the query/key and value
            structure of docs/method.md §3-4 (a :class:`~corp_deploy.layers.PrunedAttention`
            always has).
        part_problem: why a block cannot have the given parts (``mlp``, ``qk``, ``vo``) pruned
            beyond the checks every family shares, saying which ``--target`` works; or None.
        token_groups: how one of its blocks (in standard form) groups its tokens for attention
            and hands them on (a :class:`TokenGroups`), or None: not a block the family treats
            otherwise than :data:`WHOLE_SEQUENCE` (the default, for every block).
    """

    name: str
    summary: str
    matches: Callable[[nn.Module], bool]
    problem: Callable[[nn.Module], str | None]
    rows: tuple[SupportRow, ...] = ()
    refused: tuple[str, ...] = ()
    examples: dict[str, Example] = field(default_factory=dict)
    blocks: Callable[[nn.Module], list[nn.Module]] = _blocks_attribute
    standard_form: Callable[[nn.Module], None] = lambda model: None
    in_standard_form: Callable[[nn.Module], bool] = lambda model: True
    attention_macs: dict[type, AttentionMacs] = field(default_factory=dict)
    prunable_attention: Callable[[nn.Module], bool] = lambda attn: False
    part_problem: Callable[[nn.Module, tuple[str, ...]], str | None] = lambda block, parts: None
    token_groups: Callable[[nn.Module], TokenGroups | None] = lambda block: None

    @property
    def supported(self) -> bool:
        """Whether some of its models can be compressed (False: refused as a whole)."""
        return bool(self.rows)


def class_path(obj: object) -> str:
    """``module.Class`` of ``obj`` (timm reuses class names such as ``Block`` across families)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def describe(model: nn.Module) -> str:
    """What timm built, for refusals: its class, and its first block's with their attention and MLP
    (or that it has no sequence of blocks)."""
    found = f"it builds a timm {type(model).__name__}"
    blocks = getattr(model, "blocks", None)
    if not (isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) > 0):
        return f"{found}, which has no sequence of transformer blocks"
    parts = ", ".join(
        f"{class_path(getattr(blocks[0], part))} {label}"
        for part, label in (("attn", "attention"), ("mlp", "MLP"))
        if hasattr(blocks[0], part)
    )
    return found + f" whose blocks are {class_path(blocks[0])}" + (f" ({parts})" if parts else "")
