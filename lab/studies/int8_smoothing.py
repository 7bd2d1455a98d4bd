"""What smoothing the Linear layers' inputs buys in int8 (exporters/smoothing.py): an export's fp32
graph quantized as ``export --precision int8`` does (``quantize_keeping_float``), for each
smoothing strength and keep-float setting; per variant the Linear layers kept in float, the output
cosine to the fp32 PyTorch model on held-out photos (mean and min) and on the gate's 9 parity
images (min), and the speed over the fp32 graph, every graph (fp32 first) timed interleaved on
ONNX Runtime's CPU provider.

    python -m lab.studies.int8_smoothing ARTIFACT --graph dense --alphas none,0.5 --keep 0,auto \
      --out lab/results/int8_smoothing_dinov2_dense.json

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
from exporters.keep_float import AUTO, quantize_keeping_float
from exporters.pipeline import PARITY_BATCHES, parity_images
from exporters.precision import PRECISIONS
from exporters.quantize import CALIBRATION_METHODS, DEFAULT_CALIBRATION
from exporters.runners import OnnxRuntimeRunner
from lab.studies.int8_common import cosines, int8_study_parser, load_int8_study


def main() -> None:
    parser = int8_study_parser(__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="none,0.5", help="smoothing strengths (none: off)")
    parser.add_argument("--keep", default="0,auto", help="--int8-keep-float values")
    parser.add_argument(
        "--calibration", choices=tuple(CALIBRATION_METHODS), default=DEFAULT_CALIBRATION, help="--int8-calibration"
    )
    args = parser.parse_args()

    fp32, model, calibration, images = load_int8_study(args)
    gate_images = parity_images(model, sum(PARITY_BATCHES), held_out=True)
    with torch.no_grad():
        reference = model(torch.from_numpy(images)).numpy().astype(np.float64)
        gate_reference = model(torch.from_numpy(gate_images)).numpy().astype(np.float64)
    runners, rows = {"fp32": OnnxRuntimeRunner(fp32, "cpu", args.threads)}, []
    with tempfile.TemporaryDirectory() as scratch:
        for alpha_text in args.alphas.split(","):
            alpha = None if alpha_text == "none" else float(alpha_text)
            for keep_text in args.keep.split(","):
                keep = keep_text if keep_text == AUTO else int(keep_text)
                name = f"alpha {alpha_text}, keep {keep_text}"
                path = Path(scratch) / f"{alpha_text}-{keep_text}.onnx"
                int8 = quantize_keeping_float(
                    model,
                    fp32,
                    path,
                    calibration,
                    keep,
                    args.calibration,
                    PRECISIONS["int8"].tolerance,
                    smoothing=alpha,
                )
                runners[name] = runner = OnnxRuntimeRunner(path, "cpu", args.threads)
                cosine = cosines(reference, runner.infer(images))
                gate = cosines(gate_reference, runner.infer(gate_images))
                rows.append(
                    {
                        "name": name,
                        "alpha": alpha,
                        "keep": keep,
                        "kept_float": int8["kept_float"],
                        "smoothing": int8.get("smoothing"),
                        "tries": int8.get("keep_float_search", {}).get("tries"),
                        "cosine_mean": float(cosine.mean()),
                        "cosine_min": float(cosine.min()),
                        "gate_cosine_min": float(gate.min()),
                    }
                )
                print(
                    f"{name}: {len(int8['kept_float'])} in float, held-out cosine mean {cosine.mean():.4f} "
                    f"min {cosine.min():.4f}, gate images min {gate.min():.4f}",
                    flush=True,
                )
        x = np.random.default_rng(0).standard_normal((args.batch, *images.shape[1:]), dtype=np.float32)
        samples = interleaved(
            {name: (lambda r=runner: r.infer(x)) for name, runner in runners.items()}, min_time=args.min_time
        )
    for row in rows:
        row["p50_s"] = float(np.median(samples[row["name"]]))
        row["speedup_over_fp32"] = ratio = speedup(samples["fp32"], samples[row["name"]])
        print(
            f"{row['name']}: speedup over fp32 {ratio['median']:.2f} ({ratio['p10']:.2f}-{ratio['p90']:.2f})",
            flush=True,
        )
    args.out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "graph": args.graph,
                "calibration": args.calibration,
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
