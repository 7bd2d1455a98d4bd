"""What a compression method is: the parts it prunes, its own validated options, and how it
compresses the blocks of a model, given the calibration cache."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from torch import nn

from ..blocks import BoundaryCache
from ..families import blocks_of
from ..parts import Part


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


def option(
    default: Any,
    help: str,
    *,
    value_type: type | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    default_help: str | None = None,
) -> Any:
    """A :class:`MethodOptions` field that is also a command-line option ``--<name with dashes>``:
    ``help`` its ``--help`` text, ``value_type`` its type (that of ``default`` when not given; a
    bool is a flag), ``choices`` its allowed values, ``default_help`` what ``--help`` says about a
    default decided later (the field's default is then None)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "value_type": value_type or type(default),
            "choices": choices,
            "metavar": metavar,
            "default_help": default_help,
        },
    )


@dataclass(frozen=True)
class MethodOptions:
    """The settings only one method reads (ModelOpt's per-mode configs are the model). Each
    method subclasses it with fields, validated in ``__post_init__`` (a
    :class:`~corp_deploy.errors.SettingError` naming the field); :meth:`check` validates them
    against the settings every method shares, once those are known. Fields made with
    :func:`option` are also command-line options; plain fields are for library callers only."""

    @property
    def has_budget(self) -> bool:
        """Whether the kept sizes come from a budget rather than from sparsities."""
        return False

    @property
    def macs_fraction(self) -> float | None:
        """The budget as a fraction of the dense MACs (None without a budget)."""
        return None

    @property
    def default_target(self) -> str | None:
        """The target these options call for when none is given (None: the method's default)."""
        return None

    def check(self, config: CompressSettings) -> None:
        """SettingError when these options contradict ``config``'s shared settings."""

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CompressSettings(Protocol):
    """What a method reads of the settings every method shares: a
    :class:`~corp_deploy.config.CompressConfig`, which names the methods (:data:`~corp_deploy.methods.METHODS`
    validates its method and options), so that they are told only what they read of it."""

    @property
    def s_mlp(self) -> float | None: ...

    @property
    def s_attn(self) -> float | None: ...

    @property
    def s_vo(self) -> float | None: ...

    @property
    def target(self) -> str: ...

    @property
    def round_to(self) -> int: ...

    @property
    def compensation(self) -> bool: ...

    @property
    def options(self) -> MethodOptions: ...

    @property
    def has_budget(self) -> bool: ...

    @property
    def parts(self) -> tuple[str, ...]: ...

    @property
    def pruned_parts(self) -> tuple[Part, ...]: ...

    @property
    def prunes_mlp(self) -> bool: ...

    @property
    def prunes_attn(self) -> bool: ...

    def sparsity_of(self, part: Part) -> float | None: ...

    def sparsity_setting(self, part: Part) -> str: ...


class Method(ABC):
    """One compression method. Subclasses set the class attributes and ``compress_blocks``.

    Attributes:
        name: the ``--method`` value.
        summary: one sentence for ``--help``.
        prunes: what the method can remove, in words (for messages).
        targets: the ``CompressConfig.target`` values it accepts; ``default_target`` its default.
        options_class: its :class:`MethodOptions` (``CompressConfig.options``); settings of one
            method given to another are refused, not ignored.
        has_compensation: whether there is a compensation step that ``compensation=False``
            switches off.
        per_layer_sparsity: whether a sparsity sets every layer's kept count (False: one global
            rate whose per-layer counts vary, as VBP's).
        runs_distributed: whether its statistics are summed over the processes of torch.distributed
            (``torchrun``); a method without is refused there.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    prunes: ClassVar[str]
    targets: ClassVar[tuple[str, ...]]
    default_target: ClassVar[str]
    options_class: ClassVar[type[MethodOptions]] = MethodOptions
    has_compensation: ClassVar[bool] = True
    per_layer_sparsity: ClassVar[bool] = True
    runs_distributed: ClassVar[bool] = False

    @abstractmethod
    def compress_blocks(self, model: nn.Module, run: BlockRun, config: CompressSettings) -> list[dict]:
        """Compress every block of ``model`` in place and return one report dict per block
        (with at least ``"dims"``, the block's :class:`~corp_deploy.layers.BlockDims` as a dict).
        Called inside ``torch.no_grad()`` with ``model`` on the calibration device."""

    def block_steps(self, model: nn.Module, config: CompressSettings) -> int:
        """How many times ``compress_blocks`` calls ``run.block_done`` (for the progress bar)."""
        return len(blocks_of(model))

    def report_tables(self, report: dict) -> list:
        """Rich tables of what this method added to the compress ``report`` (printed after the summary)."""
        return []

    def check_model(self, model: nn.Module, config: CompressSettings) -> None:
        """CorpError if ``model`` cannot be compressed this way (beyond the common structure checks)."""
