"""``corp-deploy bench``: latency, parity and fidelity of a compressed model against its dense base.

The result is one :class:`~benchmarks.results.BenchReport` (see ``run_bench``); ``benchmarks.report``
renders it and ``benchmarks.gate`` compares it with a baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import numpy as np
import torch

from corp_deploy import count_macs, count_params
from corp_deploy.documents import Machine, timestamp
from exporters.manifest import versions
from exporters.parity import Comparison, compare_outputs
from exporters.runners import TorchRunner

from .attention_kernels import attention_kernels, kernel_summary
from .backends import ModelFiles, open_runners
from .data import EvalImages
from .fidelity import FidelityMeter, features_and_logits
from .latency import interleaved, speedup, summarize
from .results import MODELS, BackendStatus, BenchReport, BenchSettings, Fidelity, LatencyRow, ModelEntry, Ratio, Timing


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
    on the CPU in float32), the attention kernels each PyTorch backend ran, a latency row per
    backend and batch size, and the fidelity of ``compressed``
    against ``dense`` on ``eval_set`` (``held_out`` says whether those images were kept out of
    calibration).
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
        runners, skipped = open_runners(settings.backends, models, stack, settings.threads, settings.torch_precision)
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
    """``{backend: {model: kernels}}``: the attention kernels each PyTorch runner's model ran on
    ``images`` (:func:`benchmarks.attention_kernels.kernel_summary`)."""
    return {
        name: {
            key: kernel_summary(attention_kernels(r.model, torch.from_numpy(images).to(r.device, r.dtype)))
            for key, r in group.items()
        }
        for name, group in runners.items()
        if isinstance(next(iter(group.values())), TorchRunner)
    }


def _latency_row(
    backend: str, group: dict, batch: int, image_shape, ideal: float, settings: BenchSettings, log
) -> LatencyRow:
    log(f"{backend}, batch {batch}: timing dense and compressed, interleaved ...")
    x = np.random.default_rng(0).standard_normal((batch, *image_shape), dtype=np.float32)
    samples = interleaved(
        {key: (lambda r=group[key]: r.infer(x)) for key in MODELS},
        warmup=settings.warmup,
        min_time=settings.min_time,
        min_rounds=settings.min_rounds,
    )
    ratio = Ratio(**speedup(samples["dense"], samples["compressed"]))
    return LatencyRow(
        backend=backend,
        batch=batch,
        dense=Timing(**summarize(samples["dense"], batch)),
        compressed=Timing(**summarize(samples["compressed"], batch)),
        speedup=ratio,
        ideal_speedup=ideal,
        efficiency=ratio.median / ideal,
    )


def fidelity(dense: torch.nn.Module, compressed: torch.nn.Module, eval_set: EvalImages, classifier: bool) -> dict:
    """:class:`FidelityMeter` results of ``compressed`` against ``dense`` over ``eval_set`` (PyTorch, CPU)."""
    meter = FidelityMeter(classifier)
    for images, labels in eval_set:
        meter.update(features_and_logits(dense, images), features_and_logits(compressed, images), labels)
    return meter.result()
