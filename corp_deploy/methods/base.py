"""What a compression method is: the parts it prunes, the settings it reads, and how it
compresses the blocks of a model, given the calibration cache."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

from torch import nn

from ..blocks import BoundaryCache
from ..families import blocks_of

if TYPE_CHECKING:
    from ..config import CompressConfig


@dataclass
class BlockRun:
    """What the engine hands a method: the hidden states entering the first block (a method
    advances them block by block), a timer (``with timer("phase"): ...`` adds the wall time to
    that phase of the report), a callback to call after each block step (``block_steps`` of
    them), and ``report``, entries the method adds to the compress report."""

    cache: BoundaryCache
    timer: Callable[[str], AbstractContextManager]
    block_done: Callable[[], None]
    report: dict = field(default_factory=dict)


class Method(ABC):
    """One compression method. Subclasses set the class attributes and ``compress_blocks``.

    Attributes:
        name: the ``--method`` value.
        summary: one sentence for ``--help``.
        prunes: what the method can remove, in words (for messages).
        targets: the ``CompressConfig.target`` values it accepts; ``default_target`` its default.
        options: ``CompressConfig`` fields that only this method reads; giving another method
            a non-default value for them is refused, not ignored.
        has_compensation: whether there is a compensation step that ``compensation=False``
            switches off.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    prunes: ClassVar[str]
    targets: ClassVar[tuple[str, ...]]
    default_target: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()
    has_compensation: ClassVar[bool] = True

    @abstractmethod
    def compress_blocks(self, model: nn.Module, run: BlockRun, config: "CompressConfig") -> list[dict]:
        """Compress every block of ``model`` in place and return one report dict per block
        (with at least ``"dims"``, the block's :class:`~corp_deploy.layers.BlockDims` as a dict).
        Called inside ``torch.no_grad()`` with ``model`` on the calibration device."""

    def block_steps(self, model: nn.Module, config: "CompressConfig") -> int:
        """How many times ``compress_blocks`` calls ``run.block_done`` (for the progress bar)."""
        return len(blocks_of(model))

    def check_model(self, model: nn.Module, config: "CompressConfig") -> None:
        """CorpError if ``model`` cannot be compressed this way (beyond the common structure checks)."""
