"""Compression settings and the arithmetic of kept dimensions."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import CorpError

TARGETS = ("mlp", "attn", "both")
RANKERS = ("combined", "energy", "magnitude", "active", "variance")
CALIBRATION_MODES = ("independent", "sequential")


@dataclass(frozen=True)
class CompressConfig:
    """What to prune and how (METHOD.md sections 1-3).

    Attributes:
        s_mlp: fraction of MLP hidden channels removed in every block, in [0, 1).
        s_attn: fraction of query/key dims removed in every attention head, in [0, 1).
        target: which parts are pruned: ``mlp``, ``attn`` or ``both``; the other part
            keeps its dense weights whatever its sparsity says.
        ranker: MLP channel ranking (``combined``, ``energy``, ``magnitude``,
            ``active``, ``variance``).
        ridge: scale-free ridge strength alpha; the per-layer lambda is
            ``alpha * tr(Sigma_SS) / |S|`` (MLP) and ``alpha * tr(K) / d'^2``
            (attention system matrix ``K``).
        calibration: ``independent`` (all statistics from the dense model, as in the
            paper; the default: as accurate as sequential in our measurements and
            cheaper, see benchmarks/RESULTS.md) or ``sequential`` (block l calibrated on
            the outputs of the already compressed blocks < l).
        round_to: kept dims are rounded to a multiple of this (hardware alignment).
        compensation: fold the closed-form compensation in; False keeps the same
            channels and slices the weights (ablation).
        device: ``cpu`` or ``cuda``; where calibration runs.
    """

    s_mlp: float = 0.5
    s_attn: float = 0.5
    target: str = "both"
    ranker: str = "combined"
    ridge: float = 1e-3
    calibration: str = "independent"
    round_to: int = 1
    compensation: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("s_mlp", "s_attn"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise CorpError(f"{name} must be in [0, 1), got {value!r}")
        _check_choice("target", self.target, TARGETS)
        _check_choice("ranker", self.ranker, RANKERS)
        _check_choice("calibration", self.calibration, CALIBRATION_MODES)
        if not (self.ridge >= 0.0 and math.isfinite(self.ridge)):
            raise CorpError(f"ridge must be a finite number >= 0, got {self.ridge!r}")
        if not (isinstance(self.round_to, int) and self.round_to >= 1):
            raise CorpError(f"round_to must be an integer >= 1, got {self.round_to!r}")
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise CorpError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def prunes_mlp(self) -> bool:
        return self.target in ("mlp", "both")

    @property
    def prunes_attn(self) -> bool:
        return self.target in ("attn", "both")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise CorpError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def kept_count(total: int, sparsity: float, round_to: int = 1) -> int:
    """Number of dims kept out of ``total`` at ``sparsity``.

    ``total - round(sparsity * total)`` (halves round up), then rounded to the nearest
    multiple of ``round_to`` (at least ``round_to``, at most ``total``).
    """
    kept = total - math.floor(sparsity * total + 0.5)
    if round_to > 1:
        kept = round_to * math.floor(kept / round_to + 0.5)
        kept = max(round_to, kept)
    return max(1, min(total, kept))
