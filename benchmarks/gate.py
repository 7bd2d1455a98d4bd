"""The regression gate: a bench report against limits and, optionally, a baseline report.

A gate never passes on what was not measured: a limit or a baseline number whose measurement
is missing from the report (its backend was skipped, the model has no classifier, nothing ran)
is a failure in its own right, and a measured NaN fails every limit on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from corp_deploy import CorpError

from .harness import FORMAT

#: The int8 graph a baseline's int8 numbers are compared on (:mod:`benchmarks.int8`).
INT8_GRAPH = "compressed-int8"

#: The absolute fidelity limits: option, key in the report's ``fidelity``, label, number format, bound side.
_FIDELITY_LIMITS = (
    ("min_agreement", "top1_agreement", "top-1 agreement", ".4f", "min"),
    ("max_kl", "kl_mean", "mean KL", ".4g", "max"),
    ("min_cosine", "feature_cosine", "feature cosine", ".4f", "min"),
)


@dataclass(frozen=True)
class GateLimits:
    """What may not get worse.

    ``max_regression``: against a baseline, the compressed model's median latency may grow and
    its measured speedup (and, for classifiers, its top-1 agreement and accuracy) may shrink by
    at most this fraction. Absolute limits (None: not checked): ``min_agreement`` (top-1
    agreement with the dense model), ``max_kl`` (mean KL divergence), ``min_cosine`` (mean
    feature cosine), ``min_parity_cosine`` (worst per-image cosine of any backend vs PyTorch).
    Every fidelity limit that is set must have been measured. The parity limit has a default that
    applies wherever parity was measured; ``parity_requested`` says the user asked for it, and then
    it must have been measured too.
    """

    max_regression: float = 0.05
    min_agreement: float | None = None
    max_kl: float | None = None
    min_cosine: float | None = None
    min_parity_cosine: float | None = 0.999
    parity_requested: bool = False

    def __post_init__(self) -> None:
        ranges = {
            "max_regression": (0.0, 1.0),
            "min_agreement": (0.0, 1.0),
            "max_kl": (0.0, math.inf),
            "min_cosine": (-1.0, 1.0),
            "min_parity_cosine": (-1.0, 1.0),
        }
        for name, (low, high) in ranges.items():
            value = getattr(self, name)
            if value is None:
                continue
            closed_top = name != "max_regression"
            if not (
                isinstance(value, (int, float))
                and math.isfinite(value)
                and low <= value
                and (value <= high if closed_top else value < high)
            ):
                allowed = f"in [{low:g}, {high:g}{']' if closed_top else ')'}" if math.isfinite(high) else f">= {low:g}"
                raise CorpError(f"--{name.replace('_', '-')} must be a finite number {allowed}; got {value}")

    @property
    def requested(self) -> bool:
        """Whether any limit was asked for (then a run that timed nothing fails)."""
        return self.parity_requested or any(getattr(self, option) is not None for option, *_ in _FIDELITY_LIMITS)

    def to_dict(self) -> dict:
        return asdict(self)


def read_report(path: str | Path) -> dict:
    """A bench JSON report (a baseline), validated: every number the gate reads is there and usable."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpError(f"baseline {path} not found") from None
    except IsADirectoryError:
        raise CorpError(f"baseline {path} is a directory, not a bench JSON report") from None
    except (OSError, ValueError) as exc:
        raise CorpError(f"cannot read baseline {path}: {exc}") from None
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise CorpError(f"{path} is not a corp-deploy bench report")
    problem = _baseline_problem(report)
    if problem is not None:
        raise CorpError(f"baseline {path} is malformed: {problem}")
    return report


def _baseline_problem(report: dict) -> str | None:
    rows, fidelity = report.get("latency"), report.get("fidelity")
    if not isinstance(rows, list) or not isinstance(fidelity, dict):
        return "it needs a 'latency' list and a 'fidelity' object"
    if not rows:
        return "it timed nothing (no latency rows), so there is nothing to compare against"
    if (report.get("gate") or {}).get("passed") is False:
        return "its own regression gate failed; a baseline must be a run that passed"
    for i, row in enumerate(rows):
        try:
            numbers = (row["compressed"]["p50_s"], row["speedup"]["median"])
            ok = isinstance(row["backend"], str) and isinstance(row["batch"], int)
        except (KeyError, TypeError):
            return f"latency row {i} lacks backend, batch, compressed.p50_s or speedup.median"
        if not ok or not all(_positive(v) for v in numbers):
            return f"latency row {i} needs a backend name, a batch size and positive finite times and speedup"
    for key in ("top1_agreement", "feature_cosine"):
        if fidelity.get(key) is not None and not _finite(fidelity[key]):
            return f"fidelity.{key} is not a number"
    accuracy = fidelity.get("accuracy")
    if accuracy is not None and not (
        isinstance(accuracy, dict)
        and all(isinstance(accuracy.get(m), dict) and _finite(accuracy[m].get("top1")) for m in accuracy)
    ):
        return "fidelity.accuracy needs a numeric top1 per model"
    int8 = report.get("int8")
    if int8 is not None and "skipped" not in int8:
        try:
            usable = all(
                isinstance(row["batch"], int) and _positive(_int8_speedup(row)) for row in int8["latency"]
            ) and _finite(int8["fidelity"][INT8_GRAPH]["cosine_mean"])
        except (KeyError, TypeError):
            usable = False
        if not usable:
            return f"int8 needs latency rows with a batch and the {INT8_GRAPH} speedup, and its fidelity's cosine_mean"
    return None


