"""``corp-deploy bench``: latency, parity and fidelity of a compressed model against its dense base.

The result is one :class:`~benchmarks.results.BenchReport` (see ``run_bench``); ``benchmarks.report``
renders it and ``benchmarks.gate`` compares it with a baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from corp_deploy import count_macs, count_params
from corp_deploy.documents import Machine, timestamp
from corp_deploy.resources import FLOAT32, check_fits, onnxruntime_bytes, resident_bytes, resident_peak
from exporters.manifest import versions
from exporters.parity import Comparison, compare_outputs
from exporters.runners import TorchRunner
from exporters.torch_compile import CompiledTorchRunner

from .attention_kernels import attention_kernels, kernel_summary
from .backends import ACTIVATION_BYTES, DEVICE_RESIDENT, ModelFiles, RunnerSettings, open_runners, row_timings
from .data import EvalImages
from .fidelity import FidelityMeter, features_and_logits
from .latency import interleaved, speedup, summarize
from .results import (
    MODELS,
    BackendStatus,
    BenchReport,
    BenchSettings,
    Fidelity,
    Figure,
    LatencyRow,
    ModelEntry,
    Ratio,
    Timing,
)


def run_bench(
    compressed: ModelFiles,
    dense: ModelFiles,
    eval_set: EvalImages,
    settings: BenchSettings,
    *,
    held_out: bool,
    log: Callable[[str], None] = lambda message: None,
) -> BenchReport:
    """Measure ``compressed`` against ``dense`` and return the report (:class:`BenchReport`): the
    machine, versions and settings, both models' sizes, the MAC-ideal speedup, each backend's
    status (ran, or the reason it was skipped), parity (each model on each backend against PyTorch
    on the CPU in float32), the attention kernels each eager PyTorch backend ran, a latency row per
    backend and batch size (timed as :func:`~benchmarks.backends.row_timings` says), and the
    fidelity of ``compressed`` against ``dense`` on ``eval_set`` (``held_out`` says whether those
    images were kept out of calibration).
    """
    if settings.threads:
        torch.set_num_threads(settings.threads)
    models = {"dense": dense, "compressed": compressed}
    image_shape = (3, *compressed.torch.patch_embed.img_size)
    entries = model_entries(dense, compressed)
    classifier = compressed.torch.num_classes > 0
    created, machine = timestamp(), Machine.here()
    ideal = entries["dense"].macs / entries["compressed"].macs
    parity_x = _first_images(eval_set, settings.parity_images)
    with ExitStack() as stack:
        shapes = tuple(dict.fromkeys([*((batch, *image_shape) for batch in settings.batches), parity_x.shape]))
        opening = RunnerSettings(settings.threads, settings.torch_precision, settings.cuda_graphs, shapes)
        if "torch-compile" in settings.backends:
            log(f"torch-compile: compiling each model for each of {len(shapes)} input shapes (inductor) ...")
        runners, skipped = open_runners(settings.backends, models, stack, opening)
        if "ort-cpu" in runners:
            check_onnxruntime_timing(runners["ort-cpu"], models, image_shape, max(settings.batches), log)
        backends = {
            **{name: BackendStatus("ran") for name in runners},
            **{name: BackendStatus("skipped", why) for name, why in skipped.items()},
        }
        parity = _parity(runners, models, parity_x, classifier)
        attention = _attention(runners, parity_x)
        latency = [
            _latency_row(name, group, batch, image_shape, ideal, settings, log)
            for name, group in runners.items()
            for batch in settings.batches
        ]
    log("fidelity on the evaluation images ...")
    measured = fidelity(dense.torch, compressed.torch, eval_set, classifier)
    return BenchReport(
        created=created,
        machine=machine,
        versions=versions(),
        settings=settings,
        models=entries,
        ideal_speedup=ideal,
        backends=backends,
        parity=parity,
        attention=attention,
        latency=latency,
        fidelity=Fidelity.from_dict({**measured, "data": eval_set.description, "held_out": held_out}),
    )


#: What the probe runs of :func:`onnxruntime_growth` hold at their larger batch by the lower bound
#: (:func:`~corp_deploy.resources.onnxruntime_bytes`; ONNX Runtime really holds 1.3-8x that): enough
#: that the arena's chunks (1 MB and up) and the first run's buffers are small beside it.
PROBE_BYTES = 64 * 2**20


#: How much more than a session's extrapolated working memory its arena may hold: ONNX Runtime's CPU
#: arena extends itself in doubling steps (its default ``kNextPowerOfTwo``), so at a large batch it can
#: reserve up to twice what the runs need. Without it, bench of the tests' ViT at batch 65536 passed the
#: check (both sessions extrapolated to about 20 GB, 21 GB available) and was then killed by the kernel at
#: more than 23 GB resident.
ARENA_GROWTH = 2


@dataclass(frozen=True)
class SessionGrowth:
    """What one ONNX Runtime session added to the process's resident memory by running twice at
    each of two ``batches`` in turn (``held``: bytes above its resident memory before, each the
    peak while that batch ran: so the second includes what the first batch's runs left)."""

    batches: tuple[int, int]
    held: tuple[int, int]

    @property
    def per_image(self) -> float:
        """The bytes each further image adds: the slope between the two batches."""
        (b1, b2), (m1, m2) = self.batches, self.held
        return max(0.0, (m2 - m1) / (b2 - b1))

    def at(self, batch: int) -> int:
        """What the session will hold once it has run at ``batch`` too: the line through the two
        measurements, extrapolated."""
        return max(self.held[1], round(self.held[1] + self.per_image * (batch - self.batches[1])))


def probe_batches(model: torch.nn.Module, image_shape: tuple[int, ...], element: int = FLOAT32) -> tuple[int, int]:
    """The two batches :func:`onnxruntime_growth` runs ``model``'s graph at: the larger the largest
    power of two (at least 4) whose lower bound stays within :data:`PROBE_BYTES`, the smaller a
    quarter of it. For the small ViT of the tests (26 KB an image) 512 and 2048; for DeiT-B at 224
    px (4.8 MB) 2 and 8."""
    per_image = max(1, onnxruntime_bytes(model, image_shape, 1, element))
    larger = 4
    while 2 * larger * per_image <= PROBE_BYTES:
        larger *= 2
    return larger // 4, larger


def onnxruntime_growth(runner, batches: tuple[int, int], image_shape: tuple[int, ...]) -> SessionGrowth | None:
    """Measure what ONNX Runtime ``runner``'s session holds after running at each of ``batches``
    (:class:`SessionGrowth`): one run at batch 1 first (the thread pool and the buffers a first run
    makes, not counted), then two at each batch, the second as every later one runs (the memory
    pattern ONNX Runtime plans from the first adds its own block). None where this process's
    resident memory cannot be read (not Linux). The runs are the runner's own, on random images, as
    parity's are: they leave what any run leaves in the session (its arena's chunks, the shapes'
    memory patterns), nothing that changes how a later batch runs."""
    rng = np.random.default_rng(0)
    runner.infer(rng.standard_normal((1, *image_shape), dtype=np.float32))
    images = [rng.standard_normal((batch, *image_shape), dtype=np.float32) for batch in batches]
    before = resident_bytes()
    held = []
    for x in images:
        peak = resident_peak(lambda x=x: (runner.infer(x), runner.infer(x)))
        if before is None or peak is None:
            return None
        held.append(max(0, peak - before))
    return SessionGrowth(tuple(batches), tuple(held))


def check_onnxruntime_timing(
    group: dict, models: dict[str, ModelFiles], image_shape: tuple[int, ...], batch: int, log: Callable[[str], None]
) -> None:
    """CorpError (the pre-check's, :func:`~corp_deploy.resources.check_fits`) before any timing when
    ONNX Runtime's CPU sessions ``group`` cannot time at ``batch``: each session's memory measured at
    two small batches (:func:`onnxruntime_growth`) and extrapolated per image to ``batch``, both
    sessions at once (each keeps what its runs allocated while the other runs), and the input batch,
    against the memory available. The lower bound checked before any image was read
    (:func:`benchmarks.pipeline.timing_bytes`) is all there is where ``batch`` is no larger than the
    probes' or the resident memory cannot be read (not Linux). Measured on the small ViT of the tests,
    the extrapolation from 512 and 2048 images (1024 and 4096 for its compressed form) is within 1% of
    what a session holds at 8192 (187 KB an image, 99 KB compressed)."""
    element = {key: ACTIVATION_BYTES.get(models[key].precision, FLOAT32) for key in group}
    probes = {key: probe_batches(models[key].torch, image_shape, element[key]) for key in group}
    if any(probes[key][1] >= batch for key in group):
        return
    log(f"ort-cpu: measuring each session's memory at batches {sorted(set(sum(probes.values(), ())))} ...")
    grown = {key: onnxruntime_growth(runner, probes[key], image_shape) for key, runner in group.items()}
    if any(g is None for g in grown.values()):
        return
    check_fits(
        f"timing at batch {batch}",
        batch * FLOAT32 * math.prod(image_shape) + ARENA_GROWTH * sum(g.at(batch) for g in grown.values()),
        f"ONNX Runtime's arena grows in doubling steps, so its sessions count {ARENA_GROWTH}x what their runs at "
        "small batches extrapolate to; use smaller --batch sizes",
    )


def model_entries(dense: ModelFiles, compressed: ModelFiles) -> dict[str, ModelEntry]:
    """What a report records of each model (by :data:`~benchmarks.results.MODELS` name): its
    parameters, MACs per image, files and their precision, exporter and opset."""
    image_shape = (3, *compressed.torch.patch_embed.img_size)
    return {
        name: ModelEntry(
            params=count_params(m.torch),
            macs=count_macs(m.torch, image_shape),
            onnx=str(m.onnx) if m.onnx else None,
            engine=str(m.engine) if m.engine else None,
            precision=m.precision,
            exporter=m.exporter,
            opset=m.opset,
        )
        for name, m in {"dense": dense, "compressed": compressed}.items()
    }


def _first_images(eval_set: EvalImages, count: int) -> np.ndarray:
    taken, n = [], 0
    for images, _ in eval_set:
        taken.append(images[: count - n])
        n += len(taken[-1])
        if n >= count:
            break
    return torch.cat(taken).numpy()


def _parity(
    runners: dict, models: dict[str, ModelFiles], images: np.ndarray, classifier: bool
) -> dict[str, dict[str, Comparison]]:
    """Each model on each backend against PyTorch on the CPU in float32, on the same images (a
    ``torch-cpu`` runner in float32 is that reference, and is not compared with itself)."""
    out = {}
    for key, model in models.items():
        with TorchRunner(model.torch) as torch_cpu:
            reference = torch_cpu.infer(images)
        out[key] = {
            name: compare_outputs(reference, group[key].infer(images), top1=classifier)
            for name, group in runners.items()
            if not (name == "torch-cpu" and group[key].dtype == torch.float32)
        }
    return out


def _attention(runners: dict, images: np.ndarray) -> dict[str, dict[str, str]]:
    """``{backend: {model: kernels}}``: the attention kernels each eager PyTorch runner's model ran on
    ``images`` (:func:`benchmarks.attention_kernels.kernel_summary`; a CUDA graph replays what its
    capture ran; inductor writes kernels of its own, not recorded)."""
    return {
        name: {
            key: kernel_summary(attention_kernels(r.model, torch.from_numpy(images).to(r.device, r.dtype)))
            for key, r in group.items()
        }
        for name, group in runners.items()
        if type(next(iter(group.values()))) is TorchRunner
    }


def _latency_row(
    backend: str, group: dict, batch: int, image_shape, ideal: float, settings: BenchSettings, log
) -> LatencyRow:
    log(f"{backend}, batch {batch}: timing dense and compressed, interleaved ...")
    x = np.random.default_rng(0).standard_normal((batch, *image_shape), dtype=np.float32)
    main, *other = [_figure(timing, group, x, settings) for timing in row_timings(backend, settings.timing)]
    compiled = {key: r.compile_s[batch] for key, r in group.items() if isinstance(r, CompiledTorchRunner)}
    return LatencyRow(
        backend=backend,
        batch=batch,
        timing=main.timing,
        dense=main.dense,
        compressed=main.compressed,
        speedup=main.speedup,
        ideal_speedup=ideal,
        efficiency=main.speedup.median / ideal,
        second=other[0] if other else None,
        compile_s=compiled or None,
    )


def _figure(timing: str, group: dict, x: np.ndarray, settings: BenchSettings) -> Figure:
    """Dense and compressed timed interleaved on ``x`` one way: device-resident (each runner's
    :meth:`~exporters.runners.Runner.device_call`, timed by its CUDA events), else host to host
    (``infer`` on the images in the host memory the runners copy from fastest, wall-clock)."""
    if timing == DEVICE_RESIDENT:
        runs = {key: group[key].device_call(x) for key in MODELS}
    else:
        host = group[MODELS[0]].host_images(x)
        runs = {key: (lambda r=group[key]: r.infer(host)) for key in MODELS}
    samples = interleaved(
        runs,
        warmup=settings.warmup,
        min_time=settings.min_time,
        min_rounds=settings.min_rounds,
        timed=timing == DEVICE_RESIDENT,
    )
    return Figure(
        timing=timing,
        dense=Timing(**summarize(samples["dense"], len(x))),
        compressed=Timing(**summarize(samples["compressed"], len(x))),
        speedup=Ratio(**speedup(samples["dense"], samples["compressed"])),
    )


def fidelity(dense: torch.nn.Module, compressed: torch.nn.Module, eval_set: EvalImages, classifier: bool) -> dict:
    """:class:`FidelityMeter` results of ``compressed`` against ``dense`` over ``eval_set`` (PyTorch, CPU)."""
    meter = FidelityMeter(classifier)
    for images, labels in eval_set:
        meter.update(features_and_logits(dense, images), features_and_logits(compressed, images), labels)
    return meter.result()
