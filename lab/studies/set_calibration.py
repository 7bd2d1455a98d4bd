"""CORP alone (no recovery) on the real DINOv2 ViT-S/14 against the number of calibration photos of
the photo set (:mod:`lab.photo_set`) and the views taken of each, measured on the set's
held-out photos, its unlike images and the synthetic unlike images of the earlier studies.

    python -m lab.studies.set_calibration --set /path/to/photo-set --photos 10,50,150,all \\
        --views 1,4 --starts corp-s0.5,budget-s0.5,budget-s0.7 --out lab/results/set_calibration.json

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

from corp_deploy import CompressConfig, ImagesInMemory, compress, count_macs, model_transform
from corp_deploy.calibration import CalibrationImages
from corp_deploy.metrics import tensor_cosine
from lab.held_out import unlike_images, write_dinov2_study
from lab.real_weights import build_dinov2
from lab.set_images import calibration_images, evaluation_images


def uniform_macs_fraction(dense, sparsity: float, size: tuple[int, ...]) -> float:
    """The MACs of uniform CORP at ``sparsity`` as a fraction of the dense model's (the kept dims of a
    uniform sparsity do not depend on the images: two bundled crops calibrate it)."""
    transform, _ = model_transform(dense)
    few = ImagesInMemory(CalibrationImages.from_builtin(transform, count=2, batch_size=2))
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


class EvaluationSets:
    """The sets every row is measured on, with the dense model's outputs on them computed once: the
    set's held-out photos and unlike images, and the synthetic unlike images of the earlier studies
    (lab/held_out.py)."""

    def __init__(self, dense, set_root: Path, transform, views: int, unlike: int) -> None:
        self.batches = {
            "photos": list(evaluation_images(set_root, "held_out", transform, views)),
            "unlike": list(evaluation_images(set_root, "unlike", transform, views)),
            "synthetic": unlike_images(transform, unlike),
        }
        self._dense = {name: [outputs(dense, x) for x in batches] for name, batches in self.batches.items()}

    def counts(self) -> dict[str, int]:
        return {name: sum(len(x) for x in batches) for name, batches in self.batches.items()}

    @torch.no_grad()
    def measure(self, model) -> dict:
        """Per set, the mean cosine to the dense model of the pooled output and of all output tokens."""
        row = {}
        for name, batches in self.batches.items():
            pooled, tokens = [], []
            for x, (dense_pooled, dense_tokens) in zip(batches, self._dense[name]):
                model_pooled, model_tokens = outputs(model, x)
                pooled.append(tensor_cosine(dense_pooled, model_pooled))
                tokens.append(tensor_cosine(dense_tokens, model_tokens))
            row[f"{name}_output"] = float(torch.cat(pooled).mean())
            row[f"{name}_tokens"] = float(torch.cat(tokens).mean())
        return row


@torch.no_grad()
def outputs(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's pooled output and its final tokens flattened, as lab.held_out.feature_cosine compares them."""
    features = model.forward_features(x)
    return model.forward_head(features), features.flatten(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", type=Path, required=True, help="the built photo set (lab.photo_set)")
    parser.add_argument("--photos", default="10,50,150,all")
    parser.add_argument("--views", default="1")
    parser.add_argument("--starts", default="corp-s0.5,budget-s0.5,budget-s0.7")
    parser.add_argument("--eval-views", type=int, default=3, help="images per evaluation file")
    parser.add_argument("--unlike", type=int, default=64, help="synthetic unlike images")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    command = "python -m lab.studies.set_calibration " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("set", "out")
    )

    dense = build_dinov2()
    transform, data_config = model_transform(dense)
    size = tuple(data_config["input_size"])
    sets = EvaluationSets(dense, args.set, transform, args.eval_views, args.unlike)
    counts = sets.counts()
    print(json.dumps({"evaluation_images": counts}), flush=True)
    rows = []
    for start in args.starts.split(","):
        config = start_config(start, dense, size)
        for photos in args.photos.split(","):
            for views in (int(v) for v in args.views.split(",")):
                if photos == "builtin":
                    if views != 1:
                        continue
                    calib = ImagesInMemory(CalibrationImages.from_builtin(transform))
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
                    **sets.measure(compressed),
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
