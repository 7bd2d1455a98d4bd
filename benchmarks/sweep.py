"""``corp-deploy sweep``: compress with each method at several sparsities, export, benchmark,
and compare the methods at matched sparsity and at matched MACs.

Like the paper's accuracy-vs-sparsity figure and efficiency table: for each method and
sparsity the parameters, MACs, MAC-ideal and measured speedups, and the fidelity to the dense
model. Methods: those of :data:`corp_deploy.METHODS` and ``uncompensated`` (CORP's channels,
only sliced).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from corp_deploy import (
    METHODS,
    CalibrationSpec,
    CompressConfig,
    CorpError,
    ImagesInMemory,
    RecoveryConfig,
    compress_to_artifact,
    distributed,
    model_transform,
)
from corp_deploy.calibration import DEFAULT_IMAGES
from corp_deploy.documents import Document, DocumentFormat, Machine, Record, optional_entry, timestamp
from corp_deploy.errors import BadUsage, SettingError
from corp_deploy.files import write_json
from corp_deploy.outputs import check_output_dir, staged_output
from corp_deploy.recovery import check_sources
from exporters import ExportOptions, export_artifact

from .attention_kernels import lost_kernel_warnings
from .backends import ON_THE_CPU, ModelFiles
from .data import EvalImages, eval_images, folders_overlap
from .harness import run_bench
from .report import fidelity_summary
from .results import BenchReport, BenchSettings, Fidelity, LatencyRow, ModelEntry

SWEEP_FILE = "sweep.json"
#: 3: a run's point is a sparsity or a MAC ``budget`` (both entries in every row).
SWEEP_FORMAT = DocumentFormat("corp-deploy-sweep", 3, "sweep", "run the sweep again", file=SWEEP_FILE)
#: Every compression method, and ``uncompensated``: CORP's channel selection, only sliced.
SWEEP_METHODS = (*METHODS, "uncompensated")
#: The methods that take MAC budgets: CORP and its uncompensated ablation.
BUDGET_METHODS = ("corp", "uncompensated")
#: The methods a sweep runs under torch.distributed (``uncompensated`` is CORP's selection).
DISTRIBUTED_METHODS = frozenset(
    {name for name, method in METHODS.items() if method.runs_distributed} | {"uncompensated"}
)
#: What joins a method's name and the recovery's steps in the name of its recovered runs: ``corp+rec200``.
RECOVERED = "+rec"


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep and how to measure it (the dense model itself is given to ``run_sweep``).

    The points are either ``sparsities`` or MAC ``budgets`` (fractions of the dense MACs, CORP
    and its uncompensated ablation only), not both. ``target`` None lets each method prune what
    it prunes by default (vbp: the MLP only; CORP with a budget: everything it can). A
    ``recovery`` with steps runs every method's points a second time, recovered, as the method
    ``<method>+rec<steps>`` (:attr:`labels`), so the table and plot show what recovery adds.
    """

    sparsities: tuple[float, ...] = ()
    budgets: tuple[float, ...] = ()
    methods: tuple[str, ...] = ("corp",)
    target: str | None = None
    calib: Path | None = None
    calib_samples: int = DEFAULT_IMAGES
    calib_crops: bool = True
    data: Path | None = None
    data_samples: int = 256
    seed: int = 0
    bench: BenchSettings = field(default_factory=BenchSettings)
    recovery: RecoveryConfig = RecoveryConfig()

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in SWEEP_METHODS]
        if unknown or not self.methods or len(set(self.methods)) != len(self.methods):
            raise SettingError(
                f"{{setting}} must be distinct names from {', '.join(SWEEP_METHODS)}; "
                f"got {', '.join(self.methods) or 'none'}",
                "methods",
            )
        if bool(self.sparsities) == bool(self.budgets):
            raise BadUsage("a sweep runs either sparsities or MAC budgets (one of the two, not both)")
        unbudgeted = [method for method in self.methods if method not in BUDGET_METHODS]
        if self.budgets and unbudgeted:
            raise SettingError(
                f"{{setting}} applies to {{setting}} {' and '.join(BUDGET_METHODS)} only, not {', '.join(unbudgeted)}",
                "budgets",
                "methods",
            )
        names = [self.run_name(label, point) for label in self.labels for point in self.points]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise SettingError(
                f"{{setting}} gives the same run twice ({repeated[0]}); give distinct points",
                "sparsity" if self.sparsities else "budgets",
            )
        for label in self.labels:
            for point in self.points:
                self.config(label, point)  # CorpError for a value out of range or a bad combination

    @property
    def labels(self) -> tuple[str, ...]:
        """The methods as the rows name them: each method, then its recovered runs' name when
        ``recovery`` has steps."""
        if not self.recovery.enabled:
            return self.methods
        return tuple(label for m in self.methods for label in (m, f"{m}{RECOVERED}{self.recovery.steps}"))

    @property
    def points(self) -> tuple[float, ...]:
        """The sparsities, or the budgets."""
        return self.sparsities or self.budgets

    def run_name(self, label: str, point: float) -> str:
        return f"{label}-{'s' if self.sparsities else 'macs'}{point:g}"

    @property
    def calibration(self) -> CalibrationSpec:
        """The calibration images of every point."""
        return CalibrationSpec(self.calib, self.calib_samples, seed=self.seed, crops=self.calib_crops)

    def config(self, label: str, point: float) -> CompressConfig:
        """The compression of the run ``label`` (one of :attr:`labels`) at ``point``."""
        method, recovered, _ = label.partition(RECOVERED)
        sizes = dict(sparsity=point) if self.sparsities else dict(macs=point)
        if method == "uncompensated":
            config = CompressConfig.from_settings(**sizes, target=self.target, compensation=False)
        else:
            config = CompressConfig.from_settings(**sizes, target=self.target, method=method)
        return replace(config, recovery=self.recovery) if recovered else config

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(calib=str(self.calib) if self.calib else None, data=str(self.data) if self.data else None)
        return out


