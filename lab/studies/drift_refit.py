"""The drift-correcting refit (docs/method.md §10) on the real DINOv2 ViT-S/14: each lever on and
off, uniform and budgeted, at the MACs of uniform joint sparsity s, on held-out photos and on
images unlike the calibration set.

    python -m lab.studies.drift_refit --calib 128 --held-out 64 --unlike 64 \\
        --out lab/results/drift_refit.json

For every s in --sparsities the budget F is the MAC fraction of uniform CORP at s (MLP and
query/key). Settings (``--only`` picks those whose label contains one of its texts):
``uniform`` and ``budget`` (``--macs F``), each with ``--refit none``, ``fc2`` and ``proj+fc2``,
and with ``proj+fc2`` at other shrinkages (--shrinks); budget rows for every distortion measure in
--distortions (labelled ``budget normed`` etc.; ``budget`` is ``residual``), and budget rows with
``proj+fc2`` and a unit floor of ``r (1 - s)`` for every r in --floor-ratios (labelled ``budget floor
F``; the default floor is 0.1). Every row: mean cosine to the dense model of the pooled output
and of all output tokens, on 64 crops of the held-out photos and on 64 unlike images
(lab/held_out.py), and the compress wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from corp_deploy import CompressConfig, compress
from lab.held_out import dinov2_study_setup, feature_cosine, unlike_images, write_dinov2_study


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--unlike", type=int, default=64)
    parser.add_argument("--sparsities", default="0.3,0.5,0.7")
    parser.add_argument("--shrinks", default="0.1,10")
    parser.add_argument(
        "--distortions",
        default="residual",
        help="budget rows for each of these distortion measures (docs/method.md §8)",
    )
    parser.add_argument(
        "--floor-ratios", default="", help="budget rows with the unit floor r (1 - s) for each of these r"
    )
    parser.add_argument(
        "--only", default="", help="run only settings whose label contains one of these comma-separated texts"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dense, transform, calib, held = dinov2_study_setup(args.calib, args.held_out)
    unlike = unlike_images(transform, args.unlike)
    rows = []

    def run(label: str, config: CompressConfig) -> dict:
        start = time.perf_counter()
        model, report = compress(dense, calib, config)
        seconds = time.perf_counter() - start
        photos, other = feature_cosine(dense, model, held), feature_cosine(dense, model, unlike)
        row = {
            "setting": label,
            "photos_output": photos["output_cosine"],
            "photos_tokens": photos["token_cosine"],
            "unlike_output": other["output_cosine"],
            "unlike_tokens": other["token_cosine"],
            "macs_fraction": report["macs"]["compressed"] / report["macs"]["dense"],
            "compress_s": round(seconds, 1),
            "time_s": report["time_s"],
        }
        print(
            json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "time_s"}),
            flush=True,
        )
        rows.append(row)
        write()  # after every row: a long study interrupted keeps what it measured
        return row

    def write() -> None:
        write_dinov2_study(
            args.out,
            f"python -m lab.studies.drift_refit --calib {args.calib} --held-out "
            f"{args.held_out} --unlike {args.unlike} --sparsities {args.sparsities} "
            f"--shrinks '{args.shrinks}' --distortions {args.distortions} --floor-ratios "
            f"'{args.floor_ratios}' --only "
            f"'{args.only}' --out {args.out}",
            rows=rows,
        )

    def wanted(label: str) -> bool:
        return any(part in label for part in args.only.split(","))

    for s in (float(v) for v in args.sparsities.split(",")):
        reference = CompressConfig.from_settings(s_mlp=s, s_attn=s, refit="none")
        budget = compress(dense, [calib[0][:1]], reference)[1]["macs"]  # the MACs do not depend on the images
        fraction = budget["compressed"] / budget["dense"]
        modes = (
            ("uniform", dict(s_mlp=s, s_attn=s)),
            *(
                (f"budget {d}" if d != "residual" else "budget", dict(macs=fraction, distortion=d))
                for d in args.distortions.split(",")
            ),
        )
        settings = [
            (f"s={s} {mode} refit {refit}", CompressConfig.from_settings(**sizes, refit=refit))
            for mode, sizes in modes
            for refit in ("none", "fc2", "proj+fc2")
        ]
        settings += [
            (
                f"s={s} {mode} refit proj+fc2 shrink {a}",
                CompressConfig.from_settings(**sizes, refit="proj+fc2", refit_shrink=float(a)),
            )
            for mode, sizes in modes
            for a in args.shrinks.split(",")
            if a
        ]
        floors = [round(float(r) * (1 - s), 3) for r in args.floor_ratios.split(",") if r]
        settings += [
            (
                f"s={s} budget floor {floor} refit proj+fc2",
                CompressConfig.from_settings(macs=fraction, unit_floor=floor, refit="proj+fc2"),
            )
            for floor in floors
        ]
        for label, config in settings:
            if wanted(label):
                run(label, config)


if __name__ == "__main__":
    main()
