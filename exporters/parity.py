"""Numerical parity between two backends' outputs: the comparator, its typed results and the
pass/fail gate.

Runners (:mod:`exporters.runners`) produce outputs; :func:`compare_outputs` turns two outputs
into a :class:`Comparison` (metrics from :mod:`corp_deploy.metrics`); :class:`Tolerance` decides
whether it passes; a :class:`ParityCheck` is one backend checked against a reference at each
batch size, as ``export.json`` records it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from corp_deploy.errors import CorpError, SettingError, check_setting_types
from corp_deploy.metrics import as_rows, cosine, top1_matches


@dataclass(frozen=True)
class Comparison:
    """Two ``(batch, features)`` outputs compared row by row (:func:`compare_outputs`).

    ``max_abs``; ``max_rel`` (``|a - b| / max(|a|, 1e-6 * max|a|)``); ``cosine``, the smallest
    per-row cosine; ``top1_agreement``, the fraction of rows whose argmax agree (None when not
    measured, e.g. for feature outputs without a classifier).
    """

    max_abs: float
    max_rel: float
    cosine: float
    top1_agreement: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def compare_outputs(reference: np.ndarray, candidate: np.ndarray, *, top1: bool = True) -> Comparison:
    """Compare two ``(batch, features)`` outputs row by row, in float64 (:class:`Comparison`);
    ``top1`` False leaves the top-1 agreement unmeasured."""
    ref, cand = as_rows(reference), as_rows(candidate)
    if ref.shape != cand.shape:
        raise CorpError(
            f"the outputs to compare differ in shape ({ref.shape} against {cand.shape}): these are not two "
            "forms of one model (an export's dense graph made from another dense model?)"
        )
    diff = np.abs(ref - cand)
    floor = max(1e-6 * float(np.abs(ref).max(initial=0.0)), 1e-12)
    return Comparison(
        max_abs=float(diff.max(initial=0.0)),
        max_rel=float((diff / np.maximum(np.abs(ref), floor)).max(initial=0.0)),
        cosine=float(cosine(ref, cand).min(initial=1.0)),
        top1_agreement=float(np.mean(top1_matches(ref, cand))) if top1 else None,
    )


@dataclass(frozen=True)
class ParityCheck:
    """``file`` run on ``backend`` checked against ``reference`` (backend names as in
    :attr:`exporters.runners.Runner.name`): a :class:`Comparison` per batch size, or ``skipped``,
    why the check could not run here."""

    file: str
    backend: str
    reference: str
    batches: dict[int, Comparison] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def key(self) -> str:
        """The check's key in ``export.json`` (``onnxruntime_vs_pytorch``)."""
        return f"{self.backend}_vs_{self.reference}"

    def worst(self) -> Comparison:
        """The worst of every batch's numbers (top-1 agreement: None when never measured); not for
        a skipped check."""
        results = list(self.batches.values())
        top1 = [r.top1_agreement for r in results if r.top1_agreement is not None]
        return Comparison(
            max_abs=max(r.max_abs for r in results),
            max_rel=max(r.max_rel for r in results),
            cosine=min(r.cosine for r in results),
            top1_agreement=min(top1) if top1 else None,
        )

    def to_dict(self) -> dict:
        """``{"batch_<b>": numbers}``, or ``{"skipped": reason}``: the check as ``export.json`` has it."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {f"batch_{b}": result.to_dict() for b, result in self.batches.items()}


@dataclass(frozen=True)
class Tolerance:
    """Limits a comparison must meet; a limit that is None is not checked.

    ``atol`` bounds ``max_abs``; ``min_cosine`` bounds the worst row's cosine;
    ``min_top1`` bounds the top-1 agreement (checked only where it was measured).
    """

    atol: float | None = None
    min_cosine: float | None = None
    min_top1: float | None = None

    def __post_init__(self) -> None:
        check_setting_types(self)
        if self.atol is not None and not (self.atol >= 0 and math.isfinite(self.atol)):
            raise SettingError(f"{{setting}} must be a finite number >= 0; got {self.atol}", "atol")
        if self.min_cosine is not None and not -1 <= self.min_cosine <= 1:
            raise SettingError(f"{{setting}} must be in [-1, 1]; got {self.min_cosine}", "min_cosine")
        if self.min_top1 is not None and not 0 <= self.min_top1 <= 1:
            raise SettingError(f"{{setting}} (top-1 agreement) must be in [0, 1]; got {self.min_top1}", "min_top1")

    def with_limits(self, **overrides: float | None) -> Tolerance:
        """These limits with each non-None value of ``overrides`` (``atol=...``) in place of its own."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def violations(self, result: Comparison) -> list[str]:
        """What ``result`` fails, in words; empty when it passes."""
        failed = []
        if self.atol is not None and not result.max_abs <= self.atol:
            failed.append(f"max abs error {result.max_abs:.3g} > atol {self.atol:g}")
        shown = self._shown_below(result)
        if "cosine" in shown:
            failed.append(f"cosine {shown['cosine']} < {exact(self.min_cosine)}")
        if "top1_agreement" in shown:
            failed.append(f"top-1 agreement {shown['top1_agreement']} < {exact(self.min_top1)}")
        return failed

    def measured(self, result: Comparison) -> str:
        """``result``'s numbers as ``name=value``: 3 significant digits, a cosine or top-1 agreement
        below its limit with the digits that show it is, and one below 1 never written ``1``."""
        shown = {k: f"{v:.3g}" for k, v in result.to_dict().items() if v is not None}
        for key in ("cosine", "top1_agreement"):
            value = getattr(result, key)
            if value is not None and value < 1 and shown[key] == "1":
                shown[key] = below(value, 1.0)
        return ", ".join(f"{k}={v}" for k, v in (shown | self._shown_below(result)).items())

    def _shown_below(self, result: Comparison) -> dict[str, str]:
        """``{"cosine" | "top1_agreement": value in words}`` for each of the two below its limit."""
        shown = {}
        if self.min_cosine is not None and not result.cosine >= self.min_cosine:
            shown["cosine"] = below(result.cosine, self.min_cosine)
        top1 = result.top1_agreement
        if self.min_top1 is not None and top1 is not None and not top1 >= self.min_top1:
            shown["top1_agreement"] = below(top1, self.min_top1)
        return shown

    def to_dict(self) -> dict:
        return asdict(self)


def exact(limit: float) -> str:
    """``limit`` as given: ``0.99999``, ``1``, and ``0.99999999999999`` rather than ``1``."""
    short = f"{limit:g}"
    return short if float(short) == limit else repr(limit)


def below(value: float, limit: float) -> str:
    """``value`` written with as many digits as it takes to show it below ``limit`` (at least 6
    decimals, at most 17 significant digits): never ``1.000000 < 1``."""
    for digits in range(6, 17):
        text = f"{value:.{digits}f}"
        if float(text) < limit:
            return text
    return repr(value)
