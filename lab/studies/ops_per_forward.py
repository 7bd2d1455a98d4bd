"""The host work of one forward, dense against compressed (issue 63): ATen operators dispatched and,
on CUDA, kernels launched (:func:`lab.host_work.forward_ops`), and the time of a forward at a
small batch, each compressed variant timed interleaved with the dense model.

    python -m lab.studies.ops_per_forward --model deit_small_patch16_224 --device cpu \\
        --out lab/results/ops_per_forward_deit_small.json

Seeded random weights (counts and speed do not depend on them), compressed on ``--device`` from the
built-in photos: ``s0.5`` (uniform s = 0.5: query/key heads pruned, values kept, unequal head dims)
and ``s0.5-equal`` (``--target all --equal-head-dims``). ``ms``: the median wall time of a forward
waited for (on CUDA, ``torch.cuda.synchronize`` after each), the images already on the device;
``speedup``: the median per-round ratio to dense. On the CPU the unequal head dims run PyTorch's math
attention kernel (flash needs equal dims), so their counts include its operators.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.latency import interleaved, speedup, summarize
from corp_deploy import CalibrationImages, CompressConfig, compress, create_base_model, model_transform
from corp_deploy.documents import Machine, library_versions
from corp_deploy.files import write_json
from exporters.runners import TORCH_PRECISIONS
from lab.host_work import forward_ops

VARIANTS = {
    "s0.5": {"sparsity": 0.5},
    "s0.5-equal": {"sparsity": 0.5, "target": "all", "equal_head_dims": True},
}


def timed_forward(model: torch.nn.Module, x: torch.Tensor):
    """A call of ``model(x)`` without gradients that waits for the device."""

    @torch.no_grad()
    def run() -> None:
        model(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precisions", default="fp32")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--images", type=int, default=16, help="calibration images")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds each model is timed per cell")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    start = time.perf_counter()
    dense = create_base_model(args.model, pretrained=False, seed=0).to(device)
    image_shape = (3, *dense.patch_embed.img_size)
    images = CalibrationImages.from_builtin(model_transform(dense)[0], count=args.images, batch_size=16)
    models = {"dense": dense}
    for name in args.variants.split(","):
        config = CompressConfig.from_settings(device=args.device, **VARIANTS[name])
        models[name] = compress(dense, images, config)[0].to(device)  # compress returns its model on the CPU
    result = {
        "command": "python -m lab.studies.ops_per_forward " + " ".join(sys.argv[1:]),
        "machine": Machine.here().to_dict(),
        "versions": library_versions(),
        "cells": [],
    }
    for precision in args.precisions.split(","):
        cast = {name: copy.deepcopy(m).eval().to(device, TORCH_PRECISIONS[precision]) for name, m in models.items()}
        for batch in (int(b) for b in args.batches.split(",")):
            generator = torch.Generator(device).manual_seed(1)
            x = torch.randn(batch, *image_shape, device=device, generator=generator).to(TORCH_PRECISIONS[precision])
            samples = interleaved({name: timed_forward(m, x) for name, m in cast.items()}, min_time=args.min_time)
            cell = {"precision": precision, "batch": batch, "models": {}}
            for name, m in cast.items():
                entry = {**forward_ops(m, x).to_dict(), "ms": round(summarize(samples[name], batch)["p50_s"] * 1e3, 4)}
                if name != "dense":
                    entry["speedup"] = round(speedup(samples["dense"], samples[name])["median"], 4)
                cell["models"][name] = entry
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            write_json(args.out, result)  # after every cell: a run stopped at its time limit keeps what it measured
    result["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