@dataclass
class PerModel(Record):
    """One number of the dense model and of the compressed one (parameters, MACs per image)."""

    dense: int
    compressed: int


@dataclass
class SweepRow(Record):
    """One run of a sweep: the ``method`` at a ``sparsity`` or a MAC ``budget`` (the other None), the
    artifact's folder name in the sweep, the target it pruned, both models' parameters and MACs, the
    MAC-ideal speedup, and its bench report (whose latency rows and fidelity the row repeats);
    for a recovered run (``<method>+rec<N>``) what recovery did (:func:`recovery_outcome`)."""

    method: str
    sparsity: float | None
    budget: float | None
    artifact: str
    target: str | None
    params: PerModel
    macs: PerModel
    ideal_speedup: float
    latency: list[LatencyRow]
    fidelity: Fidelity
    bench: BenchReport
    recovery: dict | None = optional_entry()

    @property
    def point(self) -> float:
        """The run's sparsity, or its budget."""
        return self.sparsity if self.sparsity is not None else self.budget


@dataclass(kw_only=True)
class SweepResult(Document):
    """``sweep.json``: when, the dense model (``base_model``, as ``config.json`` records it), the
    spec, the machine and library versions the runs were timed with, whether the model is a
    classifier, how calibration was shared under torchrun (``distributed``, only then), one row per
    run in the order of the spec's methods and points."""

    FORMAT = SWEEP_FORMAT

    created: str
    base_model: dict
    spec: SweepSpec
    machine: Machine
    versions: dict[str, str | None]
    classifier: bool
    distributed: dict | None = optional_entry()
    rows: list[SweepRow]


