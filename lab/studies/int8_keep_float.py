"""What keeping Linear layers in float costs and buys in int8 (the recipe of exporters/quantize.py):
an export's fp32 graph quantized with the N Linear layers of largest own int8 rounding error kept
in float (``exporters.keep_float.linear_sensitivity``, as ``export --int8-keep-float N``), for
several N; per N the output cosine to the fp32 PyTorch model on held-out photos and the latency,
every graph (fp32 first) timed interleaved on ONNX Runtime's CPU provider.

    python -m lab.studies.int8_keep_float ARTIFACT --graph dense --keep 0,2,4,8,12,16,24 \
      --out lab/results/int8_keep_float_dinov2_dense.json

``ARTIFACT`` needs an ``export-fp32/`` made with ``--dense`` (for ``--graph dense``). Calibration:
the built-in calibration photos (``--calib`` seeded crops); evaluation: crops of the held-out photos.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.latency import interleaved, speedup
from corp_deploy.documents import Machine
from exporters.keep_float import linear_sensitivity
from exporters.quantize import quantize_int8
from exporters.runners import OnnxRuntimeRunner
from lab.studies.int8_common import cosines, int8_study_parser, load_int8_study


def main() -> None:
    parser = int8_study_parser(__doc__.splitlines()[0])
    parser.add_argument("--keep", default="0,2,4,8,12,16", help="numbers of Linear layers kept in float")
    args = parser.parse_args()

    fp32, model, calibration, images = load_int8_study(args)
    with torch.no_grad():
        reference = model(torch.from_numpy(images)).numpy().astype(np.float64)
    ranking = linear_sensitivity(model, calibration)
    runners, rows = {"fp32": OnnxRuntimeRunner(fp32, "cpu", args.threads)}, []
    with tempfile.TemporaryDirectory() as scratch:
        for keep in (int(k) for k in args.keep.split(",")):
            path = Path(scratch) / f"keep{keep}.onnx"
            kept = set(ranking[:keep])
            quantize_int8(fp32, path, (b.numpy() for b in calibration), float_modules=kept)
            runners[f"keep {keep}"] = runner = OnnxRuntimeRunner(path, "cpu", args.threads)
            cosine = cosines(reference, runner.infer(images))
            rows.append(
                {
                    "keep_float": keep,
                    "kept": sorted(kept),
                    "cosine_mean": float(cosine.mean()),
                    "cosine_min": float(cosine.min()),
                }
            )
            print(f"keep {keep:3d}: cosine mean {cosine.mean():.4f} min {cosine.min():.4f}", flush=True)
        x = np.random.default_rng(0).standard_normal((args.batch, *images.shape[1:]), dtype=np.float32)
        samples = interleaved(
            {name: (lambda r=runner: r.infer(x)) for name, runner in runners.items()}, min_time=args.min_time
        )
    for row in rows:
        name = f"keep {row['keep_float']}"
        row["p50_s"] = float(np.median(samples[name]))
        row["speedup_over_fp32"] = speedup(samples["fp32"], samples[name])
        print(
            f"{name}: speedup over fp32 {row['speedup_over_fp32']['median']:.2f} "
            f"({row['speedup_over_fp32']['p10']:.2f}-{row['speedup_over_fp32']['p90']:.2f})",
            flush=True,
        )
    args.out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "graph": args.graph,
                "linear_layers": len(ranking),
                "calibration_images": args.calib,
                "held_out_images": args.images,
                "batch": args.batch,
                "threads": args.threads,
                "machine": Machine.here().to_dict(),
                "fp32_p50_s": float(np.median(samples["fp32"])),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
