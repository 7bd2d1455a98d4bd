"""Whether rounding the Linear layers' outputs to int8 too (ONNX Runtime ``quantize_static``'s
default for MatMul and Gemm) costs fidelity and speed: an export's fp32 graph quantized as
``export --precision int8 --int8-keep-float 0`` does, once with only the Linear inputs in int8
(the tool's recipe) and once with their outputs rounded as well; per variant the output cosine to
the fp32 PyTorch model on held-out photos and the speed over the fp32 graph, every graph (fp32
first) timed interleaved on ONNX Runtime's CPU provider.

    python -m lab.studies.int8_output_rounding ARTIFACT --graph model \
      --out lab/results/int8_output_rounding_dinov2_s0.5.json

``ARTIFACT`` needs an ``export-fp32/`` made with ``--dense`` (for ``--graph dense``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.latency import interleaved, speedup
from corp_deploy.documents import Machine
from exporters.quantize import quantize_int8
from exporters.runners import OnnxRuntimeRunner
from exporters.smoothing import DEFAULT_ALPHA, linear_input_scales
from lab.studies.int8_common import cosines, int8_study_parser, load_int8_study


def main() -> None:
    args = int8_study_parser(__doc__.splitlines()[0], graph="model").parse_args()
    fp32, model, calibration, images = load_int8_study(args)
    with torch.no_grad():
        reference = model(torch.from_numpy(images)).numpy().astype(np.float64)
    scales = linear_input_scales(model, calibration, DEFAULT_ALPHA)
    runners, rows = {"fp32": OnnxRuntimeRunner(fp32, "cpu", args.threads)}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, outputs in (("inputs only", False), ("inputs and outputs", True)):
            path = Path(scratch) / f"{outputs}.onnx"
            quantize_int8(fp32, path, (b.numpy() for b in calibration), input_scales=scales, quantize_outputs=outputs)
            runners[name] = runner = OnnxRuntimeRunner(path, "cpu", args.threads)
            cosine = cosines(reference, runner.infer(images))
            rows[name] = {"cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())}
            print(f"{name} in int8: cosine mean {cosine.mean():.4f} min {cosine.min():.4f}", flush=True)
        x = np.random.default_rng(0).standard_normal((args.batch, *images.shape[1:]), dtype=np.float32)
        samples = interleaved(
            {name: (lambda r=runner: r.infer(x)) for name, runner in runners.items()}, min_time=args.min_time
        )
    for name, row in rows.items():
        row["speedup_over_fp32"] = ratio = speedup(samples["fp32"], samples[name])
        print(f"{name}: speedup over fp32 {ratio['median']:.2f} ({ratio['p10']:.2f}-{ratio['p90']:.2f})", flush=True)
    args.out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "graph": args.graph,
                "smoothing_alpha": DEFAULT_ALPHA,
                "calibration_images": args.calib,
                "held_out_images": args.images,
                "batch": args.batch,
                "threads": args.threads,
                "machine": Machine.here().to_dict(),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
