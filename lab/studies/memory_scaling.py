"""Peak memory and time of `compress` against model size and calibration images: how far one
process goes on this machine (random weights, built-in calibration images, uniform s = 0.5).

    python -m lab.studies.memory_scaling --models vit_base_patch16_224,vit_large_patch16_224,\\
vit_giant_patch14_dinov2 --images 8,32 --out lab/results/memory_scaling.json

Each (model, images) point runs in a fresh process, so its peak RSS is its own: the process's peak
resident memory, the dense model's size (float32 parameters), one forward pass over the same
images and the compress wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from corp_deploy.documents import library_versions

POINT = r"""
import json, resource, sys, time
import torch
from corp_deploy import CalibrationImages, CompressConfig, compress, create_base_model, model_transform
name, images = sys.argv[1], int(sys.argv[2])
args = {"img_size": 224} if "dinov2" in name else {}
model = create_base_model(name, args, pretrained=False, seed=0)
transform, _ = model_transform(model)
batches = list(CalibrationImages.from_builtin(transform, count=images, batch_size=8))
megabytes = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.perf_counter()
with torch.no_grad():
    for x in batches:
        model(x)
forward_s = time.perf_counter() - start
before = megabytes()
start = time.perf_counter()
compressed, report = compress(model, batches, CompressConfig(s_mlp=0.5, s_attn=0.5))
print(json.dumps({"model": name, "images": images, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                  "model_mb": sum(p.numel() for p in model.parameters()) * 4 / 2**20,
                  "forward_s": round(forward_s, 2), "compress_s": round(time.perf_counter() - start, 1),
                  "rss_before_compress_mb": round(before), "peak_rss_mb": round(megabytes())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit_base_patch16_224,vit_large_patch16_224,vit_giant_patch14_dinov2")
    parser.add_argument("--images", default="8,32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        for images in args.images.split(","):
            done = subprocess.run(
                [sys.executable, "-c", POINT, model, images], check=True, capture_output=True, text=True
            )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": f"python -m lab.studies.memory_scaling --models {args.models} --images {args.images} "
                f"--out {args.out}",
                "versions": library_versions(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
