"""``corp-deploy export``: a compressed artifact (and optionally its dense base) to checked ONNX
files, TensorRT engines or the script that builds them, and a manifest, written atomically.

Every ONNX file passes a parity gate against the PyTorch model it came from, and every
engine one against ONNX Runtime on the same graph; a failed gate leaves nothing behind.
An int8 graph is the float32 export quantized on calibration images (:mod:`exporters.quantize`),
gated against the float32 PyTorch model on held-out images.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from torch import nn

from corp_deploy import CalibrationImages, CorpError, count_macs, count_params, model_transform
from corp_deploy.artifact import Artifact, recorded_checksums
from corp_deploy.calibration import DEFAULT_BATCH, HELD_OUT_PHOTOS, CalibrationSpec, SpooledBatches
from corp_deploy.documents import timestamp
from corp_deploy.errors import EXIT_GATE_FAILED, BadUsage, check_instance
from corp_deploy.files import checked_path, sha256_file, write_json
from corp_deploy.outputs import check_output_dir, enclosing_output, resolve, staged_output
from corp_deploy.recovery import check_teacher
from corp_deploy.resources import FLOAT32, check_disk, check_fits, inference_bytes, release_freed_memory, weight_bytes

from . import tensorrt as trt_backend
from .int8_options import Int8Options
from .keep_float import AUTO, quantize_keeping_float
from .manifest import MANIFEST, ExportManifest, MadeFrom, versions
from .onnx_export import export_onnx
from .options import ExportOptions
from .parity import Comparison, ParityCheck, Tolerance, compare_outputs
from .precision import PRECISIONS, Precision
from .results import ExportResult, ModelExport
from .runners import BackendUnavailable, OnnxRuntimeRunner, Runner, TorchRunner

TRACE_BATCH = 2
#: ONNX parity batch sizes, both different from ``TRACE_BATCH``; their images are disjoint.
PARITY_BATCHES = (1, 8)


class ParityError(CorpError):
    """A backend's outputs differ from the reference beyond the tolerance."""

    exit_code = EXIT_GATE_FAILED


def default_export_dir(artifact: str | Path, precision: str) -> Path:
    """``<artifact>/export-<precision>``: exports live with the artifact they came from and are
    replaced with it."""
    return Path(artifact) / f"export-{precision}"


