"""``corp-deploy bench``: latency, parity and fidelity of a compressed model against its dense base.

The result is one JSON-ready dict (see ``run_bench``); ``benchmarks.report`` renders it and
``benchmarks.gate`` compares it with a baseline.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import numpy as np
import torch

from corp_deploy import count_macs, count_params
from exporters.manifest import versions
from exporters.parity import compare_outputs
from exporters.runners import TorchRunner

from .backends import FAMILIES, ModelFiles, open_runners
from .data import EvalImages
from .fidelity import FidelityMeter, features_and_logits
from .latency import interleaved, speedup, summarize

FORMAT, FORMAT_VERSION = "corp-deploy-bench", 1
MODELS = ("dense", "compressed")


@dataclass(frozen=True)
class BenchSettings:
    """How to measure. ``min_time``: seconds each model is timed per backend and batch size
    (at least ``min_rounds`` interleaved rounds after ``warmup``); ``threads``: CPU threads
    for PyTorch and ONNX Runtime (None: PyTorch's default); ``parity_images``: held-out
    images on which every backend is compared with PyTorch on the CPU."""

    backends: tuple[str, ...] = FAMILIES
    batches: tuple[int, ...] = (1, 8, 32)
    threads: int | None = None
    warmup: int = 3
    min_time: float = 2.0
    min_rounds: int = 5
    parity_images: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


def run_bench(
    compressed: ModelFiles,
    dense: ModelFiles,
    eval_set: EvalImages,
    settings: BenchSettings,
    *,
    held_out: bool,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Measure ``compressed`` against ``dense`` and return the report.

    Report keys: ``machine``, ``versions``, ``settings``, ``models`` (params, MACs),
    ``ideal_speedup`` (dense MACs / compressed MACs), ``backends`` (``ran`` or the reason it
    was skipped), ``latency`` (one row per backend and batch size: percentiles and throughput
    of both models, the per-round speedup with its spread, and ``efficiency`` = measured /
    ideal speedup), ``parity`` (each model on each backend against PyTorch on the CPU) and
    ``fidelity`` (compressed vs dense on ``eval_set``; ``held_out`` says whether those images
    were kept out of calibration).
    """
    if settings.threads:
        torch.set_num_threads(settings.threads)
    models = {"dense": dense, "compressed": compressed}
    image_shape = (3, *compressed.torch.patch_embed.img_size)
    macs = {name: count_macs(m.torch, image_shape) for name, m in models.items()}
    classifier = compressed.torch.num_classes > 0
    report = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": versions(),
        "settings": settings.to_dict(),
        "models": {
            name: {
                "params": count_params(m.torch),
                "macs": macs[name],
                "onnx": str(m.onnx) if m.onnx else None,
                "engine": str(m.engine) if m.engine else None,
            }
            for name, m in models.items()
        },
        "ideal_speedup": macs["dense"] / macs["compressed"],
    }
    parity_x = _first_images(eval_set, settings.parity_images)
    with ExitStack() as stack:
        runners, skipped = open_runners(settings.backends, models, stack, settings.threads)
        report["backends"] = {
            **{name: {"status": "ran"} for name in runners},
            **{name: {"status": "skipped", "reason": why} for name, why in skipped.items()},
        }
        report["parity"] = _parity(runners, models, parity_x, classifier)
        report["latency"] = [
            _latency_row(name, group, batch, image_shape, report["ideal_speedup"], settings, log)
            for name, group in runners.items()
            for batch in settings.batches
        ]
    log("fidelity on the evaluation images ...")
    report["fidelity"] = {
        **fidelity(dense.torch, compressed.torch, eval_set, classifier),
        "data": eval_set.description,
        "held_out": held_out,
    }
    return report


def machine() -> dict:
    """What ran the benchmark: CPU model and cores, threads, GPU."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _first_images(eval_set: EvalImages, count: int) -> np.ndarray:
    taken, n = [], 0
    for images, _ in eval_set:
        taken.append(images[: count - n])
        n += len(taken[-1])
        if n >= count:
            break
    return torch.cat(taken).numpy()


def _parity(runners: dict, models: dict[str, ModelFiles], images: np.ndarray, classifier: bool) -> dict:
    """Each model on each backend against PyTorch on the CPU, on the same images."""
    out = {}
    for key, model in models.items():
        with TorchRunner(model.torch) as torch_cpu:
            reference = torch_cpu.infer(images)
        out[key] = {
            name: compare_outputs(reference, group[key].infer(images), top1=classifier).to_dict()
            for name, group in runners.items()
            if name != "torch-cpu"
        }
    return out


def _latency_row(
    backend: str, group: dict, batch: int, image_shape, ideal: float, settings: BenchSettings, log
) -> dict:
    log(f"{backend}, batch {batch}: timing dense and compressed, interleaved ...")
    x = np.random.default_rng(0).standard_normal((batch, *image_shape), dtype=np.float32)
    samples = interleaved(
        {key: (lambda r=group[key]: r.infer(x)) for key in MODELS},
        warmup=settings.warmup,
        min_time=settings.min_time,
        min_rounds=settings.min_rounds,
    )
    ratio = speedup(samples["dense"], samples["compressed"])
    return {
        "backend": backend,
        "batch": batch,
        **{key: summarize(samples[key], batch) for key in MODELS},
        "speedup": ratio,
        "ideal_speedup": ideal,
        "efficiency": ratio["median"] / ideal,
    }


def fidelity(dense: torch.nn.Module, compressed: torch.nn.Module, eval_set: EvalImages, classifier: bool) -> dict:
    """:class:`FidelityMeter` results of ``compressed`` against ``dense`` over ``eval_set`` (PyTorch, CPU)."""
    meter = FidelityMeter(classifier)
    for images, labels in eval_set:
        meter.update(features_and_logits(dense, images), features_and_logits(compressed, images), labels)
    return meter.result()
