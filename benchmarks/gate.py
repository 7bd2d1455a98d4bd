"""The regression gate: a bench report against limits and, optionally, a baseline report.

A gate never passes on what was not measured: a limit or a baseline number whose measurement
is missing from the report (its backend was skipped, the model has no classifier, nothing ran)
is a failure in its own right, and a measured NaN fails every limit on it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.documents import read_json
from corp_deploy.errors import SettingError, check_choices, check_setting_types
from corp_deploy.files import checked_path
from exporters.parity import below
from exporters.precision import PRECISIONS

from .backends import BACKENDS, TORCH_FAMILIES, row_timings
from .results import BenchReport, BenchSettings, Int8Result, Int8Row

#: The int8 graph a baseline's int8 numbers are compared on (:mod:`benchmarks.int8`).
INT8_GRAPH = "compressed-int8"

#: The absolute fidelity limits: option, the number in the report's ``fidelity``, label, number format, bound side.
_FIDELITY_LIMITS = (
    ("min_agreement", "top1_agreement", "top-1 agreement", ".4f", "min"),
    ("max_kl", "kl_mean", "mean KL", ".4g", "max"),
    ("min_cosine", "feature_cosine", "feature cosine", ".4f", "min"),
)


#: What a baseline can gate, each compared only where ``GateLimits.gates`` names it: the compressed
#: model's median latency (absolute: it follows the machine's load, so it holds only on a dedicated
#: runner), its speedup over the dense model (timed interleaved with it: load slows both alike),
#: fidelity (top-1 agreement, feature cosine, accuracy) and the int8 graph's speedup and cosine.
BASELINE_GATES = ("latency", "speedup", "fidelity", "int8")


@dataclass(frozen=True)
class GateLimits:
    """What may not get worse.

    ``gates``: what a baseline is compared on (:data:`BASELINE_GATES`; all by default; on a shared
    runner ``speedup``, ``fidelity`` and ``int8`` hold, ``latency`` moves with the load);
    ``gates_requested`` says the user named them, and then each must have something to compare in
    the baseline (a baseline without int8 numbers gates nothing on ``int8``).
    ``max_regression``: against a baseline, the compressed model's measured speedup (and, for
    classifiers, its top-1 agreement and accuracy, its feature cosine and the int8 numbers) may
    shrink by at most this fraction, and its median latency may grow by as much unless
    ``max_latency_regression`` (only with ``latency`` gated) says otherwise. Absolute limits (None:
    not checked): ``min_agreement`` (top-1 agreement with the dense model), ``max_kl`` (mean KL
    divergence), ``min_cosine`` (mean feature cosine), ``min_parity_cosine`` (worst per-image
    cosine of any backend vs PyTorch).
    Every fidelity limit that is set must have been measured. The parity limit has a default that
    applies wherever parity was measured; ``parity_requested`` says the user asked for it, and then
    it must have been measured too.
    """

    max_regression: float = 0.05
    max_latency_regression: float | None = None
    gates: tuple[str, ...] = BASELINE_GATES
    gates_requested: bool = False
    min_agreement: float | None = None
    max_kl: float | None = None
    min_cosine: float | None = None
    min_parity_cosine: float | None = 0.999
    parity_requested: bool = False

    def __post_init__(self) -> None:
        check_setting_types(self)
        check_choices("gates", self.gates, BASELINE_GATES)
        if self.max_latency_regression is not None and "latency" not in self.gates:
            raise SettingError(
                "{setting} is the latency gate's tolerance; it applies only when {setting} names latency",
                "max_latency_regression",
                "gates",
            )
        ranges = {
            "max_regression": (0.0, 1.0),
            "max_latency_regression": (0.0, math.inf),
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
            if not (math.isfinite(value) and low <= value and (value <= high if closed_top else value < high)):
                allowed = f"in [{low:g}, {high:g}{']' if closed_top else ')'}" if math.isfinite(high) else f">= {low:g}"
                raise SettingError(f"{{setting}} must be a finite number {allowed}; got {value}", name)

    @property
    def latency_tolerance(self) -> float:
        """How much the compressed model's median latency may grow against a baseline."""
        return self.max_regression if self.max_latency_regression is None else self.max_latency_regression

    @property
    def requested(self) -> bool:
        """Whether any limit was asked for (then a run that timed nothing fails)."""
        return self.parity_requested or any(getattr(self, option) is not None for option, *_ in _FIDELITY_LIMITS)

    def to_dict(self) -> dict:
        return asdict(self)


