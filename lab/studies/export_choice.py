"""Which ONNX exporter and opset should `corp-deploy export` use by default?

For each model (dense and CORP-compressed, random weights: the graph, not the accuracy,
is measured) and each exporter/opset: export wall time, graph size (nodes, op types),
ONNX Runtime parity against PyTorch at two batch sizes other than the traced one, and
ONNX Runtime CPU latency, with all variants of one model timed **interleaved** in the
same process (round-robin, median of the rounds) so that ratios survive a noisy machine.

    python -m lab.studies.export_choice --models deit_small deit_base --batch 8 --rounds 7 \
        --json lab/results/export_choice.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from corp_deploy import CompressConfig, compress, create_base_model
from exporters.onnx_export import export_onnx
from exporters.parity import compare_outputs

VARIANTS = [("torchscript", 17), ("torchscript", 18), ("dynamo", 18), ("dynamo", 20)]


def calibration(n: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 3, 224, 224, generator=g) for _ in range(n // 8)]


def measure_model(name: str, model: torch.nn.Module, batch: int, rounds: int, threads: int, work: Path) -> dict:
    inputs = {b: torch.randn(b, 3, 224, 224) for b in (1, batch)}
    with torch.no_grad():
        refs = {b: model(x).numpy() for b, x in inputs.items()}
    rows, sessions = {}, {}
    for exporter, opset in VARIANTS:
        key = f"{exporter}-opset{opset}"
        path = work / f"{name}-{key}.onnx"
        start = time.perf_counter()
        export_onnx(model, path, (3, 224, 224), opset=opset, exporter=exporter)
        export_s = time.perf_counter() - start
        graph = onnx.load(str(path), load_external_data=False).graph
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        errors = [
            compare_outputs(refs[b], session.run(None, {"images": x.numpy()})[0]).max_abs for b, x in inputs.items()
        ]
        sessions[key] = session
        rows[key] = {
            "exporter": exporter,
            "opset": opset,
            "export_s": round(export_s, 2),
            "file_mb": round(path.stat().st_size / 2**20, 1),
            "nodes": len(graph.node),
            "op_types": dict(Counter(n.op_type for n in graph.node).most_common()),
            "max_abs_error": max(errors),
            "latency_s": [],
        }
    feed = {"images": inputs[batch].numpy()}
    for session in sessions.values():  # warm-up
        session.run(None, feed)
    for _ in range(rounds):  # interleaved: every variant once per round
        for key, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feed)
            rows[key]["latency_s"].append(time.perf_counter() - start)
    base = statistics.median(rows["torchscript-opset17"]["latency_s"])
    for row in rows.values():
        med = statistics.median(row["latency_s"])
        row["latency_median_s"] = round(med, 4)
        row["latency_vs_torchscript17"] = round(med / base, 3)
        row["latency_s"] = [round(t, 4) for t in row["latency_s"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["deit_small"])
    parser.add_argument("--s", type=float, default=0.5, help="joint sparsity of the compressed variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {
        "command": "python -m lab.studies.export_choice "
        + " ".join(
            f"--models {' '.join(args.models)} --s {args.s} --batch {args.batch} "
            f"--rounds {args.rounds} --threads {args.threads}".split()
        ),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            dense = create_base_model(name, pretrained=False, seed=0)
            compressed, _ = compress(dense, calibration(), CompressConfig(s_mlp=args.s, s_attn=args.s))
            for label, model in (("dense", dense), (f"corp-s{args.s:g}", compressed)):
                rows = measure_model(f"{name}-{label}", model, args.batch, args.rounds, args.threads, Path(work))
                results["models"][f"{name} {label}"] = rows
                for key, row in rows.items():
                    print(
                        f"{name:12s} {label:10s} {key:20s} export {row['export_s']:6.2f}s  "
                        f"nodes {row['nodes']:5d}  err {row['max_abs_error']:.1e}  "
                        f"ORT b{args.batch} {row['latency_median_s']:.3f}s "
                        f"(x{row['latency_vs_torchscript17']:.3f})",
                        flush=True,
                    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
