"""Compressing to a MAC budget on the real DINOv2 ViT-S/14: the budgeted model against uniform
CORP at the MACs of uniform joint sparsity s, with the ablations of its three ingredients.

    python -m lab.studies.budget_allocation --calib 128 --held-out 64 \\
        --out lab/results/budget_allocation.json

For every s in --sparsities, the budget F is the MAC fraction of uniform CORP at s (MLP and
query/key, the paper's setting). Settings at that budget:

* ``uniform``: CORP at s (the reference);
* ``selection``: the same sizes, kept sets chosen by the greedy closed-form selection;
* ``vo``: uniform sizes with value/output pruning too: one sparsity for all three parts, the
  smallest one whose MACs fit the budget;
* ``allocation``: the budget spent over MLP and query/key units only, score ranking;
* ``budget``: everything (MLP, query/key and value/output units, greedy selection), per
  distortion measure (--distortions), and with the ``combined`` score instead of greedy selection;
* ``budget equal-head-dims``: the same with query/key and value dims tied per head.

Calibration and held-out images are seeded crops of disjoint bundled photos
(lab/held_out.py); every number is held out. The allocation of each budgeted
run is stored with its row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from corp_deploy import CompressConfig, compress, count_macs, kept_count
from corp_deploy.methods.corp.curves import macs_per_dim
from corp_deploy.methods.corp.options import DISTORTIONS
from lab.held_out import dinov2_study_setup, feature_cosine, write_dinov2_study


def uniform_all_sparsity(
    dense_macs: int, budget_macs: float, head_dim: int, hidden: int, per_dim: dict[str, int], blocks: int
) -> float:
    """The smallest sparsity s (on a 0.005 grid) at which uniform pruning of all three parts
    keeps at most ``budget_macs``; ``per_dim``: MACs of one kept dim per part and block."""
    prunable = blocks * (per_dim["mlp"] * hidden + (per_dim["qk"] + per_dim["vo"]) * head_dim)
    fixed = dense_macs - prunable
    for step in range(200):
        s = step / 200
        macs = fixed + blocks * (
            per_dim["mlp"] * kept_count(hidden, s) + (per_dim["qk"] + per_dim["vo"]) * kept_count(head_dim, s)
        )
        if macs <= budget_macs:
            return s
    raise ValueError("no uniform sparsity fits the budget")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--sparsities", default="0.3,0.5,0.7")
    parser.add_argument("--distortions", default=",".join(DISTORTIONS))
    parser.add_argument(
        "--only", default="", help="run only settings whose label contains one of these comma-separated texts"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dense, _, calib, held = dinov2_study_setup(args.calib, args.held_out)
    blocks, block = len(dense.blocks), dense.blocks[0]
    tokens = calib[0].shape[-1] // 14 * (calib[0].shape[-2] // 14) + 1
    per_dim = {part: macs_per_dim(part, tokens, block) for part in ("mlp", "qk", "vo")}
    dense_macs = count_macs(dense, tuple(calib[0].shape[1:]))
    rows = []

    def run(label: str, config: CompressConfig) -> dict:
        start = time.perf_counter()
        model, report = compress(dense, calib, config)
        row = {
            "setting": label,
            **feature_cosine(dense, model, held),
            "macs_fraction": report["macs"]["compressed"] / report["macs"]["dense"],
            "gmacs": round(report["macs"]["compressed"] / 1e9, 4),
            "params_m": round(report["params"]["compressed"] / 1e6, 3),
            "compress_s": round(time.perf_counter() - start, 1),
            "dims": [layer["dims"] for layer in report["layers"]],
        }
        if "budget" in report:
            row["allocation"] = report["budget"]
        print(json.dumps({k: v for k, v in row.items() if k not in ("dims", "allocation")}), flush=True)
        rows.append(row)
        return row

    def wanted(label: str) -> bool:
        return any(part in label for part in args.only.split(","))

    for s in (float(v) for v in args.sparsities.split(",")):
        reference = run(f"s={s} uniform", CompressConfig(s_mlp=s, s_attn=s))
        budget = reference["macs_fraction"]
        settings = [(f"s={s} selection", CompressConfig.from_settings(s_mlp=s, s_attn=s, ranker="greedy"))]
        s_all = uniform_all_sparsity(
            dense_macs, budget * dense_macs, block.attn.head_dim, block.mlp.fc1.out_features, per_dim, blocks
        )
        settings.append(
            (f"s={s} vo (uniform s={s_all})", CompressConfig(target="all", s_mlp=s_all, s_attn=s_all, s_vo=s_all))
        )
        settings.append(
            (f"s={s} allocation", CompressConfig.from_settings(macs=budget, target="both", ranker="combined"))
        )
        for distortion in args.distortions.split(","):
            settings.append(
                (f"s={s} budget {distortion}", CompressConfig.from_settings(macs=budget, distortion=distortion))
            )
        settings.append((f"s={s} budget combined-ranker", CompressConfig.from_settings(macs=budget, ranker="combined")))
        settings.append(
            (f"s={s} budget equal-head-dims", CompressConfig.from_settings(macs=budget, equal_head_dims=True))
        )
        for label, config in settings:
            if wanted(label):
                run(label, config)

    write_dinov2_study(
        args.out,
        f"python -m lab.studies.budget_allocation --calib {args.calib} --held-out "
        f"{args.held_out} --sparsities {args.sparsities} --distortions {args.distortions} "
        f"--only '{args.only}' --out {args.out}",
        rows=rows,
    )


if __name__ == "__main__":
    main()