def read_baseline(path: str | Path) -> BenchReport:
    """A bench JSON report to compare with (:class:`~benchmarks.results.BenchReport`), checked:
    every number the gate reads is there and usable, and the run it records passed its own gate."""
    path = checked_path(path, "baseline")
    report = BenchReport.from_dict(read_json(path, "baseline", "a bench JSON report"), f"baseline {path}")
    problem = _baseline_problem(report)
    if problem is not None:
        raise CorpError(f"baseline {path} is malformed: {problem}")
    return report


def check_comparable(
    baseline: BenchReport, path: str | Path, settings: BenchSettings, models: dict, data: dict, limits: GateLimits
) -> None:
    """CorpError, before any timing, when ``baseline`` measured other things than this run will:
    another model (its parameters, MACs per image, precision, ONNX exporter or opset differ: another
    artifact, dense model or export), other batch sizes, backends, thread counts, PyTorch
    precision or CUDA graphs, a latency row timed another way (device-resident or host to host:
    :func:`~benchmarks.backends.row_timings`; the CPU's one measurement is both), or (where the
    fidelity it gates is compared) other evaluation images than ``data``
    (:func:`check_same_data`); one message names every difference. What the baseline does not
    record (a report written by hand) is not compared.
    ``models``: this run's :class:`~benchmarks.results.ModelEntry` by model name."""
    differences = []
    for name, entry in models.items():
        old = baseline.models.get(name)
        if old is None:
            continue
        for number, said in (
            ("params", _millions),
            ("macs", _giga),
            ("precision", str),
            ("exporter", str),
            ("opset", str),
        ):
            was, now = getattr(old, number), getattr(entry, number)
            if was is not None and now is not None and was != now:
                differences.append(f"{name} model {number} {said(was)} in the baseline, {said(now)} here")
    old = baseline.settings
    if old is not None:
        settings_compared = (
            ("batches", "--batch"),
            ("backends", "--backends"),
            ("threads", "--threads"),
            ("torch_precision", "--torch-precision"),
            ("cuda_graphs", "--cuda-graphs"),
        )
        for setting, option in settings_compared:
            was, now = getattr(old, setting), getattr(settings, setting)
            if _listed(was) != _listed(now):
                differences.append(f"{option} {_listed(was)} in the baseline, {_listed(now)} here")
    for backend, was in {row.backend: row.timing for row in baseline.latency}.items():
        now = row_timings(backend, settings.timing)[0]
        if was != now:
            differences.append(f"{backend} timed {was} in the baseline, {now} here (--timing)")
    other_images = _data_differences(baseline, data, limits)
    if not differences:
        check_same_data(baseline, path, data, limits)
        return
    raise CorpError(
        f"baseline {path} measured other things than this run would "
        f"({'; '.join([*differences, *(f'fidelity on other images: {d}' for d in other_images)])}); a gate "
        "compares like with like: make the baseline from the same artifact and export with the same "
        "--backends, --batch, --threads, --torch-precision, --timing and --cuda-graphs"
        + (" and the same --data and --data-samples" if other_images else "")
    )


#: What describes the evaluation images in a report (``fidelity.data``) and must be equal for a
#: baseline's fidelity and int8 numbers to compare with this run's.
_DATA_KEYS = ("source", "path", "photos", "labelled", "images")


