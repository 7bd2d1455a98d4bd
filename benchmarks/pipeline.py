"""What ``corp-deploy bench`` runs: a compressed artifact (or its export) against its dense base,
end to end: the models and images checked, latency, parity and fidelity measured
(:func:`benchmarks.harness.run_bench`), the int8 graphs when the artifact has them, and the gate."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.artifact import recorded_checksums
from corp_deploy.calibration import copies_named
from corp_deploy.resources import FLOAT32, check_fits, inference_bytes, onnxruntime_bytes

from .attention_kernels import lost_kernel_warnings
from .backends import ACTIVATION_BYTES, ModelFiles
from .data import check_labels, eval_images
from .gate import GateLimits, check_comparable, check_gates, check_same_data, read_baseline, regressions
from .harness import model_entries, run_bench
from .int8 import Int8Graphs, int8_graphs, run_int8_bench
from .results import BenchReport, BenchSettings, GateResult, Int8Result
from .targets import calibration_overlap, copied_calibration_images, find_target, load_models


def timing_bytes(
    dense: ModelFiles, compressed: ModelFiles, input_size: tuple[int, ...], settings: BenchSettings
) -> int:
    """A lower bound on the memory timing at the largest batch of ``settings`` needs: one eager
    PyTorch inference of the dense model (:func:`~corp_deploy.resources.inference_bytes`) or, when
    ONNX Runtime's CPU provider times both exported graphs, the input batch and both sessions'
    working memory at once (each keeps what its runs allocated while the other runs:
    :func:`~corp_deploy.resources.onnxruntime_bytes`), whichever is more. ONNX Runtime really holds
    1.3-8x its bound: once the sessions are open, :func:`benchmarks.harness.check_onnxruntime_timing`
    checks the batch again against their memory, measured."""
    batch = max(settings.batches)
    needed = inference_bytes(dense.torch, input_size, batch)
    if "ort" in settings.backends and dense.onnx and compressed.onnx:  # ort-cpu runs wherever ort does
        sessions = sum(
            onnxruntime_bytes(m.torch, input_size, batch, ACTIVATION_BYTES.get(m.precision, FLOAT32))
            for m in (dense, compressed)
        )
        needed = max(needed, batch * FLOAT32 * math.prod(input_size) + sessions)
    return needed


def bench_target(
    target: Path | None,
    settings: BenchSettings,
    limits: GateLimits,
    *,
    data: Path | None,
    data_samples: int,
    baseline: Path | None,
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> BenchReport:
    """The bench report of ``target`` (an artifact or an export folder; None: the most recent
    artifact) on ``data`` (held-out images; None: the bundled photos kept out of calibration),
    with the gate's verdict (:class:`~benchmarks.results.GateResult`): whether it passed and the
    regressions found against ``limits`` and the ``baseline`` report. ``log`` says what is being
    done, ``warn`` what the user should know (evaluation images that overlap calibration,
    unreadable files). CorpError before any timing for a bad baseline (or one that measured other
    things: :func:`~benchmarks.gate.check_comparable`; or whose fidelity was measured on other
    images: :func:`~benchmarks.gate.check_same_data`), target or data; after the run for a baseline
    of as many images as an unlabelled folder turns out to hold (its count is known once its files
    are read) or an artifact replaced while it ran (its record's checksums are in the report:
    ``artifact``)."""
    previous = read_baseline(baseline) if baseline is not None else None
    if previous is not None:
        check_gates(previous, baseline, limits)
    artifact, export_dir = find_target(target)
    log(
        f"benchmarking {artifact}"
        + (f" with the export {export_dir}" if export_dir else " (no export found: ONNX Runtime and TensorRT need one)")
    )
    made_from = artifact.checksums  # read before the models; the same after the run
    compressed, dense = load_models(artifact, export_dir)
    transform, data_config = artifact.transform
    check_fits(
        f"timing at batch {max(settings.batches)}",
        timing_bytes(dense, compressed, tuple(data_config["input_size"]), settings),
        "use smaller --batch sizes",
    )
    evaluation = eval_images(data, transform, limit=data_samples)
    if previous is not None:  # of the images, what is known before they are read; all of it after the run
        entries = model_entries(dense, compressed)
        check_comparable(previous, baseline, settings, entries, evaluation.description, limits)
    check_labels(evaluation, compressed.torch.num_classes)
    held_out = not calibration_overlap(artifact, evaluation.description)
    if not held_out:
        warn("the evaluation images overlap the calibration images; fidelity is not held out")
    int8 = int8_graphs(artifact) if "ort" in settings.backends else Int8Graphs()
    report = run_bench(compressed, dense, evaluation, settings, held_out=held_out, log=log)
    report.artifact = made_from
    copies, other_bytes = copied_calibration_images(artifact, evaluation.digests, evaluation.pixel_digests)
    if copies and held_out:  # known only once the evaluation files were read
        report.fidelity.held_out = False
        warn(
            f"{copies} of the evaluation images {copies_named(copies, other_bytes, 'calibration images')}; "
            "fidelity is not held out"
        )
    for message in lost_kernel_warnings(report.attention, compressed.torch, dense.torch):
        warn(message)
    evaluated = report.fidelity.data
    if evaluated.get("files_skipped"):
        warn(
            f"skipped {evaluated['files_skipped']} unreadable evaluation files "
            f"({'; '.join(evaluated['skipped_examples'][:3])})"
        )
    if not report.latency:
        warn("nothing was timed: every backend asked for was skipped (each with its reason in the results)")
    if int8.skipped is not None:
        report.int8 = Int8Result(skipped=int8.skipped)
    elif int8.graphs:
        report.int8 = run_int8_bench(int8.graphs, dense.torch, evaluation, settings, log)
    if recorded_checksums(artifact.path) != made_from:
        raise CorpError(
            f"{artifact} was replaced while it was benchmarked: the numbers are of a model that is no longer "
            "there, so no report was written; run bench again"
        )
    if previous is not None:
        check_same_data(previous, baseline, report.fidelity.data if report.fidelity else {}, limits)
    found = regressions(report, limits, previous)
    report.gate = GateResult(str(baseline) if baseline else None, limits.to_dict(), not found, found)
    return report