def run_sweep(
    dense: nn.Module,
    base_model: dict,
    spec: SweepSpec,
    out_dir: str | Path,
    log: Callable[[str], None] = lambda message: None,
    warn: Callable[[str], None] = lambda message: None,
) -> SweepResult | None:
    """Run the sweep into ``out_dir`` (written atomically): one artifact (with its export) per
    method and point under ``<method>-s<S>/`` or ``<method>-macs<F>/``, plus ``sweep.json``,
    ``sweep.md`` and ``sweep.png``. ``log`` says what is being done, ``warn`` what the user should
    know, as bench says it: backends skipped (with the reason), nothing timed, a run whose attention
    lost the dense model's fused kernel.

    Under torch.distributed (``torchrun``) the points run one after another, each calibrated on
    every rank's share of the images (:func:`corp_deploy.compress`); the first rank alone writes,
    exports and times (timing several processes at once would measure their contention), while
    the others wait for it, and it alone returns the result (the others None).
    """
    if distributed.active() and not set(spec.methods) <= DISTRIBUTED_METHODS:
        raise CorpError(
            f"under torchrun a sweep runs only {', '.join(sorted(DISTRIBUTED_METHODS))} (the "
            "methods whose calibration is shared by the processes); run the others in one process"
        )
    check_output_dir(out_dir, "sweep")  # before any work
    first = distributed.rank() == 0
    transform, _ = model_transform(dense)
    calibration = ImagesInMemory(spec.calibration.images(transform))  # read once for every point
    if spec.recovery.enabled:  # before the first point, which does not recover
        check_sources(calibration, spec.recovery)
    measure = _Measure(dense, spec, transform, log, warn) if first else None
    rows = []
    with staged_output(out_dir, "sweep") if first else contextlib.nullcontext() as tmp:
        for method in spec.labels:
            for point in spec.points:
                name = spec.run_name(method, point)
                config = spec.config(method, point)
                log(f"{name}: compressing ...")
                compressed = compress_to_artifact(
                    dense,
                    config,
                    spec.calibration,
                    tmp / name if first else None,
                    base_model=base_model,
                    images=calibration,
                    progress=first and config.recovery.enabled,  # recovery's progress: minutes
                )
                if first:
                    rows.append(measure.row(tmp, name, method, point, config, compressed))
                distributed.barrier()  # on the other ranks: the first rank's export and timing of this point
        if not first:
            return None
        result = SweepResult(
            created=timestamp(),
            base_model=base_model,
            spec=spec,
            machine=rows[0].bench.machine,
            versions=rows[0].bench.versions,
            classifier=dense.num_classes > 0,
            distributed=compressed.report.get("distributed"),
            rows=rows,
        )
        write_json(tmp / SWEEP_FILE, result.to_dict())
        (tmp / "sweep.md").write_text(to_markdown(result))
        plot(result, tmp / "sweep.png")
    return result