def check_same_data(baseline: BenchReport, path: str | Path, data: dict, limits: GateLimits) -> None:
    """CorpError when the fidelity the baseline gates (``fidelity`` or ``int8`` among
    ``limits.gates``) was measured on other evaluation images than this run's ``data``
    (``fidelity.data``: another source, folder, photos, labelling or number of images); one
    message names every difference. What the baseline does not record is not compared."""
    differences = _data_differences(baseline, data, limits)
    if differences:
        raise CorpError(
            f"baseline {path} measured fidelity on other images than this run ({'; '.join(differences)}); a "
            "gate compares like with like: use the same --data and --data-samples, or gate speedup and latency only"
        )


def _data_differences(baseline: BenchReport, data: dict, limits: GateLimits) -> list[str]:
    """How ``data`` differs from the evaluation images of ``baseline``'s gated fidelity, in words."""
    old = baseline.fidelity.data if baseline.fidelity is not None else None
    if not ({"fidelity", "int8"} & set(limits.gates)) or not old:
        return []
    return [
        f"{key} {old[key]!r} in the baseline, {data[key]!r} here"
        for key in _DATA_KEYS
        if key in old and key in data and old[key] != data[key]
    ]


def _millions(count: int) -> str:
    return f"{count / 1e6:.4g} M"


def _giga(count: int) -> str:
    return f"{count / 1e9:.4g} G"


def _listed(value) -> str:
    if value is None:
        return "default"
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


#: Where each fidelity number of a report lies (a baseline's outside it was edited or corrupted).
_FIDELITY_RANGES = {"feature_cosine": (-1.0, 1.0), "top1_agreement": (0.0, 1.0), "kl_mean": (0.0, math.inf)}


def _baseline_problem(report: BenchReport) -> str | None:
    """What makes a well-formed report unusable as a baseline, or None."""
    if not report.latency:
        return "it timed nothing (no latency rows), so there is nothing to compare against"
    if report.gate is not None and not report.gate.passed:
        return "its own regression gate failed; a baseline must be a run that passed"
    for i, row in enumerate(report.latency):
        if not (_positive(row.compressed.p50_s) and _positive(row.speedup.median)):
            return f"latency row {i} needs a backend name, a batch size and positive finite times and speedup"
    accuracy = report.fidelity.accuracy or {}
    if not all(_finite(numbers.top1) for numbers in accuracy.values()):
        return "fidelity.accuracy needs a numeric top1 per model"
    for name, (low, high) in _FIDELITY_RANGES.items():
        value = getattr(report.fidelity, name)
        if _finite(value) and not low - 1e-6 <= value <= high + 1e-6:  # NaN stays: it fails every limit
            return f"fidelity.{name} {value:g} is outside [{low:g}, {high:g}], where it always lies"
    int8 = report.int8
    if int8 is not None and int8.skipped is None:
        usable = (
            int8.latency is not None
            and all(_positive(_int8_speedup(row)) for row in int8.latency)
            and INT8_GRAPH in (int8.fidelity or {})
            and _finite(int8.fidelity[INT8_GRAPH].cosine_mean)
        )
        if not usable:
            return f"int8 needs latency rows with a batch and the {INT8_GRAPH} speedup, and its fidelity's cosine_mean"
    return None


def regressions(report: BenchReport, limits: GateLimits, baseline: BenchReport | None = None) -> list[str]:
    """Every way ``report`` breaks ``limits``, regresses against ``baseline``, or leaves something the
    gate was asked to check unmeasured, in words."""
    found = _absolute(report, limits)
    if baseline is not None:  # every row of the baseline must be measured again, whatever the gates compare
        found += _rows_against_baseline(report, baseline, limits)
        if "fidelity" in limits.gates:
            found += _fidelity_against_baseline(report, baseline, limits.max_regression)
        found += _int8_against_baseline(report.int8, baseline.int8, limits.max_regression, "int8" in limits.gates)
    if (baseline is not None or limits.requested) and not report.latency:
        skipped = "; ".join(f"{name}: {reason}" for name, reason in report.skipped_backends().items())
        found.append(f"nothing was timed: every requested backend was skipped ({skipped or 'none requested'})")
    return found


