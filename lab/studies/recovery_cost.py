"""What a recovery step costs on this machine: steps per second and peak memory, with and without
activation checkpointing and with a number of DataLoader workers making the views, on a model
compressed uniformly (random weights: the cost does not depend on them; ``--model dinov2`` is the
real DINOv2 ViT-S/14).

    python -m lab.studies.recovery_cost --model deit_base_patch16_224 --steps 4 \\
        --out lab/results/recovery_cost_deit_base.json
    python -m lab.studies.recovery_cost --model dinov2 --calib PHOTO_SET/train --images 195 \\
        --workers-list 0,2 --checkpointings off --steps 20 --out lab/results/recovery_cost_workers.json

The images are crops of the bundled photos, or with ``--calib DIR`` up to ``--images`` files of a
folder (then the views are made from the files, decoded once, as ``compress --calib DIR`` does).

Each setting runs in its own process, so that one's freed memory is not counted in the next's
peak. Peak memory is the process's resident peak (``VmHWM``) over the recovery alone: reset
(``/proc/self/clear_refs``) once the models are built and compressed. On CUDA it is torch's
peak allocated memory over the recovery. The time per step is the wall time between the first
and the last validation measurement divided by the steps (it includes the last measurement, on
``validation`` of ``--images`` images).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from corp_deploy import CompressConfig, compress, create_base_model, model_transform
from corp_deploy.calibration import CalibrationImages
from corp_deploy.files import write_json
from corp_deploy.recovery import RecoveryConfig, recover
from lab.real_weights import build_dinov2


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")


def one_setting(args: argparse.Namespace) -> dict:
    """Compress, then time ``args.steps`` recovery steps with the setting asked; the row."""
    device = torch.device(args.device)
    dense = build_dinov2() if args.model == "dinov2" else create_base_model(args.model, pretrained=False, seed=0)
    dense = dense.to(device)
    transform = model_transform(dense)[0]
    if args.calib is None:
        images = CalibrationImages.from_builtin(transform, count=args.images, batch_size=args.batch)
    else:
        images = CalibrationImages.from_directory(args.calib, transform, limit=args.images, batch_size=args.batch)
    student, _ = compress(dense, images, CompressConfig.from_settings(sparsity=args.s, device=args.device))
    student = student.to(device)  # compress returns its model on the CPU
    config = RecoveryConfig(
        steps=args.steps,
        batch_size=args.batch,
        eval_every=args.steps,
        checkpointing=args.checkpointing,
        autocast_bf16=args.precision == "bf16",
        workers=args.workers,
    )
    times = []
    reset_peak(device)
    recover(
        student, copy.deepcopy(dense), images, config, on_measure=lambda step, model: times.append(time.perf_counter())
    )
    seconds = (times[-1] - times[0]) / args.steps
    return {
        "checkpointing": args.checkpointing,
        "precision": args.precision,
        "workers": args.workers,
        "seconds_per_step": round(seconds, 3),
        "steps_per_s": round(1 / seconds, 4),
        "peak_memory_mib": round(peak_bytes(device) / 2**20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_base_patch16_224")
    parser.add_argument("--s", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16 (bf16 autocast, CUDA only)")
    parser.add_argument("--checkpointings", default="off,on", help="comma-separated: off, on")
    parser.add_argument("--workers-list", default="2", help="comma-separated numbers of view workers")
    parser.add_argument("--calib", type=Path, help="a folder of images (default: crops of the bundled photos)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(one_setting(args)))
        return
    if args.out is None:
        parser.error("--out is required")
    common = [f"--model={args.model}", f"--s={args.s}", f"--steps={args.steps}", f"--batch={args.batch}"]
    common += [f"--images={args.images}", f"--device={args.device}", "--worker"]
    common += [f"--calib={args.calib}"] if args.calib else []
    rows = []
    for precision, checkpointing, workers in itertools.product(
        args.precisions.split(","), args.checkpointings.split(","), args.workers_list.split(",")
    ):
        command = [sys.executable, "-m", "lab.studies.recovery_cost", *common, f"--precision={precision}"]
        command += [f"--workers={workers}"] + ["--checkpointing"] * (checkpointing == "on")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    command = "python -m lab.studies.recovery_cost " + " ".join(sys.argv[1:])
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    write_json(
        args.out,
        {
            "command": command,
            "machine": machine,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": args.model,
            "s": args.s,
            "batch_size": args.batch,
            "steps": args.steps,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
