"""CORP's options: channel selection, ridge, calibration order, and the MAC budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import channels
from ...errors import SettingError, check_choice, check_setting_types
from ..base import CompressSettings, MethodOptions, option
from .refit import REFIT_LAYERS

RANKERS = channels.RANKERS
CALIBRATION_MODES = ("independent", "sequential")
DISTORTIONS = ("residual", "normed", "relative", "absolute")
#: Channel selection without a budget (the paper's ranking) and with one (measured:
#: lab/RESULTS.md, "Kept sets").
UNIFORM_RANKER, BUDGET_RANKER = "combined", "greedy"
#: The drift refit's layers with independent calibration (measured: lab/RESULTS.md, "The drift refit").
DEFAULT_REFIT = "proj+fc2"


@dataclass(frozen=True)
class CorpOptions(MethodOptions):
    """CORP's settings (docs/method.md §2-4, §8 for budgets).

    Attributes:
        macs: budget: keep at most this fraction of the dense model's MACs, in (0, 1].
        speedup: budget: MAC-ideal speedup, the same as ``macs = 1 / speedup``; >= 1.
        unit_floor: budget: every pruned unit (an MLP, a block's query/key or value dims)
            keeps at least this fraction of its dims.
        distortion: budget: how the errors of different units are made comparable
            (``residual``, the default: each unit's error in the residual stream relative to the
            stream's energy there; ``normed``: both weighted by the gain of the norm that next
            reads the stream; ``relative``: relative to the unit's error when fully pruned;
            ``absolute``: as it is); see docs/method.md §8 and lab/RESULTS.md.
        equal_head_dims: prune query/key and value dims to the same count in every head, so
            the exported attention has equal head dims (needs target ``all``).
        ranker: channel selection for MLP hidden and value channels: a score (``combined``,
            ``energy``, ``magnitude``, ``active``, ``variance``) or ``greedy`` (closed-form
            error reduction). ``None``: ``combined`` for sparsities, ``greedy`` for budgets.
        ridge: scale-free ridge strength alpha; the per-layer lambda is ``alpha`` times the
            layer's mean channel variance (MLP, values) or the mean diagonal of its query/key
            system over the full head dim: the same whichever dims are kept.
        calibration: ``independent`` (all statistics from the dense model, as in the paper; the
            default: as accurate as sequential in our measurements and cheaper, see
            lab/RESULTS.md) or ``sequential`` (block l calibrated on the outputs of the
            already compressed blocks < l).
        refit: which consumer layers the drift-correcting refit fits again from the compressed
            model's inputs to the dense model's outputs (docs/method.md §10): ``proj+fc2``,
            ``fc2`` or ``none``. Needs independent calibration and compensation. ``None``:
            ``proj+fc2``, or ``none`` with sequential calibration or without compensation (resolved
            by :meth:`check`, i.e. in each :class:`~corp_deploy.CompressConfig`).
        refit_shrink: the refit's ridge alpha, shrinking toward CORP's solution (lambda = alpha
            times the layer's mean input variance).
    """

    macs: float | None = option(
        None,
        "MAC budget, keep at most the fraction F of the dense MACs; every block's parts get the sizes "
        "that CORP's closed-form errors say hurt least. Excludes --s*.",
        value_type=float,
        metavar="F",
    )
    speedup: float | None = option(
        None, "MAC budget as a MAC-ideal speedup (the same as --macs 1/X).", value_type=float, metavar="X"
    )
    unit_floor: float = option(
        0.1, "with a budget, every MLP and every block's query/key or value dims keep at least this fraction."
    )
    distortion: str = "residual"  # library only (for studies): no command-line option
    equal_head_dims: bool = option(
        False,
        "as many value as query/key dims in every head (fused attention kernels "
        "need equal head dims); needs --target all.",
    )
    ranker: str | None = option(
        None,
        "MLP hidden and value channel selection.",
        value_type=str,
        choices=RANKERS,
        default_help=f"{UNIFORM_RANKER} with --s, {BUDGET_RANKER} with a budget",
    )
    ridge: float = option(1e-3, "scale-free ridge alpha (lambda = alpha times the layer's mean channel variance).")
    calibration: str = option(
        "independent",
        "statistics all from the dense model (independent, as in the paper) "
        "or from the partly compressed model (sequential).",
        choices=CALIBRATION_MODES,
    )
    refit: str | None = option(
        None,
        "consumer layers refitted from the compressed model's inputs to the dense "
        "model's outputs, correcting the error earlier blocks let through.",
        value_type=str,
        choices=tuple(REFIT_LAYERS),
        default_help=f"{DEFAULT_REFIT} (none with --calibration sequential or --no-compensation)",
    )
    refit_shrink: float = option(1.0, "the refit's ridge alpha, shrinking toward CORP's solution.")

    def __post_init__(self) -> None:
        check_setting_types(self)
        self._check_budget()
        if self.ranker is None:
            object.__setattr__(self, "ranker", BUDGET_RANKER if self.has_budget else UNIFORM_RANKER)
        check_choice("ranker", self.ranker, RANKERS)
        check_choice("calibration", self.calibration, CALIBRATION_MODES)
        check_choice("distortion", self.distortion, DISTORTIONS)
        if self.refit is not None:
            check_choice("refit", self.refit, tuple(REFIT_LAYERS))
        for name in ("ridge", "refit_shrink"):
            value = getattr(self, name)
            if not (value >= 0.0 and math.isfinite(value)):
                raise SettingError(f"{{setting}} must be a finite number >= 0, got {value!r}", name)
        if self.refit not in (None, "none") and self.calibration == "sequential":
            raise SettingError(
                "the drift refit ({setting}) compares the compressed model with the dense one, "
                "which {setting} sequential no longer keeps; add {setting} none",
                "refit",
                "calibration",
                "refit",
            )
        if not 0.0 <= self.unit_floor <= 1.0:
            raise SettingError(f"{{setting}} must be in [0, 1], got {self.unit_floor!r}", "unit_floor")
        if self.unit_floor != CorpOptions.unit_floor and not self.has_budget:
            raise SettingError(
                "{setting} is a floor on the sizes a MAC budget chooses; it applies only with {setting} or {setting}",
                "unit_floor",
                "macs",
                "speedup",
            )

    def _check_budget(self) -> None:
        if self.macs is not None and self.speedup is not None:
            raise SettingError("give the budget as {setting} or as {setting}, not both", "macs", "speedup")
        if self.macs is not None and not 0.0 < self.macs <= 1.0:
            raise SettingError(
                f"the MAC budget {{setting}} must be a fraction of the dense MACs in (0, 1], got {self.macs!r}", "macs"
            )
        if self.speedup is not None and not (self.speedup >= 1.0 and math.isfinite(self.speedup)):
            raise SettingError(
                f"the speedup budget {{setting}} must be a finite number >= 1, got {self.speedup!r}", "speedup"
            )

    @property
    def has_budget(self) -> bool:
        return self.macs is not None or self.speedup is not None

    @property
    def macs_fraction(self) -> float | None:
        """The budget as a fraction of the dense MACs (None without a budget)."""
        return self.macs if self.macs is not None else (1.0 / self.speedup if self.speedup else None)

    @property
    def default_target(self) -> str | None:
        return "all" if self.has_budget else None

    def check(self, config: CompressSettings) -> None:
        """Resolve the refit's default (none with sequential calibration or without compensation:
        it refits compensated layers against the dense model) and refuse what contradicts ``config``."""
        if self.refit is None:
            independent = self.calibration != "sequential" and config.compensation
            object.__setattr__(self, "refit", DEFAULT_REFIT if independent else "none")
        elif self.refit != "none" and not config.compensation:
            raise SettingError(
                "the drift refit ({setting}) is part of the compensation that {setting} switches off; "
                "add {setting} none",
                "refit",
                "compensation",
                "refit",
            )
        if self.refit == "none" and self.refit_shrink != CorpOptions.refit_shrink:
            raise SettingError(
                "{setting} is the drift refit's ridge; it does nothing without the refit ({setting} none, which "
                "is the default with {setting} sequential and without compensation)",
                "refit_shrink",
                "refit",
                "calibration",
            )
        if not self.equal_head_dims:
            return
        if config.target != "all":
            raise SettingError(
                f"{{setting}} ties value dims to query/key dims; it needs {{setting}} all (got {config.target})",
                "equal_head_dims",
                "target",
            )
        if not self.has_budget and config.s_attn != config.s_vo:
            raise SettingError(
                f"{{setting}} keeps as many value as query/key dims per head; {{setting}} "
                f"({config.s_attn}) and {{setting}} ({config.s_vo}) must then be equal",
                "equal_head_dims",
                "s_attn",
                "s_vo",
            )
