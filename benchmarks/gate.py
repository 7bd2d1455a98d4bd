"""The regression gate: a bench report against limits and, optionally, a baseline report."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from corp_deploy import CorpError

from .harness import FORMAT


@dataclass(frozen=True)
class GateLimits:
    """What may not get worse.

    ``max_regression``: against a baseline, the compressed model's median latency may grow and
    its measured speedup (and, for classifiers, its top-1 agreement and accuracy) may shrink by
    at most this fraction. Absolute limits (None: not checked): ``min_agreement`` (top-1
    agreement with the dense model), ``max_kl`` (mean KL divergence), ``min_cosine`` (mean
    feature cosine), ``min_parity_cosine`` (worst per-image cosine of any backend vs PyTorch).
    """

    max_regression: float = 0.05
    min_agreement: float | None = None
    max_kl: float | None = None
    min_cosine: float | None = None
    min_parity_cosine: float | None = 0.999

    def __post_init__(self) -> None:
        if not 0 <= self.max_regression < 1:
            raise CorpError(f"--max-regression must be in [0, 1); got {self.max_regression}")

    def to_dict(self) -> dict:
        return asdict(self)


def read_report(path: str | Path) -> dict:
    """A bench JSON report, validated."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CorpError(f"baseline {path} not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpError(f"cannot read baseline {path}: {exc}") from None
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise CorpError(f"{path} is not a corp-deploy bench report")
    return report


def regressions(report: dict, limits: GateLimits, baseline: dict | None = None) -> list[str]:
    """Every way ``report`` breaks ``limits`` or regresses against ``baseline``, in words."""
    found = _absolute(report, limits)
    if baseline is not None:
        found += _against_baseline(report, baseline, limits.max_regression)
    return found


def _absolute(report: dict, limits: GateLimits) -> list[str]:
    found = []
    fid = report["fidelity"]
    if limits.min_agreement is not None and fid["top1_agreement"] is not None \
            and fid["top1_agreement"] < limits.min_agreement:
        found.append(f"fidelity: top-1 agreement {fid['top1_agreement']:.4f} < {limits.min_agreement}")
    if limits.max_kl is not None and fid["kl_mean"] is not None and fid["kl_mean"] > limits.max_kl:
        found.append(f"fidelity: mean KL {fid['kl_mean']:.4g} > {limits.max_kl}")
    if limits.min_cosine is not None and fid["feature_cosine"] < limits.min_cosine:
        found.append(f"fidelity: feature cosine {fid['feature_cosine']:.4f} < {limits.min_cosine}")
    if limits.min_parity_cosine is not None:
        for model, backends in report["parity"].items():
            for backend, numbers in backends.items():
                if numbers["cosine"] < limits.min_parity_cosine:
                    found.append(f"parity: {model} on {backend} vs torch-cpu: cosine {numbers['cosine']:.6f} "
                                 f"< {limits.min_parity_cosine}")
    return found


def _against_baseline(report: dict, baseline: dict, tolerance: float) -> list[str]:
    found = []
    before = {(row["backend"], row["batch"]): row for row in baseline.get("latency", [])}
    for row in report["latency"]:
        old = before.get((row["backend"], row["batch"]))
        if old is None:
            continue
        where = f"{row['backend']}, batch {row['batch']}"
        new_t, old_t = row["compressed"]["p50_s"], old["compressed"]["p50_s"]
        if new_t > old_t * (1 + tolerance):
            found.append(f"latency: {where}: compressed p50 {new_t * 1e3:.2f} ms vs baseline {old_t * 1e3:.2f} ms "
                         f"(+{(new_t / old_t - 1) * 100:.1f}% > {tolerance * 100:g}%)")
        new_s, old_s = row["speedup"]["median"], old["speedup"]["median"]
        if new_s < old_s * (1 - tolerance):
            found.append(f"speedup: {where}: {new_s:.3f}x vs baseline {old_s:.3f}x "
                         f"(-{(1 - new_s / old_s) * 100:.1f}% > {tolerance * 100:g}%)")
    new_f, old_f = report["fidelity"], baseline.get("fidelity", {})
    for key, label in (("top1_agreement", "top-1 agreement"), ("feature_cosine", "feature cosine")):
        if new_f.get(key) is not None and old_f.get(key) is not None and new_f[key] < old_f[key] * (1 - tolerance):
            found.append(f"fidelity: {label} {new_f[key]:.4f} vs baseline {old_f[key]:.4f}")
    for model in ("dense", "compressed"):
        new_a = ((new_f.get("accuracy") or {}).get(model) or {}).get("top1")
        old_a = ((old_f.get("accuracy") or {}).get(model) or {}).get("top1")
        if new_a is not None and old_a is not None and new_a < old_a * (1 - tolerance):
            found.append(f"accuracy: {model} top-1 {new_a:.4f} vs baseline {old_a:.4f}")
    return found
