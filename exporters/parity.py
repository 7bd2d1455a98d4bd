"""Numerical parity between two backends' outputs: the comparator and the pass/fail gate.

Runners (``exporters.runners``, ``exporters.tensorrt``) produce outputs; :func:`compare_outputs`
turns two outputs into numbers; :class:`Tolerance` decides whether those numbers pass.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from corp_deploy import CorpError


def compare_outputs(reference: np.ndarray, candidate: np.ndarray, *, top1: bool = True) -> dict:
    """Compare two ``(batch, features)`` outputs row by row.

    Returns ``max_abs``, ``max_rel`` (``|a - b| / max(|a|, 1e-6 * max|a|)``), ``cosine``
    (the smallest per-row cosine) and ``top1_agreement`` (fraction of rows whose argmax
    agree; None when ``top1`` is False, e.g. for feature outputs without a classifier).
    """
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    cand = np.asarray(candidate, dtype=np.float64).reshape(len(candidate), -1)
    if ref.shape != cand.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {cand.shape}")
    diff = np.abs(ref - cand)
    floor = max(1e-6 * float(np.abs(ref).max(initial=0.0)), 1e-12)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    cosine = np.sum(ref * cand, axis=1) / np.maximum(norms, 1e-30)
    return {"max_abs": float(diff.max(initial=0.0)),
            "max_rel": float((diff / np.maximum(np.abs(ref), floor)).max(initial=0.0)),
            "cosine": float(cosine.min(initial=1.0)),
            "top1_agreement": float(np.mean(ref.argmax(1) == cand.argmax(1))) if top1 else None}


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
        if self.atol is not None and not (self.atol >= 0 and math.isfinite(self.atol)):
            raise CorpError(f"--atol must be a finite number >= 0; got {self.atol}")
        if self.min_cosine is not None and not -1 <= self.min_cosine <= 1:
            raise CorpError(f"--min-cosine must be in [-1, 1]; got {self.min_cosine}")
        if self.min_top1 is not None and not 0 <= self.min_top1 <= 1:
            raise CorpError(f"the minimum top-1 agreement must be in [0, 1]; got {self.min_top1}")

    @classmethod
    def for_precision(cls, precision: str, **overrides: float | None) -> "Tolerance":
        """The default limits for ``precision`` with the given non-None ``overrides``."""
        return replace(DEFAULT_TOLERANCES[precision], **{k: v for k, v in overrides.items() if v is not None})

    def violations(self, result: dict) -> list[str]:
        """What ``result`` (from :func:`compare_outputs`) fails, in words; empty when it passes."""
        failed = []
        if self.atol is not None and not result["max_abs"] <= self.atol:
            failed.append(f"max abs error {result['max_abs']:.3g} > atol {self.atol:g}")
        if self.min_cosine is not None and not result["cosine"] >= self.min_cosine:
            failed.append(f"cosine {result['cosine']:.6f} < {self.min_cosine:g}")
        top1 = result.get("top1_agreement")
        if self.min_top1 is not None and top1 is not None and not top1 >= self.min_top1:
            failed.append(f"top-1 agreement {top1:.3f} < {self.min_top1:g}")
        return failed

    def to_dict(self) -> dict:
        return asdict(self)


#: fp32 must match to float32 round-off. Reduced precision changes every intermediate
#: result, so it is judged by direction (cosine) and decisions (top-1), not by 1e-5. int8
#: rounds every Linear input to 255 levels: looser again (README, "INT8").
DEFAULT_TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, min_cosine=0.99999),
    "fp16": Tolerance(min_cosine=0.999, min_top1=0.85),
    "bf16": Tolerance(min_cosine=0.99, min_top1=0.85),
    "int8": Tolerance(min_cosine=0.98, min_top1=0.75),
}
