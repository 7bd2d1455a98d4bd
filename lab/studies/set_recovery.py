"""Label-free recovery (corp_deploy.recovery) on the real DINOv2 ViT-S/14 calibrated on the photo set
(:mod:`lab.photo_set`): fidelity on the set's held-out photos, its unlike images and the
synthetic unlike images, against the number of training photos, the steps and the recipe.

    python -m lab.studies.set_recovery --set /path/to/photo-set --photos all --starts budget-s0.5 \\
        --steps 100 --recipes default,blend=1,blend=1+mix=0 --trace --out lab/results/set_recovery.json

For every start (``corp-s<S>``, ``budget-s<S>``: lab/studies/set_calibration.py) and number of
photos, the calibration images are made once (``--views`` per photo) and the model is compressed
twice: on all of them (``corp``, the artifact without recovery, the row every recovery is compared
with) and on the images of the sources recovery trains on (its validation sources held out, as
``compress --recover-steps`` does), which every recipe then starts from (``--fits all``: recovery
starts from the ``corp`` model instead, fitted on its validation sources too, so that validation
measures on images compression has seen). A recipe is ``default`` or
KEY=VALUE settings of RecoveryConfig joined by ``+`` (``blend=1+mix=0``). A recovery that keeps no
step gives the ``corp`` model, as compress does. Each row: the cosines of the final model on the three
evaluation sets, the closed share of what CORP alone leaves (``(recovered - corp) / (1 - corp)``), the
recovery's own validation, the steps run and the times; with ``--trace`` the three sets measured at
every validation measurement too.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import time
from pathlib import Path

from corp_deploy import compress, count_macs, load_compressed, model_transform, save_artifact
from corp_deploy.recovery import RecoveryConfig, RecoveryImages, recover
from lab.held_out import write_dinov2_study
from lab.real_weights import build_dinov2
from lab.set_images import calibration_images
from lab.studies.recovery import parse_value
from lab.studies.set_calibration import EvaluationSets, start_config

SETS = ("photos", "unlike", "synthetic")


def recipe_settings(recipe: str) -> dict:
    """``default`` -> {}; ``blend=1+mix=0`` -> {"blend": 1, "mix": 0}."""
    if recipe == "default":
        return {}
    settings = {}
    for item in recipe.split("+"):
        key, _, value = item.partition("=")
        settings[key] = parse_value(value)
    return settings


def closed_share(recovered: float, corp: float) -> float:
    """How much of what CORP alone leaves the recovery closes: ``(recovered - corp) / (1 - corp)``."""
    return (recovered - corp) / (1 - corp)


def compressed(cache: Path | None, key: str, dense, images, config):
    """``compress(dense, images, config)``'s model, kept as an artifact in ``cache/key`` (with a cache)
    and read from there when it is there already: a budget's compression of the set takes minutes."""
    if cache is not None and (cache / key / "config.json").is_file():
        return load_compressed(cache / key)
    model, _ = compress(dense, images, config)
    if cache is not None:
        save_artifact(model, cache / key, plots=False)
    return model


def rounded(value):
    """``value`` with its floats rounded to 4 decimals, for printing."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", type=Path, required=True, help="the built photo set (lab.photo_set)")
    parser.add_argument("--photos", default="all")
    parser.add_argument("--views", type=int, default=1, help="calibration images per photo")
    parser.add_argument("--starts", default="budget-s0.5")
    parser.add_argument("--steps", default="100")
    parser.add_argument("--recipes", default="default")
    parser.add_argument("--trace", action="store_true", help="measure the evaluation sets at every validation")
    parser.add_argument("--eval-views", type=int, default=3, help="images per evaluation file")
    parser.add_argument("--unlike", type=int, default=64, help="synthetic unlike images")
    parser.add_argument(
        "--fits",
        default="training",
        help="what recovery starts from: training (compression on the training sources alone, as compress "
        "does), all (the corp model), or both: training,all",
    )
    parser.add_argument("--cache", type=Path, help="keep the compressed models there and read them back")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not set(args.fits.split(",")) <= {"training", "all"}:
        parser.error(f"--fits takes training, all or training,all, not {args.fits!r}")
    command = (
        f"python -m lab.studies.set_recovery --set PHOTO_SET --photos {args.photos} --views {args.views} "
        f"--starts {args.starts} --steps {args.steps} --recipes {args.recipes} "
        + ("--trace " if args.trace else "")
        + f"--fits {args.fits} "
        + f"--eval-views {args.eval_views} --unlike {args.unlike} --out {args.out}"
    )

    dense = build_dinov2()
    transform, data_config = model_transform(dense)
    size = tuple(data_config["input_size"])
    sets = EvaluationSets(dense, args.set, transform, args.eval_views, args.unlike)
    rows = []
    for start in args.starts.split(","):
        config = start_config(start, dense, size)
        for photos in args.photos.split(","):
            calib = calibration_images(args.set, transform, None if photos == "all" else int(photos), args.views)
            began = time.perf_counter()
            key = f"{start}-{photos}-views{args.views}"
            corp = compressed(args.cache, key, dense, calib, config)
            base = {"start": start, "photos": photos, "views": args.views, "images": len(calib)}
            corp_row = {**base, "recipe": None, "steps": 0, **sets.measure(corp)}
            corp_row["compress_s"] = round(time.perf_counter() - began, 1)
            corp_row["macs_fraction"] = count_macs(corp, size) / count_macs(dense, size)
            rows.append(corp_row)
            print(json.dumps(rounded(corp_row)), flush=True)
            fitted: dict[tuple, object] = {}  # the compression on the training sources, per split
            steps_list = [int(n) for n in args.steps.split(",")]
            for fit, recipe, steps in itertools.product(args.fits.split(","), args.recipes.split(","), steps_list):
                recovery = RecoveryConfig(steps=steps, **recipe_settings(recipe))
                images = RecoveryImages(calib, data_config, recovery)
                split = (recovery.seed, recovery.validation)
                if fit == "training" and split not in fitted:
                    fit_key = f"{key}-fit-seed{recovery.seed}-validation{recovery.validation}"
                    fitted[split] = compressed(args.cache, fit_key, dense, images.fit_batches(), config)
                trace = []

                def on_measure(step, model, trace=trace):
                    trace.append({"step": step, **sets.measure(model)})
                    print(json.dumps(rounded(trace[-1])), flush=True)

                student = copy.deepcopy(corp if fit == "all" else fitted[split])
                began = time.perf_counter()
                result = recover(student, dense, images, recovery, on_measure=on_measure if args.trace else None)
                recover_s = time.perf_counter() - began
                final = student if result["best_step"] else corp
                row = {**base, "recipe": recipe, "fit": fit, "steps": steps, **sets.measure(final)}
                row["closed"] = {n: closed_share(row[f"{n}_output"], corp_row[f"{n}_output"]) for n in SETS}
                row.update(
                    steps_run=result["steps_run"],
                    best_step=result["best_step"],
                    stopped=result["stopped"],
                    validation=result["validation_cosine"],
                    distorted=result["distorted_validation_cosine"],
                    sources=result["images"],
                    recover_s=round(recover_s, 1),
                    trace=trace,
                )
                rows.append(row)
                print(json.dumps(rounded({k: v for k, v in row.items() if k != "trace"})), flush=True)
                write_rows(args, command, rows)
            write_rows(args, command, rows)


def write_rows(args, command: str, rows: list) -> None:
    write_dinov2_study(args.out, command, recovery_defaults=vars(RecoveryConfig()), rows=rows)


if __name__ == "__main__":
    main()
