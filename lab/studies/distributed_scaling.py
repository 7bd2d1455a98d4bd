"""One process against several under torchrun on the same machine: wall time of `corp-deploy
compress`, whether the two artifacts compute the same function, and the size of every statistic
summed over the processes per block (what each all-reduce moves).

    python -m lab.studies.distributed_scaling --model deit_small --images 256 --processes 2 \\
        --out lab/results/distributed_scaling_deit_small.json

Both runs get the machine's cores (one process with every thread, N processes with cores / N
threads each), random weights, built-in calibration images, uniform s = 0.5 and then --macs 0.6.
The outputs are compared on 16 held-out images (max |difference| and cosine of the logits), and
the kept dims block by block (how many blocks differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from corp_deploy import create_base_model, model_transform
from corp_deploy.artifact import load_compressed, read_report
from corp_deploy.calibration import held_out_images
from corp_deploy.documents import library_versions
from corp_deploy.families import blocks_of
from corp_deploy.layers import head_dims
from corp_deploy.methods.corp.qk_statistics import images_worth_the_sums
from corp_deploy.metrics import tensor_cosine


def compress_command(model: str, images: int, settings: list[str], out: Path, processes: int) -> list[str]:
    corp_deploy = str(Path(sys.executable).parent / "corp-deploy")
    command = [
        corp_deploy,
        "compress",
        model,
        "--no-pretrained",
        "--calib-samples",
        str(images),
        *settings,
        "-o",
        str(out),
    ]
    if processes == 1:
        return command
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
        "--no-python",
        "--",
        *command,
    ]


def message_bytes(model: torch.nn.Module, images: int, kept_hidden: int) -> dict[str, int]:
    """Bytes of each statistic summed over the processes for one block (float64), as the code
    sends them: the MLP hidden moments (Gram, sum, sign counts), the value/output inputs'
    moments, the query/key statistics (the per-image Grams, float32, gathered: every process receives
    all images'; past :func:`~corp_deploy.methods.corp.qk_statistics.images_worth_the_sums` images
    their packed Kronecker sums instead, summed), and the refit's joint moments of [proj input,
    target] and [fc2 input, target] (at ``kept_hidden``)."""
    block = blocks_of(model)[0]
    width, hidden, heads = block.attn.proj.out_features, block.mlp.fc1.out_features, block.attn.num_heads
    d = head_dims(block.attn)[0]

    def moments(dim: int, signs: bool = False) -> int:
        return 8 * (dim * dim + dim * (2 if signs else 1) + dim + 1)  # Gram, sum, [signs], shift and count

    return {
        "mlp_moments": moments(hidden, signs=True),
        "value_moments": moments(width),
        **(
            {"query_key_grams_gathered": 4 * 2 * images * heads * d * d}
            if images <= images_worth_the_sums(d)
            else {"query_key_sums": 8 * heads * (d * (d + 1) // 2) ** 2}
        ),
        "refit_proj_moments": moments(2 * width),
        "refit_fc2_moments": moments(kept_hidden + width),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_small")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, settings in (("uniform s=0.5", ["--s", "0.5"]), ("budget macs=0.6", ["--macs", "0.6"])):
            artifacts = {}
            for processes in (1, args.processes):
                out = Path(folder) / f"{label.split()[0]}-{processes}"
                env = {
                    **os.environ,
                    "OMP_NUM_THREADS": str(max(1, cores // processes)),
                    "CORP_DEPLOY_STATE_DIR": str(Path(folder) / "state"),
                }
                start = time.perf_counter()
                subprocess.run(
                    compress_command(args.model, args.images, settings, out, processes),
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                seconds = time.perf_counter() - start
                report = read_report(out)
                artifacts[processes] = out
                rows.append(
                    {
                        "setting": label,
                        "processes": processes,
                        "threads_each": max(1, cores // processes),
                        "wall_s": round(seconds, 1),
                        "compress_s": report["time_s"]["total"],
                        "distributed": report.get("distributed"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            reports = [read_report(artifacts[p]) for p in (1, args.processes)]
            dims = [[layer["dims"] for layer in r["layers"]] for r in reports]
            rows[-1]["blocks_with_other_dims"] = sum(a != b for a, b in zip(*dims))
            one, many = (load_compressed(artifacts[p]).eval() for p in (1, args.processes))
            transform, _ = model_transform(one)
            x = torch.cat(list(held_out_images(transform, 16)))
            with torch.no_grad():
                a, b = one(x), many(x)
            rows[-1]["max_abs_difference"] = float((a - b).abs().max())
            rows[-1]["min_cosine"] = float(tensor_cosine(a, b).min())
            print(json.dumps(rows[-1]), flush=True)
    dense = create_base_model(args.model, pretrained=False)
    kept_hidden = blocks_of(dense)[0].mlp.fc1.out_features // 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python -m lab.studies.distributed_scaling "
                f"--model {args.model} --images {args.images} --processes {args.processes} --out {args.out}",
                "machine": {"cores": cores},
                "versions": library_versions(),
                "rows": rows,
                "bytes_per_block": message_bytes(dense, args.images, kept_hidden),
                "blocks": len(blocks_of(dense)),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