def export_artifact(
    artifact: str | Path | Artifact,
    out_dir: str | Path | None = None,
    options: ExportOptions | None = None,
    *,
    dense_model: nn.Module | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> ExportResult:
    """Export the compressed model of ``artifact`` (its folder, or the
    :class:`~corp_deploy.artifact.Artifact` read already; and its dense base with ``options.dense``).

    Writes ``model.onnx`` (``dense.onnx``), with ``options.trt`` also ``build_engine.sh`` and,
    where TensorRT and a CUDA GPU are present, ``model.engine`` (``dense.engine``), and
    ``export.json``. ``dense_model`` replaces the dense base rebuilt from the artifact's record.
    ``options.tolerance`` None applies :func:`gate_tolerance`'s defaults for the model.
    Raises :class:`ParityError` (nothing written) when a parity gate fails, and before any export
    when ``options.tolerance`` sets a limit the model's outputs cannot be measured on
    (:func:`check_measurable`).
    """
    options = ExportOptions() if options is None else options
    check_instance("options", options, ExportOptions)
    if dense_model is not None:
        check_instance("dense_model", dense_model, nn.Module)
        if not options.dense:
            raise BadUsage("dense_model is exported only with ExportOptions(dense=True); it would be ignored")
    precision = PRECISIONS[options.precision]
    artifact = Artifact.of(artifact)
    made_from = artifact.checksums  # before the model is loaded (and checked against it)
    out_dir = (
        checked_path(out_dir, "out_dir") if out_dir is not None else default_export_dir(artifact, options.precision)
    )
    check_output_dir(out_dir, "export", made_from=artifact.path)  # before any work
    _check_named_precision(out_dir, options.precision)
    _check_timing_cache_outside_outputs(options.timing_cache, out_dir)
    classifier = artifact.model.num_classes > 0  # known before any export: what the gate can measure
    tolerance = options.tolerance or gate_tolerance(precision, classifier)
    check_measurable(tolerance, classifier)
    models = _models(artifact, options, dense_model, log)
    input_size = artifact.input_size
    check_fits(
        "the export",
        sum(export_bytes(model, input_size) for model in models.values()),
        "export on a machine with more memory",
    )
    trt_missing = trt_backend.unavailable_reason() if options.trt else None
    engine_batches = sorted({options.batch.min, options.batch.opt, options.batch.max})
    n_images = max(sum(PARITY_BATCHES), sum(engine_batches) if options.trt and not trt_missing else 0)
    images = _parity_images(artifact.transform[0], n_images, held_out=precision.calibrates)
    with (
        tempfile.TemporaryDirectory(prefix="corp-deploy-export-") as scratch,
        staged_output(
            out_dir,
            "export",
            needs=sum(graph_bytes(model, precision) for model in models.values()),
            made_from=artifact.path,
        ) as tmp,
        ExitStack() as runners,
    ):
        run = _Run(
            folder=tmp,
            options=options,
            precision=precision,
            tolerance=tolerance,
            input_size=input_size,
            images=images,
            classifier=classifier,
            trt_missing=trt_missing,
            engine_batches=engine_batches,
            runners=runners,
            calibration=int8_calibration_images(artifact, options.int8, Path(scratch))
            if precision.calibrates
            else None,
            log=log,
        )
        entries, graph = {}, {}
        for name, model in models.items():
            entries[name], graph = _export_and_check(run, name, model)
        if options.trt:
            _write_build_script(tmp, list(models), options, input_size)
            if run.builds_engines:
                for name, model in models.items():
                    _build_and_check_engine(run, name, entries[name], model)
        if recorded_checksums(artifact.path) != made_from:
            raise CorpError(f"{artifact} was replaced while it was exported; nothing was written. Export it again")
        manifest = _manifest(artifact, made_from, graph, entries, options, run.tolerance, trt_missing)
        write_json(tmp / MANIFEST, manifest.to_dict())
    return ExportResult(out_dir, manifest, entries, run.incomplete)


def gate_tolerance(precision: Precision, classifier: bool, **limits: float | None) -> Tolerance:
    """The limits the parity gate holds an export to, and ``export.json`` records: ``precision``'s
    defaults that a model's outputs can be measured on (top-1 agreement only where the model has a
    ``classifier``: a feature model's default top-1 limit is not applied, so it is not claimed), each
    non-None value of ``limits`` (``min_cosine=0.99``) in its default's place. ParityError when a
    limit given cannot be measured (:func:`check_measurable`)."""
    defaults = precision.tolerance if classifier else replace(precision.tolerance, min_top1=None)
    tolerance = defaults.with_limits(**limits)
    check_measurable(tolerance, classifier)
    return tolerance


def check_measurable(tolerance: Tolerance, classifier: bool) -> None:
    """ParityError (exit status 4, as a gate on what was not measured fails in ``bench``), before
    anything is exported, when ``tolerance`` sets a limit that the parity gate cannot measure on the
    model's outputs: top-1 agreement without a ``classifier``. The gate would pass it unchecked while
    ``export.json`` recorded it as applied; whether the model has a classifier is known before the work."""
    if tolerance.min_top1 is not None and not classifier:
        raise ParityError(
            f"--min-top1 {tolerance.min_top1:g}: top-1 agreement cannot be measured on a model without a "
            "classifier (its outputs are features), and a limit on what is not measured is never met; gate "
            "the features with --min-cosine (the smallest per-image cosine) instead. Nothing was exported."
        )


def _models(
    artifact: Artifact, options: ExportOptions, dense_model: nn.Module | None, log: Callable[[str], None]
) -> dict[str, nn.Module]:
    """The models to export, by name: the compressed ``model`` and, with ``options.dense``, the
    ``dense`` one (``dense_model``, else rebuilt from the artifact's record; checked to be the base
    of ``model``); with int8 options, checked to leave each an int8 layer."""
    models = {"model": artifact.model}
    if options.dense:
        log("rebuilding the dense base model ...")
        models["dense"] = dense_model if dense_model is not None else artifact.dense()
        check_teacher(models["model"], models["dense"])  # dense.onnx must be the base of model.onnx
    if options.int8 is not None:
        _check_keep_float_leaves_int8(models, options.int8)
    return models


@dataclass
class _Run:
    """What every model of one export shares: the staging ``folder``, the settings, the parity
    gate's ``tolerance`` and ``images`` (``classifier``: top-1 agreement is measured), why TensorRT
    engines are not built (None: they are, or were not asked for) and their batch sizes, the
    runners kept open until the export ends, int8's ``calibration`` batches and their summary
    (None for another precision), and what is left ``incomplete``."""

    folder: Path
    options: ExportOptions
    precision: Precision
    tolerance: Tolerance
    input_size: tuple[int, ...]
    images: np.ndarray
    classifier: bool
    trt_missing: str | None
    engine_batches: list[int]
    runners: ExitStack
    calibration: tuple[SpooledBatches, dict] | None
    log: Callable[[str], None]
    incomplete: list[str] = field(default_factory=list)
    #: ONNX Runtime on each model's graph, kept open as its engine's reference.
    onnxruntime: dict[str, Runner] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.trt_missing:
            self.incomplete.append(f"TensorRT engines not built: {self.trt_missing}")

    @property
    def builds_engines(self) -> bool:
        return self.options.trt and not self.trt_missing


def _export_and_check(run: _Run, name: str, model: nn.Module) -> tuple[ModelExport, dict]:
    """Export ``model`` to ``<name>.onnx`` and gate it on ONNX Runtime against PyTorch (where the
    precision's ONNX Runtime device is here; else noted incomplete): its entry in ``export.json``
    and its graph's description."""
    options, path = run.options, run.folder / f"{name}.onnx"
    run.log(f"{name}: exporting ONNX ({options.exporter} exporter, opset {options.opset}, {options.precision}) ...")
    graph, int8 = _export_graph(run, model, path)
    run.log(f"{name}: checking ONNX Runtime against PyTorch at batch sizes {PARITY_BATCHES} ...")
    runner, reason = _onnxruntime_runner(path, run.precision)
    checked = {}
    if runner is None:
        run.incomplete.append(f"{name}.onnx not checked: {reason}")
    else:
        run.runners.enter_context(runner)
        with TorchRunner(model) as reference:
            checked = check_parity(
                f"{name}.onnx on ONNX Runtime vs PyTorch",
                reference,
                runner,
                run.images,
                PARITY_BATCHES,
                run.tolerance,
                run.classifier,
            )
        if run.builds_engines:
            run.onnxruntime[name] = runner  # the engine's reference, later
        else:
            runner.close()
    parity = ParityCheck(f"{name}.onnx", OnnxRuntimeRunner.name, TorchRunner.name, checked, skipped=reason)
    entry = ModelExport(
        onnx=graph["files"],
        params=count_params(model),
        macs=count_macs(model, run.input_size),
        parity=[parity],
        int8=int8,
    )
    return entry, graph


def _check_keep_float_leaves_int8(models: dict[str, nn.Module], int8: Int8Options) -> None:
    """BadUsage when ``--int8-keep-float N`` would keep every Linear layer of a model in float: an
    "int8" graph without an int8 layer (a value that does nothing, exit 2)."""
    if int8.keep_float == AUTO:
        return
    for key, model in models.items():
        linears = sum(isinstance(module, nn.Linear) for module in model.modules())
        if int8.keep_float >= linears:
            raise BadUsage(
                f"--int8-keep-float {int8.keep_float} would keep all {linears} Linear layers of "
                f"the {'dense' if key == 'dense' else 'compressed'} model in float, leaving no int8 "
                f"layer; give fewer than {linears}, or auto"
            )


def export_bytes(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """A lower bound on the memory exporting the loaded ``model`` adds: its ONNX graph and the ONNX
    Runtime session of that graph (a copy of the weights each), and the parity batch's inference."""
    return inference_bytes(model, input_size, max(PARITY_BATCHES)) + 2 * weight_bytes(model)


def parity_images(model: nn.Module, count: int, *, held_out: bool = False) -> np.ndarray:
    """``count`` calibration-like images ``(count, C, H, W)`` float32: seeded random crops of the
    photos bundled with scikit-image, preprocessed exactly as ``model`` expects; with ``held_out``
    only of the photos that built-in calibration never uses."""
    return _parity_images(model_transform(model)[0], count, held_out=held_out)


def _parity_images(transform: Callable, count: int, *, held_out: bool) -> np.ndarray:
    """:func:`parity_images` preprocessed by ``transform`` (the model's)."""
    photos = {"photos": HELD_OUT_PHOTOS} if held_out else {}
    images = CalibrationImages.from_builtin(transform, count=count, batch_size=count, seed=0, **photos)
    return next(iter(images)).numpy()


def _export_graph(run: _Run, model: nn.Module, path: Path) -> tuple[dict, dict | None]:
    """Export ``model`` to ``path`` in the run's precision: the graph's description and, for a
    precision that calibrates (int8), what the quantizer did (the float32 graph it starts from is
    written elsewhere and removed): quantized on the run's calibration batches, ``--int8-keep-float
    auto`` applying the gate's tolerance on them."""
    options, precision = run.options, run.precision
    export = dict(opset=options.opset, exporter=options.exporter, trace_batch=TRACE_BATCH)
    if not precision.calibrates:
        return export_onnx(model, path, run.input_size, precision=precision.name, **export), None
    batches, source = run.calibration
    int8 = options.int8
    with tempfile.TemporaryDirectory(prefix="corp-deploy-fp32-") as scratch:
        fp32 = Path(scratch) / path.name
        graph = export_onnx(model, fp32, run.input_size, precision="fp32", **export)
        release_freed_memory()  # the exporter's traced program and graph copies
        quantized = quantize_keeping_float(
            model,
            fp32,
            path,
            batches,
            int8.keep_float,
            int8.calibration,
            run.tolerance,
            run.log,
            int8.smoothing,
            int8.activations,
        )
    return {**graph, "files": [path.name], "precision": precision.name}, {**quantized, "source": source}


def _check_named_precision(out_dir: Path, precision: str) -> None:
    """CorpError for an export folder named after another precision (``export-fp32`` for fp16
    graphs): bench finds an artifact's graphs by those names, and would refuse it later."""
    named = out_dir.name.removeprefix("export-")
    if out_dir.name.startswith("export-") and named in PRECISIONS and named != precision:
        raise CorpError(
            f"{out_dir} is named for {named} graphs, and this export is {precision} (bench finds an artifact's "
            f"exports by those names); write it to export-{precision} or to a folder of another name"
        )


def _check_timing_cache_outside_outputs(cache: Path | None, out_dir: Path) -> None:
    """CorpError when the TensorRT timing cache (written after the build) would lie inside the
    export or another output, whose record would not list it."""
    if cache is None:
        return
    owner = resolve(out_dir) if resolve(out_dir) in cache.parents else enclosing_output(cache)
    if owner is not None:
        raise CorpError(
            f"--timing-cache {cache} lies inside {owner}, an output of corp-deploy, which holds only the files "
            "its record lists (TensorRT writes the cache after the build); keep the cache elsewhere"
        )


def graph_bytes(model: nn.Module, precision: Precision) -> int:
    """A lower bound on the bytes of ``model``'s ONNX graph in ``precision``: its weights in the
    traced dtype (an int8 graph: one byte per Linear weight, the rest in float32)."""
    if not precision.calibrates:
        return sum(t.numel() for t in model.state_dict().values()) * precision.dtype.itemsize
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return linear + (sum(t.numel() for t in model.state_dict().values()) - linear) * FLOAT32


def int8_calibration_images(artifact: Artifact, int8: Int8Options, folder: Path) -> tuple[SpooledBatches, dict]:
    """The batches int8 ranges are calibrated on, decoded once into ``folder`` for every graph and
    step (one batch in memory at a time), preprocessed as the artifact's model, and their summary:
    ``int8.calib`` or the artifact's own calibration source (a directory, or the built-in photos with
    the same seed)."""
    recorded = artifact.config
    spec = CalibrationSpec.recorded(
        recorded.calibration, recorded.settings, source=int8.calib, samples=int8.calib_samples, batch_size=DEFAULT_BATCH
    )
    transform, data_config = artifact.transform
    images = spec.images(transform)  # the files listed once, decoded below
    count = images.most
    check_disk(
        f"decoding {count} int8 calibration images",
        count * FLOAT32 * math.prod(data_config["input_size"]),
        folder,
        "use fewer --calib-samples, or point TMPDIR at a larger disk",
    )
    return SpooledBatches(images, folder), images.summary()


def check_parity(
    label: str,
    reference: Runner,
    candidate: Runner,
    images: np.ndarray,
    batches,
    tolerance: Tolerance,
    classifier: bool,
) -> dict[int, Comparison]:
    """Compare two runners on disjoint slices of ``images`` of each size in ``batches``.

    Returns ``{batch size: comparison}``; raises :class:`ParityError` with every number when any
    batch breaks ``tolerance``.
    """
    results, failures, start = {}, [], 0
    for b in batches:
        x = images[start : start + b]
        start += b
        result = compare_outputs(reference.infer(x), candidate.infer(x), top1=classifier)
        results[b] = result
        failures += [f"batch {b}: {v}" for v in tolerance.violations(result)]
    if failures:
        numbers = "; ".join(f"batch_{b}: {tolerance.measured(r)}" for b, r in results.items())
        raise ParityError(
            f"{label}: parity gate failed ({'; '.join(failures)}). Measured: {numbers}. "
            "Nothing was written. Loosen the limit that failed (--atol, --min-cosine, --min-top1) only if "
            "this precision loss is acceptable."
        )
    return results


def _onnxruntime_runner(path: Path, precision: Precision) -> tuple[OnnxRuntimeRunner | None, str | None]:
    """The ONNX Runtime reference for a graph in ``precision`` on its record's device, or (None,
    why not) where that device, not the CPU, is missing here."""
    if precision.onnxruntime_device == "cpu":
        return OnnxRuntimeRunner(path, "cpu"), None
    try:
        return OnnxRuntimeRunner(path, precision.onnxruntime_device), None
    except BackendUnavailable as exc:
        return None, (f"{precision.not_on_cpu} and {exc}; verify it on a GPU machine by running this export there")


def _write_build_script(folder: Path, names: list[str], options: ExportOptions, input_size) -> None:
    graphs = [f"{name}.onnx" for name in names]
    files = [f for graph in graphs for f in (graph, f"{graph}.data") if (folder / f).is_file()]
    script = folder / trt_backend.SCRIPT_NAME
    script.write_text(
        trt_backend.build_script(
            graphs,
            {f: sha256_file(folder / f) for f in files},
            batch=options.batch,
            image_shape=input_size,
            precision=PRECISIONS[options.precision],
            workspace_gb=options.workspace_gb,
            timing_cache=options.timing_cache,
        )
    )
    script.chmod(0o755)


def _build_and_check_engine(run: _Run, name: str, entry: ModelExport, model: nn.Module) -> None:
    """Build ``<name>.engine``, gate it against ONNX Runtime on the same graph (PyTorch on
    ``model`` where ONNX Runtime cannot run it, as bf16 on a machine without its device) and
    record both in ``entry``."""
    options, folder = run.options, run.folder
    reference = run.onnxruntime.get(name) or run.runners.enter_context(TorchRunner(model))
    run.log(f"{name}: building the TensorRT engine (batch {options.batch}) ...")
    entry.engine_build = trt_backend.build_engine(
        folder / f"{name}.onnx",
        folder / f"{name}.engine",
        batch=options.batch,
        image_shape=run.input_size,
        workspace_gb=options.workspace_gb,
        timing_cache=options.timing_cache,
    )
    entry.engine = f"{name}.engine"
    run.log(f"{name}: checking TensorRT against {reference.name} at batch sizes {tuple(run.engine_batches)} ...")
    with trt_backend.TensorRTRunner(folder / entry.engine) as engine:
        entry.parity.append(
            ParityCheck(
                entry.engine,
                engine.name,
                reference.name,
                check_parity(
                    f"{name}.engine on TensorRT vs {reference.name}",
                    reference,
                    engine,
                    run.images,
                    run.engine_batches,
                    run.tolerance,
                    run.classifier,
                ),
            )
        )


def _manifest(
    artifact: Artifact,
    made_from: dict[str, str],
    graph: dict,
    models: dict[str, ModelExport],
    options: ExportOptions,
    tolerance: Tolerance,
    trt_missing: str | None,
) -> ExportManifest:
    return ExportManifest(
        created=timestamp(),
        artifact=MadeFrom(
            path=str(artifact.path.resolve()),
            base_model=artifact.base_model.name,
            method=artifact.config.settings.get("method"),
            **made_from,
        ),
        precision=options.precision,
        exporter=graph["exporter"],
        opset=graph["opset"],
        inputs=graph["inputs"],
        outputs=graph["outputs"],
        dynamic_axes=graph["dynamic_axes"],
        data_config=artifact.config.input.data_config,
        parity_inputs={
            "images": "seeded random crops of scikit-image's bundled photos, preprocessed with the model's data config",
            "batches": list(PARITY_BATCHES),
        },
        tolerance=tolerance.to_dict(),
        models={name: entry.entry() for name, entry in models.items()},
        tensorrt={
            "requested": options.trt,
            "built": options.trt and trt_missing is None,
            "not_built_reason": trt_missing,
            "batch_profile": options.batch.to_dict(),
            "workspace_gb": options.workspace_gb,
            "timing_cache": str(Path(options.timing_cache).resolve()) if options.timing_cache else None,
            "script": trt_backend.SCRIPT_NAME if options.trt else None,
        },
        versions=versions(),
    )
