"""Which Linear layers lose the most in int8 (the recipe of exporters/quantize.py): an export's
fp32 graph quantized with one group of Linear layers kept in float at a time (by kind: qkv, proj,
fc1, fc2; then by block), and each int8 graph's output cosine to the fp32 graph on held-out photos.

    python -m lab.studies.int8_sensitivity ARTIFACT --graph dense --out lab/results/int8_sensitivity.json

``ARTIFACT`` needs an ``export-fp32/`` made with ``--dense`` (for ``--graph dense``). Calibration:
the built-in calibration photos (64 seeded crops); evaluation: crops of the held-out photos.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from corp_deploy import CalibrationImages, load_base_model, model_transform
from exporters.manifest import read_manifest
from exporters.pipeline import parity_images
from exporters.quantize import quantize_int8
from exporters.runners import OnnxRuntimeRunner

KINDS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--graph", choices=("dense", "model"), default="dense")
    parser.add_argument("--calib", type=int, default=64)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    export = args.artifact / "export-fp32"
    fp32 = export / read_manifest(export).models[args.graph].onnx[0]
    model = load_base_model(args.artifact)
    transform, _ = model_transform(model)
    calibration = [b.numpy() for b in CalibrationImages.from_builtin(transform, count=args.calib, batch_size=16)]
    images = parity_images(model, args.images, held_out=True)
    reference = OnnxRuntimeRunner(fp32, "cpu").infer(images)
    blocks = len(model.blocks)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    groups = {
        "none (every Linear int8)": set(),
        **{f"{kind} float": {p for p in linears if p.endswith(kind)} for kind in KINDS},
        **{f"block {b} float": {p for p in linears if p.startswith(f"blocks.{b}.")} for b in range(blocks)},
    }
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, float_modules in groups.items():
            path = Path(scratch) / "int8.onnx"
            quantize_int8(fp32, path, iter(calibration), float_modules=float_modules)
            out = OnnxRuntimeRunner(path, "cpu").infer(images)
            cosine = (reference * out).sum(1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(out, axis=1))
            rows.append({"kept_float": label, "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())})
            print(f"{label:28s} cosine mean {cosine.mean():.4f} min {cosine.min():.4f}", flush=True)
    args.out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "graph": args.graph,
                "calibration_images": args.calib,
                "held_out_images": args.images,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
