"""``bench`` with int8 exports: the dense and the compressed model, each as its fp32 and its int8
graph, timed in one interleaved loop on ONNX Runtime's CPU provider, and the fidelity of each
against the dense float32 PyTorch model on the evaluation images.

It needs the artifact's ``export-fp32`` and ``export-int8``, both made with ``--dense``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from corp_deploy import CorpError
from corp_deploy.artifact import Artifact
from corp_deploy.metrics import as_rows, cosine, top1_matches
from exporters.manifest import MANIFEST, model_files, read_manifest
from exporters.quantize import float_linear_layers
from exporters.runners import OnnxRuntimeRunner, Runner, TorchRunner

from .data import EvalImages
from .latency import interleaved, speedup, summarize
from .results import BenchSettings, Int8Fidelity, Int8Result, Int8Row, Ratio, Timing
from .targets import check_made_from

#: The four graphs, in timing order; the first is the reference of every speedup.
VARIANTS = ("dense-fp32", "dense-int8", "compressed-fp32", "compressed-int8")
_MODEL_KEYS = {"dense": "dense", "compressed": "model"}


@dataclass(frozen=True)
class Int8Graphs:
    """What ``bench`` finds of an artifact's int8 export: ``graphs``, the ONNX file of every
    :data:`VARIANTS` entry, when the set is complete; else ``skipped``, why not, when an int8
    export exists. Neither: there is no int8 export, nothing to report."""

    graphs: dict[str, Path] = field(default_factory=dict)
    skipped: str | None = None


def int8_graphs(artifact: Path | Artifact) -> Int8Graphs:
    """The int8 and fp32 graphs of the artifact's exports (:class:`Int8Graphs`)."""
    int8 = Path(artifact) / "export-int8"
    if not (int8 / MANIFEST).is_file():
        return Int8Graphs()
    graphs = {}
    for precision in ("fp32", "int8"):
        folder = Path(artifact) / f"export-{precision}"
        if not (folder / MANIFEST).is_file():
            return Int8Graphs(
                skipped=f"no {folder.name}/ beside export-int8/ (run `corp-deploy export ARTIFACT --dense`)"
            )
        manifest = read_manifest(folder)
        check_made_from(artifact, folder, manifest)
        for model, key in _MODEL_KEYS.items():
            if key not in manifest.models:
                return Int8Graphs(skipped=f"{folder.name}/ has no dense graph (export it with --dense)")
            graphs[f"{model}-{precision}"] = model_files(folder, manifest, key)["onnx"]
    return Int8Graphs(graphs={name: graphs[name] for name in VARIANTS})


def run_int8_bench(
    graphs: dict[str, Path],
    dense: torch.nn.Module,
    eval_set: EvalImages,
    settings: BenchSettings,
    log: Callable[[str], None] = lambda message: None,
) -> Int8Result:
    """Latency rows (one per batch size: percentiles of each graph, and per-round speedups over
    dense fp32 and of int8 over fp32 for each model), fidelity of every graph against ``dense``
    (PyTorch, float32), the graphs' file sizes, and how many Linear layers each int8 graph keeps
    in float (which its speed depends on)."""
    image_shape = (3, *dense.patch_embed.img_size)
    rows = []
    with ExitStack() as stack:
        runners = {
            name: stack.enter_context(OnnxRuntimeRunner(path, "cpu", settings.threads)) for name, path in graphs.items()
        }
        for batch in settings.batches:
            log(f"ort-cpu, batch {batch}: timing dense and compressed, fp32 and int8, interleaved ...")
            x = np.random.default_rng(0).standard_normal((batch, *image_shape), dtype=np.float32)
            samples = interleaved(
                {name: (lambda r=runner: r.infer(x)) for name, runner in runners.items()},
                warmup=settings.warmup,
                min_time=settings.min_time,
                min_rounds=settings.min_rounds,
            )
            rows.append(
                Int8Row(
                    batch=batch,
                    timings={name: Timing(**summarize(samples[name], batch)) for name in VARIANTS},
                    speedup_over_dense_fp32={
                        name: Ratio(**speedup(samples["dense-fp32"], samples[name])) for name in VARIANTS[1:]
                    },
                    int8_over_fp32={
                        model: Ratio(**speedup(samples[f"{model}-fp32"], samples[f"{model}-int8"]))
                        for model in _MODEL_KEYS
                    },
                )
            )
        log("int8 fidelity on the evaluation images ...")
        fidelity = _fidelity(runners, dense, eval_set)
    return Int8Result(
        latency=rows,
        fidelity=fidelity,
        bytes={name: _graph_bytes(path) for name, path in graphs.items()},
        kept_float={name: _kept_float(path) for name, path in graphs.items() if name.endswith("int8")},
    )


def _fidelity(runners: dict[str, Runner], dense: torch.nn.Module, eval_set: EvalImages) -> dict[str, Int8Fidelity]:
    """Per graph against dense fp32 PyTorch: mean and min per-image output cosine and, for
    classifiers, top-1 agreement."""
    classifier = dense.num_classes > 0
    cosines: dict[str, list[np.ndarray]] = {name: [] for name in runners}
    agree: dict[str, list[np.ndarray]] = {name: [] for name in runners}
    with TorchRunner(dense) as reference_runner:
        for images, _ in eval_set:
            x = images.numpy()
            reference = as_rows(reference_runner.infer(x))
            for name, runner in runners.items():
                out = as_rows(runner.infer(x))
                cosines[name].append(cosine(reference, out))
                agree[name].append(top1_matches(reference, out))
    if not any(len(c) for c in cosines["dense-fp32"]):
        raise CorpError("no evaluation images for the int8 fidelity")
    return {
        name: Int8Fidelity(
            cosine_mean=float(np.concatenate(cosines[name]).mean()),
            cosine_min=float(np.concatenate(cosines[name]).min()),
            top1_agreement=float(np.concatenate(agree[name]).mean()) if classifier else None,
        )
        for name in runners
    }


def _graph_bytes(path: Path) -> int:
    """An ONNX file's size with its external weights (``<name>.data``) if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _kept_float(path: Path) -> int:
    """How many Linear layers the int8 graph ``path`` computes in float, counted in the graph."""
    return len(float_linear_layers(path))