def check_gates(baseline: BenchReport, path: str | Path, limits: GateLimits) -> None:
    """CorpError, before any timing, when ``--gate`` (given on the command line:
    ``limits.gates_requested``) names something ``baseline`` has no numbers of: a gate named
    never passes by comparing nothing."""
    missing = [gate for gate in limits.gates if not baseline_has(baseline, gate)] if limits.gates_requested else []
    if missing:
        kept = [gate for gate in limits.gates if gate not in missing]
        raise CorpError(
            f"--gate {','.join(missing)}: baseline {path} has no {' or '.join(missing)} numbers to compare"
            + (f"; gate {','.join(kept)} only, or" if kept else ";")
            + " make a baseline that measured them"
        )


def compared_gates(baseline: BenchReport, limits: GateLimits) -> list[str]:
    """The gates of ``limits`` that ``baseline`` has numbers for: what a comparison with it checked."""
    return [gate for gate in limits.gates if baseline_has(baseline, gate)]


def baseline_has(baseline: BenchReport, gate: str) -> bool:
    """Whether ``baseline`` holds numbers that ``gate`` compares (its latency rows always do)."""
    if gate == "fidelity":
        old = baseline.fidelity
        return old.top1_agreement is not None or old.feature_cosine is not None or bool(old.accuracy)
    if gate == "int8":
        return baseline.int8 is not None and baseline.int8.skipped is None
    return bool(baseline.latency)


def _absolute(report: BenchReport, limits: GateLimits) -> list[str]:
    found = []
    for option, number, label, spec, side in _FIDELITY_LIMITS:
        limit, value = getattr(limits, option), getattr(report.fidelity, number)
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
            for model, backends in report.parity.items()
            for backend, numbers in backends.items()
        ]
        if not measured and limits.parity_requested:
            found.append(
                "parity: --min-parity-cosine was given but nothing ran other than the fp32 torch-cpu reference"
            )
        for model, backend, numbers in measured:
            limit, why = parity_limit(report, model, backend, limits)
            if not numbers.cosine >= limit:
                found.append(
                    f"parity: {model} on {backend} vs torch-cpu fp32: cosine {below(numbers.cosine, limit)} < {limit}"
                    + why
                )
    return found


def parity_limit(report: BenchReport, model: str, backend: str, limits: GateLimits) -> tuple[float, str]:
    """The worst cosine to PyTorch fp32 allowed for ``model`` on ``backend`` and, where it is not
    ``limits.min_parity_cosine``, why (a phrase for messages). The limit given on the command line
    holds for every row; the default does too, except on a backend that runs exported graphs of a
    precision whose own export gate is looser (int8: 0.98), which the export already held them to."""
    limit = limits.min_parity_cosine
    precision = getattr(report.models.get(model), "precision", None)
    if limits.parity_requested or BACKENDS[backend].family in TORCH_FAMILIES or precision not in PRECISIONS:
        return limit, ""
    export_gate = PRECISIONS[precision].tolerance.min_cosine
    if export_gate is None or export_gate >= limit:
        return limit, ""
    return export_gate, f" (the {precision} graphs' own export gate)"


def _rows_against_baseline(report: BenchReport, baseline: BenchReport, limits: GateLimits) -> list[str]:
    """The latency rows against ``baseline``: every row on both sides, and the compressed model's
    median latency and speedup where ``limits.gates`` names them."""
    found = []
    measured = {(row.backend, row.batch): row for row in report.latency}
    in_baseline = {(row.backend, row.batch) for row in baseline.latency}
    for row in report.latency:  # never passed by comparing fewer rows than were measured
        if (row.backend, row.batch) not in in_baseline:
            found.append(
                f"latency: {row.backend}, batch {row.batch} was measured but is not in the baseline (it did "
                "not time it): nothing to compare it with"
            )
    for old in baseline.latency:
        where = f"{old.backend}, batch {old.batch}"
        row = measured.get((old.backend, old.batch))
        if row is None:
            status = report.backends.get(old.backend)
            reason = status.reason if status is not None and status.reason else "not requested in this run"
            found.append(f"latency: {where} is in the baseline but was not measured ({reason})")
            continue
        new_t, old_t, allowed = row.compressed.p50_s, old.compressed.p50_s, limits.latency_tolerance
        if "latency" in limits.gates and not new_t <= old_t * (1 + allowed):
            found.append(
                f"latency: {where}: compressed p50 {new_t * 1e3:.2f} ms vs baseline {old_t * 1e3:.2f} ms "
                f"(+{(new_t / old_t - 1) * 100:.1f}% > {allowed * 100:g}%)"
            )
        new_s, old_s, allowed = row.speedup.median, old.speedup.median, limits.max_regression
        if "speedup" in limits.gates and not new_s >= old_s * (1 - allowed):
            found.append(
                f"speedup: {where}: {new_s:.3f}x vs baseline {old_s:.3f}x "
                f"(-{(1 - new_s / old_s) * 100:.1f}% > {allowed * 100:g}%)"
            )
    return found


