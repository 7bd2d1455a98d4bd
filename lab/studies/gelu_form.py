"""What writing the GELU in the form ONNX Runtime fuses gains: an export's fp32 graph (written in
that form by ``export``) against the same graph in the dynamo exporter's own form, each also
quantized as ``export --precision int8 --int8-keep-float 0`` does (smoothed: in the exporter's
form fc2's smoothing scale folds into the GELU's constant 0.5, in the fused form it takes a Mul);
the four graphs timed interleaved on ONNX Runtime's CPU provider, the int8 ones' output cosine to
the fp32 PyTorch model on held-out photos, and whether the two fp32 forms' outputs are equal.

    python -m lab.studies.gelu_form ARTIFACT --graph model --calib 32 \
      --out lab/results/gelu_form_deit_base_s0.5.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from benchmarks.latency import interleaved, speedup
from corp_deploy.documents import Machine
from exporters.fusable_forms import is_fusable_gelu, scalar_initializers
from exporters.quantize import quantize_int8
from exporters.runners import OnnxRuntimeRunner
from exporters.smoothing import DEFAULT_ALPHA, linear_input_scales
from lab.studies.int8_common import cosines, int8_study_parser, load_int8_study


def exporter_form(fused: Path, out: Path) -> int:
    """Write ``fused`` with each GELU ``(x * 0.5) * (erf(x / sqrt 2) + 1)`` turned back into the
    dynamo exporter's ``x * ((erf(x / sqrt 2) + 1) * 0.5)``; returns how many."""
    model = onnx.load(str(fused))
    constants = scalar_initializers(model.graph)
    producers = {o: node for node in model.graph.node for o in node.output}
    count = 0
    for product in model.graph.node:
        if not is_fusable_gelu(product, producers, constants):
            continue
        half_name = next(i for i in product.input if producers[i].op_type == "Mul")
        plus_one, half = next(i for i in product.input if i != half_name), producers[half_name]
        x, constant = sorted(half.input, key=lambda i: i in constants)
        half.input[:] = [plus_one, constant]
        product.input[:] = [x, half.output[0]]
        count += 1
    onnx.save(model, str(out))
    return count


def main() -> None:
    args = int8_study_parser(__doc__.splitlines()[0], graph="model").parse_args()
    fused, model, calibration, images = load_int8_study(args)
    with torch.no_grad():
        reference = model(torch.from_numpy(images)).numpy().astype(np.float64)
    scales = linear_input_scales(model, calibration, DEFAULT_ALPHA)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        graphs = {"fp32, fused form": fused, "fp32, exporter's form": Path(scratch) / "exporter.onnx"}
        rewritten = exporter_form(fused, graphs["fp32, exporter's form"])
        for form in ("fused form", "exporter's form"):
            graphs[f"int8, {form}"] = Path(scratch) / f"int8 {form}.onnx"
            rows[f"int8, {form}"] = {
                "smoothing": quantize_int8(
                    graphs[f"fp32, {form}"],
                    graphs[f"int8, {form}"],
                    (b.numpy() for b in calibration),
                    input_scales=scales,
                )["smoothing"]
            }
        runners = {name: OnnxRuntimeRunner(path, "cpu", args.threads) for name, path in graphs.items()}
        outputs = {name: runner.infer(images) for name, runner in runners.items()}
        for name in graphs:
            cosine = cosines(reference, outputs[name])
            rows.setdefault(name, {}).update(cosine_mean=float(cosine.mean()), cosine_min=float(cosine.min()))
        x = np.random.default_rng(0).standard_normal((args.batch, *images.shape[1:]), dtype=np.float32)
        samples = interleaved(
            {name: (lambda r=runner: r.infer(x)) for name, runner in runners.items()}, min_time=args.min_time
        )
    for precision in ("fp32", "int8"):
        ratio = speedup(samples[f"{precision}, exporter's form"], samples[f"{precision}, fused form"])
        rows[f"{precision}, fused form"]["speedup_over_exporters_form"] = ratio
        print(
            f"{precision}: fused form over exporter's form {ratio['median']:.3f} "
            f"({ratio['p10']:.3f}-{ratio['p90']:.3f})",
            flush=True,
        )
    for name, row in rows.items():
        row["p50_s"] = float(np.median(samples[name]))
        print(f"{name}: {row}", flush=True)
    fp32_difference = float(np.abs(outputs["fp32, fused form"] - outputs["fp32, exporter's form"]).max())
    args.out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "graph": args.graph,
                "gelus": rewritten,
                "smoothing_alpha": DEFAULT_ALPHA,
                "calibration_images": args.calib,
                "held_out_images": args.images,
                "batch": args.batch,
                "threads": args.threads,
                "machine": Machine.here().to_dict(),
                "fp32_forms_max_abs_difference_optimized": fp32_difference,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