class _Measure:
    """What the first rank does with each point's artifact: export it (the dense graph with the
    first, for every point's bench), bench it against the dense model on the evaluation images
    (decoded once, before any work), say what the user should know, and make its row."""

    def __init__(
        self,
        dense: nn.Module,
        spec: SweepSpec,
        transform: Callable,
        log: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self._dense, self._spec, self._log, self._warn = dense, spec, log, warn
        evaluation = eval_images(spec.data, transform, limit=spec.data_samples, seed=spec.seed)
        decoded = list(evaluation)  # decode once, reuse for every run
        self._evaluation = EvalImages(lambda: iter(decoded), evaluation.description, evaluation.labelled)
        self._held_out = not (spec.data and spec.calib and folders_overlap(spec.data, spec.calib))
        self._dense_onnx: Path | None = None

    def row(self, folder: Path, name: str, method: str, point: float, config: CompressConfig, compressed) -> SweepRow:
        """Export and bench the ``compressed`` artifact (:class:`~corp_deploy.CompressedArtifact`)
        of ``method`` at ``point``, ``folder / name`` in the sweep's staging ``folder``: its row."""
        dense, spec, log, warn = self._dense, self._spec, self._log, self._warn
        model, report = compressed.model, compressed.report
        log(f"{name}: exporting ...")
        with_dense = self._dense_onnx is None  # the dense graph once, for every point's bench
        export = export_artifact(
            compressed.path,
            None,
            ExportOptions(dense=with_dense),
            dense_model=dense if with_dense else None,
            log=log,
        )
        self._dense_onnx = self._dense_onnx or export.out_dir / "dense.onnx"
        with _timing_threads(spec.bench) as settings:
            bench = run_bench(
                ModelFiles(model, export.out_dir / "model.onnx"),
                ModelFiles(dense, self._dense_onnx),
                self._evaluation,
                settings,
                held_out=self._held_out,
                log=log,
            )
        _paths_relative_to(bench.models, folder)
        for backend, reason in bench.skipped_backends().items():
            warn(f"{name}: skipped {backend}: {reason}")
        if not bench.latency:
            warn(f"{name}: nothing was timed: every backend asked for was skipped")
        for message in lost_kernel_warnings(bench.attention, model, dense):
            warn(f"{name}: {message}")
        row = SweepRow(
            method=method,
            sparsity=point if spec.sparsities else None,
            budget=point if spec.budgets else None,
            artifact=name,
            target=config.target,
            params=PerModel(**report["params"]),
            macs=PerModel(**report["macs"]),
            ideal_speedup=bench.ideal_speedup,
            latency=bench.latency,
            fidelity=bench.fidelity,
            bench=bench,
            recovery=recovery_outcome(report),
        )
        log(f"{name}: " + fidelity_summary(bench))
        return row


def recovery_outcome(report: dict) -> dict | None:
    """What the recovery in a compress ``report`` did, as a sweep row records it (None: none ran):
    the steps run, why it stopped, the step whose weights were kept (0: none, the model is the one
    compress gives without recovery) and the validation output cosine before and after."""
    recovery = report.get("recovery")
    if recovery is None:
        return None
    return {key: recovery[key] for key in ("steps_run", "stopped", "best_step", "validation_cosine")}


@contextlib.contextmanager
def _timing_threads(settings: BenchSettings):
    """``settings`` to time with. Under torchrun (which starts its processes with one OpenMP
    thread each) a sweep without ``--threads`` times on every CPU this process may use, as one
    process would, and PyTorch's thread count is restored for the next calibration."""
    if not distributed.active() or settings.threads:
        yield settings
        return
    calibration_threads = torch.get_num_threads()
    try:
        yield replace(settings, threads=len(os.sched_getaffinity(0)))
    finally:
        torch.set_num_threads(calibration_threads)


def _paths_relative_to(models: dict[str, ModelEntry], root: Path) -> None:
    """Rewrite a bench report's model file paths (inside the sweep's staging directory, which is
    renamed when the sweep completes) relative to the sweep directory, in place."""
    for files in models.values():
        if files.onnx is not None:
            files.onnx = str(Path(files.onnx).relative_to(root))
        if files.engine is not None:
            files.engine = str(Path(files.engine).relative_to(root))


def headline(row: SweepRow) -> float:
    """The one fidelity number a sweep compares: accuracy when labelled, else top-1 agreement
    (classifiers), else feature cosine."""
    f = row.fidelity
    if f.accuracy:
        return f.accuracy["compressed"].top1
    return f.top1_agreement if f.top1_agreement is not None else f.feature_cosine


def headline_name(result: SweepResult) -> str:
    if result.rows[0].fidelity.accuracy:
        return "top-1 accuracy"
    return "top-1 agreement with dense" if result.classifier else "feature cosine to dense"


def point_label(result: SweepResult) -> str:
    """What a sweep's points are (:attr:`SweepRow.point`): sparsity ``s`` or MAC ``budget``."""
    return "s" if result.spec.sparsities else "MAC budget"


def by_method(result: SweepResult) -> dict[str, list[SweepRow]]:
    """Rows grouped by method, in the sweep's order."""
    return {m: [row for row in result.rows if row.method == m] for m in result.spec.labels}


def fidelity_curve(rows: list[SweepRow]) -> list[tuple[int, float]]:
    """A method's runs as ``(compressed MACs, headline fidelity)`` points."""
    return [(row.macs.compressed, headline(row)) for row in rows]


def at_macs(curve: list[tuple[int, float]], macs: int) -> float | None:
    """A method's fidelity (its :func:`fidelity_curve`) at ``macs``: exact at a measured point, else
    linear in MACs between the two measured points around it; None outside the measured range."""
    points = sorted(curve)
    exact = [f for m, f in points if m == macs]
    if exact:
        return exact[0]
    for (m0, f0), (m1, f1) in zip(points, points[1:]):
        if m0 < macs < m1:
            return f0 + (f1 - f0) * (macs - m0) / (m1 - m0)
    return None


def _backend_label(backend: str, result: SweepResult) -> str:
    """``torch-cpu bf16`` for a torch backend timed in half precision; other backends as named."""
    precision = result.spec.bench.torch_precision
    return f"{backend} {precision}" if backend.startswith("torch") and precision != "fp32" else backend


def _timed_note(result: SweepResult, backends: list[str]) -> str:
    """What sweep.md says of the timing: how the speedups were timed, the precision PyTorch ran in
    (and CUDA graphs), or that nothing was timed."""
    if not backends:
        return "Nothing was timed: every backend asked for was skipped (sweep.json says why)."
    settings = result.spec.bench
    timings = sorted({r.timing for row in result.rows for r in row.latency} - {ON_THE_CPU})
    note = "On the CPU device-resident and host-to-host timing are one measurement."
    if timings:
        note = f"GPU speedups timed {' and '.join(timings)} (sweep.json has the other figure beside each)."
    if any(backend.startswith("torch") for backend in backends):
        graphs = ", CUDA graphs on CUDA" if settings.cuda_graphs else ""
        note += f" PyTorch timed in {settings.torch_precision}{graphs}."
    return note


def to_markdown(result: SweepResult) -> str:
    name = headline_name(result)
    groups = by_method(result)
    methods = list(groups)
    batches = result.spec.bench.batches
    backends = sorted({r.backend for row in result.rows for r in row.latency})
    label = point_label(result)
    header = [
        "method",
        "target",
        label,
        "params (M)",
        "GMACs",
        "MAC-ideal speedup",
        *[f"{_backend_label(b, result)} speedup b{n} (of ideal)" for b in backends for n in batches],
        name,
    ]
    f = result.rows[0].fidelity
    lines = [
        f"# corp-deploy sweep: {result.base_model['name']}",
        "",
        f"{result.created}; machine {result.machine.cpu}, {result.machine.torch_threads} "
        f"threads. Fidelity on {f.images} images ({f.data.get('path', 'bundled photos')}, "
        f"{'held out' if f.held_out else 'NOT held out'} from calibration). " + _timed_note(result, backends),
        "",
        "## Every run",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result.rows:
        cells = [
            row.method,
            row.target,
            f"{row.point:g}",
            f"{row.params.compressed / 1e6:.2f}",
            f"{row.macs.compressed / 1e9:.4g}",
            f"{row.ideal_speedup:.3f}",
        ]
        by_key = {(r.backend, r.batch): r for r in row.latency}
        for b in backends:
            for n in batches:
                r = by_key.get((b, n))
                cells.append(f"{r.speedup.median:.3f} ({r.efficiency * 100:.0f}%)" if r else "-")
        cells.append(f"{headline(row):.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## {name} at matched {label}",
        "",
        f"| {label} | " + " | ".join(methods) + " |",
        "|" + "---|" * (len(methods) + 1),
    ]
    for point in result.spec.points:
        cells = [f"{headline(next(r for r in groups[m] if r.point == point)):.4f}" for m in methods]
        lines.append(f"| {point:g} | " + " | ".join(cells) + " |")
    reference = methods[0]
    lines += [
        "",
        f"## {name} at matched MACs",
        "",
        f"At the MACs of each {reference} run; other methods linearly interpolated in MACs between their "
        "two nearest runs (`-`: outside the range they were run at).",
        "",
        "| GMACs | " + " | ".join(methods) + " |",
        "|" + "---|" * (len(methods) + 1),
    ]
    for row in groups[reference]:
        macs = row.macs.compressed
        cells = [at_macs(fidelity_curve(groups[m]), macs) for m in methods]
        lines.append(f"| {macs / 1e9:.4g} | " + " | ".join("-" if c is None else f"{c:.4f}" for c in cells) + " |")
    lines += _recovery_lines(result)
    first = result.rows[0]
    lines += [
        "",
        f"Dense: {first.params.dense / 1e6:.2f} M parameters, {first.macs.dense / 1e9:.4g} "
        "GMACs. Per-run bench reports (latency percentiles, parity, all fidelity numbers) are in "
        "sweep.json.",
        "",
    ]
    return "\n".join(lines)


def _recovery_lines(result: SweepResult) -> list[str]:
    """sweep.md's lines on the recovered runs: per run, the step kept (or none) and the validation cosine."""
    lines = []
    for row in result.rows:
        outcome = row.recovery
        if outcome is None:
            continue
        cosine = outcome["validation_cosine"]
        kept = (
            f"kept the weights of step {outcome['best_step']} (validation cosine {cosine['compressed']:.4f} -> "
            f"{cosine['recovered']:.4f})"
            if outcome["best_step"]
            else f"kept no step: no measurement beat compression's (validation cosine {cosine['compressed']:.4f})"
        )
        lines.append(f"- {row.artifact}: {outcome['steps_run']} steps ({outcome['stopped']}), {kept}")
    return ["", "## Recovery", "", *lines] if lines else []


def plot(result: SweepResult, path: str | Path) -> None:
    """Per method: fidelity vs sparsity (or budget), fidelity vs MACs, measured speedup vs sparsity."""
    import matplotlib  # loaded when a picture is drawn: heavy, and its backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fid, cost, speed) = plt.subplots(1, 3, figsize=(15, 4.2))
    backend = next((r.backend for r in result.rows[0].latency), None)
    batch = max((r.batch for r in result.rows[0].latency if r.backend == backend), default=None)
    label = point_label(result)
    for method, rows in by_method(result).items():
        s = [row.point for row in rows]
        fid.plot(s, [headline(row) for row in rows], "-o", label=method)
        cost.plot([row.macs.compressed / 1e9 for row in rows], [headline(row) for row in rows], "-o", label=method)
        if backend is not None:
            (line,) = speed.plot(
                s,
                [
                    next(r.speedup.median for r in row.latency if r.backend == backend and r.batch == batch)
                    for row in rows
                ],
                "-o",
                label=f"{method}, measured",
            )
            speed.plot(
                s, [row.ideal_speedup for row in rows], ":", color=line.get_color(), label=f"{method}, MAC-ideal"
            )
    fid.set(xlabel=label, ylabel=headline_name(result), title=f"Fidelity at matched {label}")
    cost.set(xlabel="GMACs per image", ylabel=headline_name(result), title="Fidelity at matched MACs")
    cost.invert_xaxis()
    speed.set(
        xlabel=label,
        ylabel="speedup over dense",
        title=f"Speedup ({backend}, batch {batch})" if backend else "Speedup (no backend ran)",
    )
    for ax in (fid, cost, speed):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (nothing timed: no speedup line to name)
            ax.legend(fontsize=8)
    fig.suptitle(result.base_model["name"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
