"""CORP alone (no recovery) on the real DINOv2 ViT-S/14 against the number of calibration photos of
the photo set (:mod:`benchmarks.photo_set`) and the views taken of each, measured on the set's
held-out photos, its unlike images and the synthetic unlike images of the earlier studies.

    python -m benchmarks.studies.set_calibration --set /path/to/photo-set --photos 10,50,150,all \\
        --views 1,4 --starts corp-s0.5,budget-s0.5,budget-s0.7 --out benchmarks/results/set_calibration.json

A start is ``corp-s<S>`` (uniform joint sparsity S) or ``budget-s<S>`` (a MAC budget equal to uniform
CORP's MACs at S). ``--photos`` takes the first N training photos in a seeded order (``all``: every
one; ``builtin``: compress's default without ``--calib``, 256 crops of the ten bundled calibration
photos); ``--views K`` makes K images of each photo (the file itself, then seeded crops: benchmarks/
set_images.py). Each row: the mean cosine to the dense model of the pooled output and of all output
tokens on each evaluation set, the number of calibration images and the compress time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.held_out import feature_cosine, unlike_images, write_dinov2_study
from benchmarks.real_weights import build_dinov2
from benchmarks.set_images import calibration_images, evaluation_images
from corp_deploy import CompressConfig, HeldImages, compress, count_macs, model_transform
from corp_deploy.calibration import CalibrationImages


def uniform_macs_fraction(dense, sparsity: float, size: tuple[int, ...]) -> float:
    """The MACs of uniform CORP at ``sparsity`` as a fraction of the dense model's (the kept dims of a
    uniform sparsity do not depend on the images: two bundled crops calibrate it)."""
    transform, _ = model_transform(dense)
    few = HeldImages(CalibrationImages.from_builtin(transform, count=2, batch_size=2))
    uniform, _ = compress(dense, few, CompressConfig.from_settings(sparsity=sparsity, refit="none"))
    return count_macs(uniform, size) / count_macs(dense, size)


def start_config(label: str, dense, size) -> CompressConfig:
    """``corp-s<S>`` or ``budget-s<S>`` (the MACs of ``corp-s<S>``)."""
    kind, s = label.rsplit("-s", 1)
    if kind == "corp":
        return CompressConfig.from_settings(sparsity=float(s))
    if kind == "budget":
        return CompressConfig.from_settings(macs=uniform_macs_fraction(dense, float(s), size))
    raise SystemExit(f"unknown start {label!r}")


def evaluation_sets(set_root: Path, transform, views: int, unlike: int) -> dict[str, list[torch.Tensor]]:
    """The sets every row is measured on: the set's held-out photos and unlike images, and the
    synthetic unlike images of the earlier studies (benchmarks/held_out.py)."""
    return {
        "photos": list(evaluation_images(set_root, "held_out", transform, views)),
        "unlike": list(evaluation_images(set_root, "unlike", transform, views)),
        "synthetic": unlike_images(transform, unlike),
    }


def measure(dense, model, sets: dict) -> dict:
    """Per evaluation set, the pooled-output and token cosines to the dense model."""
    row = {}
    for name, batches in sets.items():
        cosines = feature_cosine(dense, model, batches)
        row[f"{name}_output"], row[f"{name}_tokens"] = cosines["output_cosine"], cosines["token_cosine"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", type=Path, required=True, help="the built photo set (benchmarks.photo_set)")
    parser.add_argument("--photos", default="10,50,150,all")
    parser.add_argument("--views", default="1")
    parser.add_argument("--starts", default="corp-s0.5,budget-s0.5,budget-s0.7")
    parser.add_argument("--eval-views", type=int, default=3, help="images per evaluation file")
    parser.add_argument("--unlike", type=int, default=64, help="synthetic unlike images")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    command = "python -m benchmarks.studies.set_calibration " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("set", "out")
    )

    dense = build_dinov2()
    transform, data_config = model_transform(dense)
    size = tuple(data_config["input_size"])
    sets = evaluation_sets(args.set, transform, args.eval_views, args.unlike)
    counts = {name: sum(len(b) for b in batches) for name, batches in sets.items()}
    print(json.dumps({"evaluation_images": counts}), flush=True)
    rows = []
    for start in args.starts.split(","):
        config = start_config(start, dense, size)
        for photos in args.photos.split(","):
            for views in (int(v) for v in args.views.split(",")):
                if photos == "builtin":
                    if views != 1:
                        continue
                    calib = HeldImages(CalibrationImages.from_builtin(transform))
                else:
                    calib = calibration_images(args.set, transform, None if photos == "all" else int(photos), views)
                began = time.perf_counter()
                compressed, report = compress(dense, calib, config)
                row = {
                    "start": start,
                    "photos": photos,
                    "views": views,
                    "calibration_images": report["calibration"]["images"],
                    "macs_fraction": report["macs"]["compressed"] / report["macs"]["dense"],
                    "compress_s": round(time.perf_counter() - began, 1),
                    **measure(dense, compressed, sets),
                }
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                rows.append(row)
                write_dinov2_study(
                    args.out,
                    command + f" --set PHOTO_SET --out {args.out}",
                    evaluation_images=counts,
                    rows=rows,
                )


if __name__ == "__main__":
    main()
