"""Compression settings, validated against the chosen method."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import CorpError
from .methods import METHODS, option_owners

TARGETS = ("mlp", "attn", "both")
RANKERS = ("combined", "energy", "magnitude", "active", "variance")
CALIBRATION_MODES = ("independent", "sequential")


@dataclass(frozen=True)
class CompressConfig:
    """What to prune and how (docs/method.md §1-3, and §5 for the peer methods).

    Settings that only one method reads (its ``Method.options``) must keep their defaults
    for the other methods: they are refused rather than silently ignored.

    Attributes:
        method: a name in :data:`corp_deploy.methods.METHODS`: ``corp`` (ranking plus
            closed-form ridge compensation, the default), ``vbp`` (variance-based MLP pruning,
            global ranking, mean folded into the fc2 bias) or ``toast`` (geometric-median
            coupled attention-head pruning and token channel selection for the FFN; no
            compensation step). All one-shot.
        s_mlp: fraction of MLP hidden channels removed in every block, in [0, 1).
        s_attn: fraction of query/key dims removed in every attention head, in [0, 1).
        s_attn: for ``toast``, the fraction of query/key and of value dims removed per head.
        target: which parts are pruned: ``mlp``, ``attn`` or ``both``; the other part
            keeps its dense weights whatever its sparsity says. ``None`` picks the
            method's default (``mlp`` for vbp, which prunes nothing else; ``both`` otherwise).
        ranker: CORP's MLP channel ranking (``combined``, ``energy``, ``magnitude``,
            ``active``, ``variance``).
        ridge: scale-free ridge strength alpha; the per-layer lambda is
            ``alpha * tr(Sigma_SS) / |S|`` (MLP) and ``alpha * tr(K) / d'^2``
            (attention system matrix ``K``).
        calibration: ``independent`` (all statistics from the dense model, as in the
            paper; the default: as accurate as sequential in our measurements and
            cheaper, see benchmarks/RESULTS.md) or ``sequential`` (block l calibrated on
            the outputs of the already compressed blocks < l).
        round_to: kept dims are rounded to a multiple of this (hardware alignment).
        compensation: fold the method's compensation in (CORP's closed-form step, VBP's
            mean fold); False keeps the same channels and slices the weights (ablation).
            ToaSt has no compensation step, so it must stay True there.
        device: ``cpu`` or ``cuda``; where calibration runs.
        layer_floor: ``vbp``: every MLP keeps at least this fraction of its channels
            (the global variance ranking would otherwise empty low-variance layers).
        token_fraction: ``toast``: fraction of each image's patch tokens sampled for the
            FFN channel importance (ToaSt uses 2-20%).
    """

    s_mlp: float = 0.5
    s_attn: float = 0.5
    target: str | None = None
    ranker: str = "combined"
    ridge: float = 1e-3
    calibration: str = "independent"
    round_to: int = 1
    compensation: bool = True
    device: str = "cpu"
    method: str = "corp"
    layer_floor: float = 0.1
    token_fraction: float = 0.1

    def __post_init__(self) -> None:
        _check_choice("method", self.method, tuple(METHODS))
        if self.target is None:
            object.__setattr__(self, "target", METHODS[self.method].default_target)
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
        if not 0.0 <= self.layer_floor <= 1.0:
            raise CorpError(f"layer_floor must be in [0, 1], got {self.layer_floor!r}")
        if not 0.0 < self.token_fraction <= 1.0:
            raise CorpError(f"token_fraction must be in (0, 1], got {self.token_fraction!r}")
        self._check_method_combination()

    def _check_method_combination(self) -> None:
        method = METHODS[self.method]
        if self.target not in method.targets:
            others = [m.name for m in METHODS.values() if self.target in m.targets]
            raise CorpError(f"method {self.method} prunes {method.prunes} only; target {self.target} is not "
                            f"part of it. Use target {'/'.join(method.targets)}, or method {'/'.join(others)}.")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for option, owner in option_owners().items():
            if owner != self.method and getattr(self, option) != defaults[option]:
                raise CorpError(f"{option} applies to method {owner} only, not {self.method} "
                                f"(got {option}={getattr(self, option)!r})")
        if not self.compensation and not method.has_compensation:
            others = [m.name for m in METHODS.values() if m.has_compensation]
            raise CorpError(f"method {self.method} has no compensation step to switch off; "
                            f"--no-compensation applies to {' and '.join(others)}")

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
