"""A standalone measurement of an artifact's dense and compressed models, to check ``bench``'s
device-resident figure against (issue 63): plain PyTorch, no runner of the project's, the images
made on the device, CUDA events around each forward.

    python -m lab.studies.cuda_events ARTIFACT --device cuda --precision fp16 --batch 64 \\
        --bench OUT/bench_fp16_b64.json --out OUT/cuda_events_fp16_b64.json

Both models in ``--precision`` on ``--device``, 5 untimed rounds, then ``--rounds`` rounds in which
each model runs once (the order alternating), timed by a pair of CUDA events recorded on the
current stream around the call and waited for (on the CPU, where there are no events, wall-clock
around a call: the dry run of lab/studies/gpu_timing.sh). ``speedup``: the median of the
per-round ratios dense / compressed. With ``--bench``, bench's row of the same backend, batch and
``device-resident`` timing (``cpu`` on the CPU) is read and ``bench_over_standalone`` = bench's
median speedup / this one's (issue 63's goal: within 5 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from corp_deploy.artifact import Artifact
from corp_deploy.documents import Machine, library_versions
from corp_deploy.files import write_json
from exporters.runners import TORCH_PRECISIONS


def forward_seconds(model: torch.nn.Module, x: torch.Tensor) -> float:
    """One forward of ``model`` on ``x`` in seconds: CUDA events on CUDA, wall-clock on the CPU."""
    if x.device.type != "cuda":
        start = time.perf_counter()
        model(x)
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@torch.no_grad()
def measure(models: dict[str, torch.nn.Module], x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds per forward of each model, ``rounds`` rounds after 5 untimed ones, order alternating."""
    names, seconds = list(models), {name: [] for name in models}
    for r in range(5 + rounds):
        for name in names if r % 2 == 0 else reversed(names):
            took = forward_seconds(models[name], x)
            if r >= 5:
                seconds[name].append(took)
    return seconds


def bench_speedup(path: Path, backend: str, batch: int, timing: str) -> float:
    """The median speedup of ``backend``'s row at ``batch`` timed ``timing`` in the bench report
    ``path`` (the row's own figure or its second one)."""
    for row in json.loads(path.read_text())["latency"]:
        if row["backend"] == backend and row["batch"] == batch:
            for figure in (row, row.get("second") or {}):
                if figure.get("timing") == timing:
                    return figure["speedup"]["median"]
    raise SystemExit(f"{path} has no {backend} row at batch {batch} timed {timing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp16", choices=list(TORCH_PRECISIONS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--bench", type=Path, help="a bench JSON report of the same artifact to compare with")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), TORCH_PRECISIONS[args.precision]
    artifact = Artifact.of(args.artifact)
    models = {"dense": artifact.dense(), "compressed": artifact.model}
    models = {name: m.eval().to(device, dtype) for name, m in models.items()}
    size = models["dense"].patch_embed.img_size
    x = torch.randn(args.batch, 3, *size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    seconds = measure(models, x, args.rounds)
    ratios = [d / c for d, c in zip(seconds["dense"], seconds["compressed"], strict=True)]
    result = {
        "command": "python -m lab.studies.cuda_events " + " ".join(sys.argv[1:]),
        "machine": Machine.here().to_dict(),
        "versions": library_versions(),
        "precision": args.precision,
        "batch": args.batch,
        "rounds": args.rounds,
        "ms": {name: round(statistics.median(s) * 1e3, 4) for name, s in seconds.items()},
        "speedup": round(statistics.median(ratios), 4),
    }
    if args.bench is not None:
        cuda = device.type == "cuda"
        backend, timing = ("torch-cuda", "device-resident") if cuda else ("torch-cpu", "cpu")
        result["bench_speedup"] = bench_speedup(args.bench, backend, args.batch, timing)
        result["bench_over_standalone"] = round(result["bench_speedup"] / result["speedup"], 4)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