def regressions(report: dict, limits: GateLimits, baseline: dict | None = None) -> list[str]:
    """Every way ``report`` breaks ``limits``, regresses against ``baseline``, or leaves something the
    gate was asked to check unmeasured, in words."""
    found = _absolute(report, limits)
    if baseline is not None:
        found += _against_baseline(report, baseline, limits.max_regression)
        found += _int8_against_baseline(report.get("int8"), baseline.get("int8"), limits.max_regression)
    if (baseline is not None or limits.requested) and not report["latency"]:
        skipped = "; ".join(
            f"{name}: {v['reason']}" for name, v in report["backends"].items() if v["status"] == "skipped"
        )
        found.append(f"nothing was timed: every requested backend was skipped ({skipped or 'none requested'})")
    return found


def _absolute(report: dict, limits: GateLimits) -> list[str]:
    found = []
    fid = report["fidelity"]
    for option, key, label, spec, side in _FIDELITY_LIMITS:
        limit, value = getattr(limits, option), fid.get(key)
        if limit is None:
            continue
        if value is None:
            found.append(
                f"fidelity: --{option.replace('_', '-')} was given but {label} was not measured "
                "(the model has no classifier)"
            )
            continue
        if not (value >= limit if side == "min" else value <= limit):
            found.append(f"fidelity: {label} {value:{spec}} {'<' if side == 'min' else '>'} {limit}")
    if limits.min_parity_cosine is not None:
        measured = [
            (model, backend, numbers)
            for model, backends in report["parity"].items()
            for backend, numbers in backends.items()
        ]
        if not measured and limits.parity_requested:
            found.append("parity: --min-parity-cosine was given but no backend other than torch-cpu ran")
        for model, backend, numbers in measured:
            if not numbers["cosine"] >= limits.min_parity_cosine:
                found.append(
                    f"parity: {model} on {backend} vs torch-cpu: cosine {numbers['cosine']:.6f} "
                    f"< {limits.min_parity_cosine}"
                )
    return found


def _against_baseline(report: dict, baseline: dict, tolerance: float) -> list[str]:
    found = []
    measured = {(row["backend"], row["batch"]): row for row in report["latency"]}
    for old in baseline["latency"]:
        where = f"{old['backend']}, batch {old['batch']}"
        row = measured.get((old["backend"], old["batch"]))
        if row is None:
            reason = report["backends"].get(old["backend"], {}).get("reason", "not requested in this run")
            found.append(f"latency: {where} is in the baseline but was not measured ({reason})")
            continue
        new_t, old_t = row["compressed"]["p50_s"], old["compressed"]["p50_s"]
        if not new_t <= old_t * (1 + tolerance):
            found.append(
                f"latency: {where}: compressed p50 {new_t * 1e3:.2f} ms vs baseline {old_t * 1e3:.2f} ms "
                f"(+{(new_t / old_t - 1) * 100:.1f}% > {tolerance * 100:g}%)"
            )
        new_s, old_s = row["speedup"]["median"], old["speedup"]["median"]
        if not new_s >= old_s * (1 - tolerance):
            found.append(
                f"speedup: {where}: {new_s:.3f}x vs baseline {old_s:.3f}x "
                f"(-{(1 - new_s / old_s) * 100:.1f}% > {tolerance * 100:g}%)"
            )
    new_f, old_f = report["fidelity"], baseline["fidelity"]
    for key, label in (("top1_agreement", "top-1 agreement"), ("feature_cosine", "feature cosine")):
        if old_f.get(key) is None:
            continue
        if new_f.get(key) is None:
            found.append(f"fidelity: {label} is in the baseline but was not measured")
        elif not new_f[key] >= old_f[key] * (1 - tolerance):
            found.append(f"fidelity: {label} {new_f[key]:.4f} vs baseline {old_f[key]:.4f}")
    for model, old in (old_f.get("accuracy") or {}).items():
        new = ((new_f.get("accuracy") or {}).get(model) or {}).get("top1")
        if new is None:
            found.append(f"accuracy: {model} top-1 is in the baseline but was not measured (no labelled --data)")
        elif not new >= old["top1"] * (1 - tolerance):
            found.append(f"accuracy: {model} top-1 {new:.4f} vs baseline {old['top1']:.4f}")
    return found


def _int8_against_baseline(new: dict | None, old: dict | None, tolerance: float) -> list[str]:
    """The compressed int8 graph's speedup over dense fp32 (per batch) and its cosine to dense fp32
    may not shrink by more than ``tolerance``; a baseline's int8 numbers must be measured again."""
    if old is None or "skipped" in old:
        return []
    if new is None or "skipped" in new:
        why = new["skipped"] if new else "no export-int8/ beside export-fp32/, or ort not among the backends"
        return [f"int8: in the baseline but not measured ({why})"]
    found = []
    rows = {row["batch"]: row for row in new["latency"]}
    for old_row in old["latency"]:
        row = rows.get(old_row["batch"])
        if row is None:
            found.append(f"int8: batch {old_row['batch']} is in the baseline but was not measured")
        elif not _int8_speedup(row) >= _int8_speedup(old_row) * (1 - tolerance):
            found.append(
                f"int8: batch {row['batch']}: {INT8_GRAPH} {_int8_speedup(row):.3f}x over dense fp32 vs "
                f"baseline {_int8_speedup(old_row):.3f}x"
            )
    new_cos, old_cos = new["fidelity"][INT8_GRAPH]["cosine_mean"], old["fidelity"][INT8_GRAPH]["cosine_mean"]
    if not new_cos >= old_cos * (1 - tolerance):
        found.append(f"int8: {INT8_GRAPH} cosine to dense fp32 {new_cos:.4f} vs baseline {old_cos:.4f}")
    return found


def _int8_speedup(row: dict) -> float:
    return row["speedup_over_dense_fp32"][INT8_GRAPH]["median"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _finite(value) and value > 0
