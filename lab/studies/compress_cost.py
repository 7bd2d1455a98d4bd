"""Cost of `compress` relative to one plain forward pass over the same calibration images.

    python -m lab.studies.compress_cost --model deit_base --images 256 --rounds 2 \
        --out lab/results/compress_cost_deit_base.json
    python -m lab.studies.compress_cost --model deit_base --images 256 --rounds 2 --modes independent,budget \
        --macs 0.6 --out lab/results/compress_cost_deit_base_budget.json
    python -m lab.studies.compress_cost --model deit_base --images 256 --rounds 1 --modes independent,budget \
        --macs 0.6 --device cuda --out lab/results/compress_cost_deit_base_cuda.json

Images are preprocessed once up front (decoding is not timed); random weights (timing does
not depend on them). Forward passes and compress runs of the chosen modes are interleaved in
one process (F I F S F I F S F for two rounds of ``independent,sequential``), so that the
ratios are robust on a shared, noisy machine: each compress time is divided by the mean of
the forward passes just before and after it; the summary gives the median ratio per mode.
Modes: ``independent`` and ``sequential`` compress at joint sparsity --s (MLP and query/key);
``budget`` compresses to --macs with the defaults of budget mode; ``independent-refit-none`` and
``budget-refit-none`` are the same without the drift refit (docs/method.md §10).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from corp_deploy import CalibrationImages, CompressConfig, compress, create_base_model, model_transform
from corp_deploy.documents import library_versions


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_forward(model, batches, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        for x in batches:
            model(x)
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_base")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--s", type=float, default=0.5)
    parser.add_argument("--macs", type=float, default=0.6, help="the budget of mode 'budget'")
    parser.add_argument("--modes", default="independent,sequential")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the forward passes and the calibration run (images are moved there once)",
    )
    parser.add_argument("--full-warmup", action="store_true", help="untimed forward pass over all images first")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_base_model(args.model, pretrained=False).to(args.device)
    transform, _ = model_transform(model)
    batches = [
        b.to(args.device)
        for b in CalibrationImages.from_builtin(transform, count=args.images, batch_size=args.batch_size)
    ]
    if args.full_warmup:
        timed_forward(model, batches, args.device)  # the first full pass over new tensors runs slow
    else:
        timed_forward(model, batches[:1], args.device)

    modes = args.modes.split(",")
    settings = {
        "independent": dict(s_mlp=args.s, s_attn=args.s),
        "independent-refit-none": dict(s_mlp=args.s, s_attn=args.s, refit="none"),
        "sequential": dict(s_mlp=args.s, s_attn=args.s, calibration="sequential"),
        "budget": dict(macs=args.macs),
        "budget-refit-none": dict(macs=args.macs, refit="none"),
    }
    configs = {mode: CompressConfig.from_settings(**setting, device=args.device) for mode, setting in settings.items()}
    forwards = [timed_forward(model, batches, args.device)]
    runs = []
    for mode in modes * args.rounds:
        synchronize(args.device)
        start = time.perf_counter()
        _, report = compress(model, batches, configs[mode])
        total = time.perf_counter() - start
        forwards.append(timed_forward(model, batches, args.device))
        forward = (forwards[-2] + forwards[-1]) / 2
        runs.append(
            {
                "mode": mode,
                "compress_s": round(total, 2),
                "forward_s": round(forward, 2),
                "ratio": round(total / forward, 3),
                "phases_s": report["time_s"],
                "peak_memory_mb": report["peak_memory_mb"],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    result = {
        "command": f"python -m lab.studies.compress_cost --model {args.model} --images {args.images} "
        f"--batch-size {args.batch_size} --s {args.s} --macs {args.macs} --modes {args.modes} "
        f"--rounds {args.rounds} --device {args.device}{' --full-warmup' if args.full_warmup else ''} "
        f"--out {args.out}",
        "median_ratio": {mode: statistics.median(r["ratio"] for r in runs if r["mode"] == mode) for mode in modes},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "versions": library_versions(),
        "forward_passes_s": [round(f, 2) for f in forwards],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
