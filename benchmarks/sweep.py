"""``corp-deploy sweep``: compress at several sparsities, export, benchmark, and tabulate.

Like the paper's accuracy-vs-sparsity figure and efficiency table: for each sparsity the
parameters, MACs, MAC-ideal and measured speedups, and the fidelity to the dense model with
CORP's compensation and (optionally) without it (the same channels, only sliced).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from torch import nn

from corp_deploy import CalibrationImages, CompressConfig, compress, model_transform, save_artifact
from corp_deploy.files import staged_directory, write_json
from exporters import ExportOptions, export_artifact

from .backends import ModelFiles
from .data import EvalImages, eval_images
from .harness import BenchSettings, fidelity, run_bench
from .report import fidelity_summary

FORMAT, FORMAT_VERSION = "corp-deploy-sweep", 1
SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep and how to measure it (the dense model itself is given to ``run_sweep``)."""

    sparsities: tuple[float, ...]
    target: str = "both"
    compare_uncompensated: bool = False
    calib: Path | None = None
    calib_samples: int = 256
    data: Path | None = None
    data_samples: int = 256
    seed: int = 0
    bench: BenchSettings = field(default_factory=BenchSettings)

    def __post_init__(self) -> None:
        for sparsity in self.sparsities:
            self.config(sparsity)  # CorpError for a sparsity out of range

    def config(self, sparsity: float, compensation: bool = True) -> CompressConfig:
        return CompressConfig(s_mlp=sparsity, s_attn=sparsity, target=self.target, compensation=compensation)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(calib=str(self.calib) if self.calib else None, data=str(self.data) if self.data else None)
        return out


def run_sweep(dense: nn.Module, base_model: dict, spec: SweepSpec, out_dir: str | Path,
              log: Callable[[str], None] = lambda message: None) -> dict:
    """Run the sweep into ``out_dir`` (written atomically): one artifact (with its export) per
    sparsity under ``s<S>/``, plus ``sweep.json``, ``sweep.md`` and ``sweep.png``."""
    transform, _ = model_transform(dense)
    calibration = CalibrationImages.from_source(spec.calib, transform, limit=spec.calib_samples, seed=spec.seed)
    calib_batches = list(calibration)
    evaluation = eval_images(spec.data, transform, limit=spec.data_samples, seed=spec.seed)
    decoded = list(evaluation)  # decode once, reuse for every sparsity
    evaluation = EvalImages(lambda: iter(decoded), evaluation.description, evaluation.labelled)
    held_out = not (spec.data and spec.calib and Path(spec.data).resolve() == Path(spec.calib).resolve())
    classifier = dense.num_classes > 0
    rows, dense_onnx = [], None
    with staged_directory(out_dir, SWEEP_FILE) as tmp:
        for s in spec.sparsities:
            log(f"s={s:g}: compressing ...")
            model, report = compress(dense, calib_batches, spec.config(s))
            settings = {**spec.config(s).to_dict(), "calib_samples": spec.calib_samples, "seed": spec.seed}
            artifact = save_artifact(model, tmp / f"s{s:g}", base_model=base_model, report=report,
                                     settings=settings, calibration=calibration.summary())
            log(f"s={s:g}: exporting ...")
            export = export_artifact(artifact, None, ExportOptions(dense=dense_onnx is None), dense_model=dense,
                                     log=log)
            dense_onnx = dense_onnx or export.out_dir / "dense.onnx"
            bench = run_bench(ModelFiles(model, export.out_dir / "model.onnx"), ModelFiles(dense, dense_onnx),
                              evaluation, spec.bench, held_out=held_out, log=log)
            row = {"sparsity": s, "params": report["params"], "macs": report["macs"],
                   "ideal_speedup": bench["ideal_speedup"], "latency": bench["latency"],
                   "fidelity": bench["fidelity"], "bench": bench}
            if spec.compare_uncompensated:
                log(f"s={s:g}: the same channels without compensation ...")
                sliced, _ = compress(dense, calib_batches, spec.config(s, compensation=False))
                row["fidelity_uncompensated"] = fidelity(dense, sliced, evaluation, classifier)
            rows.append(row)
            log(f"s={s:g}: " + fidelity_summary(bench))
        result = {"format": FORMAT, "format_version": FORMAT_VERSION,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_model": base_model,
                  "spec": spec.to_dict(), "machine": rows[0]["bench"]["machine"],
                  "versions": rows[0]["bench"]["versions"], "classifier": classifier, "rows": rows}
        write_json(tmp / SWEEP_FILE, result)
        (tmp / "sweep.md").write_text(to_markdown(result))
        plot(result, tmp / "sweep.png")
    return result


