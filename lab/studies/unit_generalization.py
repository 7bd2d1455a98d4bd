"""Where the budget's error curves misjudge a unit, on the real DINOv2 ViT-S/14: every block's MLP
compressed alone (the rest of the model dense), CORP-compensated at a few kept fractions, measured
three ways.

    python -m lab.studies.unit_generalization --calib 128 --held-out 64 --unlike 64 \\
        --out lab/results/unit_generalization.json

Per block and kept fraction: ``distortion``, what the allocation compares (the compensated error
on the calibration images over the residual stream's energy where the MLP writes, docs/method.md
§8); the mean squared error the unit adds to the residual stream per token on the calibration
images (``error_calib``, what the curve is made of), on held-out photos (``error_photos``) and on
images unlike the calibration set (``error_unlike``); and the cosine of the model's pooled output
to the dense model's with only this unit pruned (``photos_output``, ``unlike_output``). The
allocation assumes the first column orders the units as the last two do.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from corp_deploy import channels
from corp_deploy.blocks import attention_residual, mlp_hidden, residual_weight
from corp_deploy.engine import embed_tokens
from corp_deploy.methods.corp.curves import ResidualEnergy
from corp_deploy.stats import MomentAccumulator
from lab.held_out import dinov2_study_setup, feature_cosine, unlike_images, write_dinov2_study


def hidden_moments(
    model: torch.nn.Module, batches: list[torch.Tensor]
) -> tuple[list[MomentAccumulator], list[ResidualEnergy]]:
    """Per block: the moments of the MLP's hidden activations over ``batches`` and the energy of the
    residual stream where the MLP writes (after the attention)."""
    moments = [MomentAccumulator(b.mlp.fc1.out_features, track_positive=False) for b in model.blocks]
    energies = [ResidualEnergy() for _ in model.blocks]
    with torch.no_grad():
        for images in batches:
            x = embed_tokens(model, images)
            for block, stats, energy in zip(model.blocks, moments, energies):
                mid = attention_residual(block, x)
                energy.update(mid)
                stats.update(mlp_hidden(block, mid))
                x = block(x)
    return moments, energies


def unit_error(solution: channels.ChannelSolution, weight: torch.Tensor, stats: MomentAccumulator) -> float:
    """``E||W_P (h_P - B h_S - c)||^2`` per token over the samples of ``stats``: the error the
    compensated unit adds to the residual stream on those samples (``weight`` through LayerScale)."""
    rows = torch.cat([solution.kept, solution.pruned])
    w_p = weight[:, solution.pruned]
    reads = torch.cat([-w_p @ solution.B, w_p], 1)  # acts on [h_S; h_P]
    cov, mean = stats.covariance[rows][:, rows], stats.mean[rows]
    return float(((reads @ cov) * reads).sum()) + float((reads @ mean - w_p @ solution.c).square().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--unlike", type=int, default=64)
    parser.add_argument("--fractions", default="0.1,0.3,0.5")
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dense, transform, calib, held = dinov2_study_setup(args.calib, args.held_out)
    unlike = unlike_images(transform, args.unlike)
    calib_stats, energies = hidden_moments(dense, calib)
    held_stats, _ = hidden_moments(dense, held)
    unlike_stats, _ = hidden_moments(dense, unlike)
    rows = []
    for index, block in enumerate(dense.blocks):
        weight = residual_weight(block.mlp.fc2, block.ls2)
        order = channels.keep_order(calib_stats[index], weight, "greedy", args.ridge)
        for fraction in (float(f) for f in args.fractions.split(",")):
            kept = round(fraction * block.mlp.fc1.out_features)
            kept_set, pruned = channels.split_order(order, kept)
            solution = channels.solve_channels(calib_stats[index], weight, kept_set, pruned, args.ridge)
            model = copy.deepcopy(dense)
            channels.fold_mlp(model.blocks[index].mlp, solution.kept, solution.pruned, solution.B, solution.c)
            errors = {
                name: unit_error(solution, weight, stats[index])
                for name, stats in (("calib", calib_stats), ("photos", held_stats), ("unlike", unlike_stats))
            }
            row = {
                "block": index,
                "kept": kept,
                "fraction": fraction,
                "distortion": errors["calib"] / energies[index].value,
                **{f"error_{name}": value for name, value in errors.items()},
                "photos_output": feature_cosine(dense, model, held)["output_cosine"],
                "unlike_output": feature_cosine(dense, model, unlike)["output_cosine"],
            }
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            rows.append(row)
            write_dinov2_study(
                args.out,
                f"python -m lab.studies.unit_generalization --calib {args.calib} "
                f"--held-out {args.held_out} --unlike {args.unlike} --fractions "
                f"{args.fractions} --ridge {args.ridge} --out {args.out}",
                rows=rows,
            )


if __name__ == "__main__":
    main()