def _fidelity_against_baseline(report: BenchReport, baseline: BenchReport, tolerance: float) -> list[str]:
    """Top-1 agreement, feature cosine and accuracy against ``baseline``: each may shrink by at most
    ``tolerance``, each the baseline has must be measured again, and each measured must be in the
    baseline (a null or missing number there compares nothing: never a pass)."""
    found = []
    new_f, old_f = report.fidelity, baseline.fidelity
    for number, label in (("top1_agreement", "top-1 agreement"), ("feature_cosine", "feature cosine")):
        new, old = getattr(new_f, number), getattr(old_f, number)
        if old is None:
            if new is not None:
                found.append(f"fidelity: {label} was measured but the baseline has none (null or missing)")
        elif new is None:
            found.append(f"fidelity: {label} is in the baseline but was not measured")
        elif not new >= old * (1 - tolerance):
            found.append(f"fidelity: {label} {new:.4f} vs baseline {old:.4f}")
    for model, old in (old_f.accuracy or {}).items():
        new = (new_f.accuracy or {}).get(model)
        if new is None:
            found.append(f"accuracy: {model} top-1 is in the baseline but was not measured (no labelled --data)")
        elif not new.top1 >= old.top1 * (1 - tolerance):
            found.append(f"accuracy: {model} top-1 {new.top1:.4f} vs baseline {old.top1:.4f}")
    return found


def _int8_against_baseline(
    new: Int8Result | None, old: Int8Result | None, tolerance: float, compared: bool
) -> list[str]:
    """A baseline's int8 rows must be measured again; where ``compared`` (the ``int8`` gate), the
    compressed int8 graph's speedup over dense fp32 (per batch) and its cosine to dense fp32 may not
    shrink by more than ``tolerance``."""
    if old is None or old.skipped is not None:
        return []
    if new is None or new.skipped is not None:
        why = new.skipped if new else "no export-int8/ beside export-fp32/, or ort not among the backends"
        return [f"int8: in the baseline but not measured ({why})"]
    found = []
    rows = {row.batch: row for row in new.latency}
    for old_row in old.latency:
        row = rows.get(old_row.batch)
        if row is None:
            found.append(f"int8: batch {old_row.batch} is in the baseline but was not measured")
        elif compared and not _int8_speedup(row) >= _int8_speedup(old_row) * (1 - tolerance):
            found.append(
                f"int8: batch {row.batch}: {INT8_GRAPH} {_int8_speedup(row):.3f}x over dense fp32 vs "
                f"baseline {_int8_speedup(old_row):.3f}x"
            )
    new_cos, old_cos = new.fidelity[INT8_GRAPH].cosine_mean, old.fidelity[INT8_GRAPH].cosine_mean
    if compared and not new_cos >= old_cos * (1 - tolerance):
        found.append(f"int8: {INT8_GRAPH} cosine to dense fp32 {new_cos:.4f} vs baseline {old_cos:.4f}")
    return found


def _int8_speedup(row: Int8Row) -> float | None:
    """The compressed int8 graph's median speedup over dense fp32 in ``row`` (None: not recorded)."""
    ratio = row.speedup_over_dense_fp32.get(INT8_GRAPH)
    return ratio.median if ratio is not None else None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _finite(value) and value > 0