def headline(row: dict, key: str = "fidelity") -> float | None:
    """The one fidelity number a sweep plots: accuracy when labelled, else top-1 agreement
    (classifiers), else feature cosine."""
    f = row.get(key)
    if f is None:
        return None
    if f.get("accuracy"):
        return f["accuracy"]["compressed"]["top1"]
    return f["top1_agreement"] if f["top1_agreement"] is not None else f["feature_cosine"]


def headline_name(result: dict) -> str:
    first = result["rows"][0]["fidelity"]
    if first.get("accuracy"):
        return "top-1 accuracy"
    return "top-1 agreement with dense" if result["classifier"] else "feature cosine to dense"


def to_markdown(result: dict) -> str:
    name = headline_name(result)
    batches = result["spec"]["bench"]["batches"]
    backends = sorted({r["backend"] for row in result["rows"] for r in row["latency"]})
    header = ["s", "params (M)", "GMACs", "MAC-ideal speedup",
              *[f"{b} speedup b{n} (of ideal)" for b in backends for n in batches], f"{name} CORP"]
    if result["spec"]["compare_uncompensated"]:
        header.append(f"{name} uncompensated")
    lines = [f"# corp-deploy sweep: {result['base_model']['name']}", "",
             f"Target {result['spec']['target']}; {result['created']}; machine {result['machine']['cpu']}, "
             f"{result['machine']['torch_threads']} threads.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result["rows"]:
        cells = [f"{row['sparsity']:g}", f"{row['params']['compressed'] / 1e6:.2f}",
                 f"{row['macs']['compressed'] / 1e9:.3f}", f"{row['ideal_speedup']:.3f}"]
        by_key = {(r["backend"], r["batch"]): r for r in row["latency"]}
        for b in backends:
            for n in batches:
                r = by_key.get((b, n))
                cells.append(f"{r['speedup']['median']:.3f} ({r['efficiency'] * 100:.0f}%)" if r else "-")
        cells.append(f"{headline(row):.4f}")
        if result["spec"]["compare_uncompensated"]:
            cells.append(f"{headline(row, 'fidelity_uncompensated'):.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    first = result["rows"][0]
    lines += ["", f"Dense: {first['params']['dense'] / 1e6:.2f} M parameters, {first['macs']['dense'] / 1e9:.3f} GMACs. "
                  "Per-sparsity bench reports (latency percentiles, parity, all fidelity numbers) are in sweep.json.", ""]
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    """Fidelity vs sparsity (with and without compensation), size vs sparsity, speedup vs sparsity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    s = [row["sparsity"] for row in rows]
    fig, (fid, size, speed) = plt.subplots(1, 3, figsize=(14, 4))
    fid.plot(s, [headline(row) for row in rows], "-o", label="CORP")
    if result["spec"]["compare_uncompensated"]:
        fid.plot(s, [headline(row, "fidelity_uncompensated") for row in rows], "--o", label="uncompensated")
    fid.set_ylabel(headline_name(result))
    size.plot(s, [100 * row["params"]["compressed"] / row["params"]["dense"] for row in rows], "-o", label="parameters")
    size.plot(s, [100 * row["macs"]["compressed"] / row["macs"]["dense"] for row in rows], "-o", label="MACs")
    size.set_ylabel("% of dense")
    speed.plot(s, [row["ideal_speedup"] for row in rows], ":k", label="MAC-ideal")
    for backend in sorted({r["backend"] for row in rows for r in row["latency"]}):
        batch = max(r["batch"] for r in rows[0]["latency"] if r["backend"] == backend)
        speed.plot(s, [next(r["speedup"]["median"] for r in row["latency"]
                            if r["backend"] == backend and r["batch"] == batch) for row in rows],
                   "-o", label=f"{backend}, batch {batch}")
    speed.set_ylabel("speedup over dense")
    for ax, title in ((fid, "Fidelity"), (size, "Size"), (speed, "Measured speedup")):
        ax.set_xlabel("sparsity")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['base_model']['name']} ({result['spec']['target']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
