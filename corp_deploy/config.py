"""Compression settings, validated against the chosen method."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from . import channels
from .errors import CorpError, SettingError
from .methods import METHODS, option_owners

#: Which parts are pruned: CORP's MLP hidden channels (``mlp``), attention query/key dims
#: (``attn``; ToaSt prunes value dims with them) and value/output dims (``vo``).
TARGET_PARTS = {"mlp": ("mlp",), "attn": ("qk",), "vo": ("vo",), "both": ("mlp", "qk"),
                "mlp-vo": ("mlp", "vo"), "all": ("mlp", "qk", "vo")}
TARGETS = tuple(TARGET_PARTS)
RANKERS = channels.RANKERS
CALIBRATION_MODES = ("independent", "sequential")
DISTORTIONS = ("residual", "relative", "absolute")
#: The sparsity of every part when neither a sparsity nor a budget is given.
DEFAULT_SPARSITY = 0.5
#: Channel selection without a budget (the paper's ranking) and with one (measured:
#: benchmarks/RESULTS.md, "Kept sets").
UNIFORM_RANKER, BUDGET_RANKER = "combined", "greedy"


@dataclass(frozen=True)
class CompressConfig:
    """What to prune and how (docs/method.md §1-4, §5 for the peer methods, §8 for budgets).

    Either sparsities (the same fraction of every part in every block, the paper's setting)
    or a MAC budget (``macs`` or ``speedup``: CORP spends it where its closed-form errors say
    it hurts least). Settings that only one method reads (its ``Method.options``) must keep
    their defaults for the other methods: they are refused rather than silently ignored.

    Attributes:
        method: a name in :data:`corp_deploy.methods.METHODS`: ``corp`` (ranking plus
            closed-form ridge compensation, the default), ``vbp`` (variance-based MLP pruning,
            global ranking, mean folded into the fc2 bias) or ``toast`` (geometric-median
            coupled attention-head pruning and token channel selection for the FFN; no
            compensation step). All one-shot.
        s_mlp: fraction of MLP hidden channels removed in every block, in [0, 1).
        s_attn: fraction of query/key dims removed in every attention head (``toast``: of
            query/key and of value dims), in [0, 1).
        s_vo: fraction of value dims (with their output-projection columns) removed in every
            head, in [0, 1). Each sparsity defaults to 0.5 without a budget.
        target: which parts are pruned (:data:`TARGET_PARTS`); the other parts keep their
            dense weights whatever their sparsity says. ``None`` picks the method's default
            (``all`` for CORP with a budget).
        macs: budget: keep at most this fraction of the dense model's MACs, in (0, 1].
        speedup: budget: MAC-ideal speedup, the same as ``macs = 1 / speedup``; >= 1.
        unit_floor: budget: every pruned unit (an MLP, a block's query/key or value dims)
            keeps at least this fraction of its dims.
        distortion: budget: how the errors of different units are made comparable
            (``residual``, the default: each unit's error in the residual stream relative to the
            stream's energy there; ``relative``: relative to the unit's error when fully pruned;
            ``absolute``: as it is); see docs/method.md §8 and benchmarks/RESULTS.md.
        equal_head_dims: prune query/key and value dims to the same count in every head, so
            the exported attention has equal head dims (needs target ``all``).
        ranker: CORP's channel selection for MLP hidden and value channels: a score
            (``combined``, ``energy``, ``magnitude``, ``active``, ``variance``) or ``greedy``
            (closed-form error reduction). ``None``: ``combined`` for sparsities, ``greedy``
            for budgets.
        ridge: scale-free ridge strength alpha; the per-layer lambda is ``alpha`` times the
            layer's mean channel variance (MLP, values) or the mean diagonal of its query/key
            system over the full head dim: the same whichever dims are kept.
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

    s_mlp: float | None = None
    s_attn: float | None = None
    s_vo: float | None = None
    target: str | None = None
    macs: float | None = None
    speedup: float | None = None
    unit_floor: float = 0.1
    distortion: str = "residual"
    equal_head_dims: bool = False
    ranker: str | None = None
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
        self._check_method_combination()  # before defaults are filled in below
        self._check_budget()
        if self.target is None:
            default = "all" if self.has_budget else METHODS[self.method].default_target
            object.__setattr__(self, "target", default)
        _check_choice("target", self.target, TARGETS)
        self._check_target()
        for name in ("s_mlp", "s_attn", "s_vo"):
            value = getattr(self, name)
            if value is None and not self.has_budget:
                object.__setattr__(self, name, DEFAULT_SPARSITY)
            elif value is not None and not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise SettingError(f"{{setting}} must be in [0, 1), got {value!r}", name)
        if self.ranker is None and "ranker" in METHODS[self.method].options:
            object.__setattr__(self, "ranker", BUDGET_RANKER if self.has_budget else UNIFORM_RANKER)
        if self.ranker is not None:
            _check_choice("ranker", self.ranker, RANKERS)
        _check_choice("calibration", self.calibration, CALIBRATION_MODES)
        _check_choice("distortion", self.distortion, DISTORTIONS)
        if not (self.ridge >= 0.0 and math.isfinite(self.ridge)):
            raise SettingError(f"{{setting}} must be a finite number >= 0, got {self.ridge!r}", "ridge")
        if not (isinstance(self.round_to, int) and self.round_to >= 1):
            raise SettingError(f"{{setting}} must be an integer >= 1, got {self.round_to!r}", "round_to")
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise SettingError(f"{{setting}} must be 'cpu' or 'cuda', got {self.device!r}", "device")
        for name in ("layer_floor", "unit_floor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SettingError(f"{{setting}} must be in [0, 1], got {getattr(self, name)!r}", name)
        if not 0.0 < self.token_fraction <= 1.0:
            raise SettingError(f"{{setting}} must be in (0, 1], got {self.token_fraction!r}", "token_fraction")
        if self.equal_head_dims and not self.has_budget and self.s_attn != self.s_vo:
            raise SettingError(f"{{setting}} keeps as many value as query/key dims per head; {{setting}} ({self.s_attn}) and "
                               f"{{setting}} ({self.s_vo}) must then be equal", "equal_head_dims", "s_attn", "s_vo")

    def _check_budget(self) -> None:
        if self.macs is not None and self.speedup is not None:
            raise SettingError("give the budget as {setting} or as {setting}, not both", "macs", "speedup")
        if self.macs is not None and not (isinstance(self.macs, (int, float)) and 0.0 < self.macs <= 1.0):
            raise SettingError(f"the MAC budget {{setting}} must be a fraction of the dense MACs in (0, 1], got {self.macs!r}",
                               "macs")
        if self.speedup is not None and not (isinstance(self.speedup, (int, float)) and self.speedup >= 1.0
                                             and math.isfinite(self.speedup)):
            raise SettingError(f"the speedup budget {{setting}} must be a finite number >= 1, got {self.speedup!r}",
                               "speedup")
        given = [name for name in ("s_mlp", "s_attn", "s_vo") if getattr(self, name) is not None]
        if self.has_budget and given:
            raise SettingError(f"a MAC budget and sparsities ({', '.join('{setting}' for _ in given)}) exclude each other: "
                               "the budget decides every part's size", *given)

    def _check_target(self) -> None:
        method = METHODS[self.method]
        if self.target not in method.targets:
            others = [m.name for m in METHODS.values() if self.target in m.targets]
            raise CorpError(f"method {self.method} prunes {method.prunes} only; target {self.target} is not "
                            f"part of it. Use target {'/'.join(method.targets)}"
                            + (f", or method {'/'.join(others)}." if others else "."))
        if self.equal_head_dims and self.target != "all":
            raise SettingError(f"{{setting}} ties value dims to query/key dims; it needs {{setting}} all (got {self.target})",
                               "equal_head_dims", "target")

    @property
    def has_budget(self) -> bool:
        return self.macs is not None or self.speedup is not None

    @property
    def macs_fraction(self) -> float | None:
        """The budget as a fraction of the dense MACs (None without a budget)."""
        return self.macs if self.macs is not None else (1.0 / self.speedup if self.speedup else None)

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts pruned: ``mlp``, ``qk``, ``vo`` (see :data:`TARGET_PARTS`)."""
        return TARGET_PARTS[self.target]

    def _check_method_combination(self) -> None:
        method = METHODS[self.method]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for option, owner in option_owners().items():
            if owner != self.method and getattr(self, option) != defaults[option]:
                raise SettingError(f"{{setting}} applies to method {owner} only, not {self.method} "
                                   f"(got {getattr(self, option)!r})", option)
        if not self.compensation and not method.has_compensation:
            others = [m.name for m in METHODS.values() if m.has_compensation]
            raise CorpError(f"method {self.method} has no compensation step to switch off; "
                            f"--no-compensation applies to {' and '.join(others)}")

    @property
    def prunes_mlp(self) -> bool:
        return "mlp" in self.parts

    @property
    def prunes_attn(self) -> bool:
        """Query/key dims (``toast``: query/key and value dims) are pruned."""
        return "qk" in self.parts

    @property
    def prunes_vo(self) -> bool:
        return "vo" in self.parts

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingError(f"{{setting}} must be one of {', '.join(choices)}; got {value!r}", name)
