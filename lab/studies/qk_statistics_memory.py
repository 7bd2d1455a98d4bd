"""Memory and time of one block's query/key statistics against the number of calibration images,
as the library keeps them (``default``: per image up to ``images_worth_the_sums(d)`` images, 1056
at head dim 64, then their packed Kronecker sums, each 32-image batch folded in as it comes;
corp_deploy/methods/corp/qk_statistics.py ``HeadGrams``), forced per image past that point (``per-image``: what the
library did before, then in float64) and summed from the first batch on (``summed``).

    python -m lab.studies.qk_statistics_memory --images 256,1024,2048,4096 \\
        --out lab/results/qk_statistics_memory.json

DeiT-B's attention shape (12 heads of 64 dims, 197 tokens), random activations (the values do not
change the cost). Each point runs in a fresh process, so its peak RSS (``ru_maxrss``) is its own:
collecting the statistics in batches of 32 images, then what uniform compression does with them
(the heads' sums, ranking, one solve per head at 32 kept dims), then one head's budget curve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from corp_deploy.documents import library_versions
from corp_deploy.methods.corp.qk_statistics import images_worth_the_sums

POINT = r"""
import json, resource, sys, time
import torch
from corp_deploy.methods.corp import qk_pruning
from corp_deploy.methods.corp.qk_statistics import HeadGrams, images_worth_the_sums
images, form = int(sys.argv[1]), sys.argv[2]
heads, tokens, d, batch = 12, 197, 64, 32
gen = torch.Generator().manual_seed(0)
q = torch.randn(batch, heads, tokens, d, generator=gen)
k = torch.randn(batch, heads, tokens, d, generator=gen) + 0.3 * q
megabytes = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = megabytes()
grams = HeadGrams(summed_after={"default": None, "per-image": 10 ** 9, "summed": 0}[form])
start = time.perf_counter()
for _ in range(images // batch):
    grams.add(q, k)
collect_s = time.perf_counter() - start
held = sum(t.numel() * t.element_size() for t in grams.query + grams.key) + \
    (grams.kronecker.numel() * 8 if grams.kronecker is not None else 0)
start = time.perf_counter()
sums = grams.heads()
kept, pruned = qk_pruning.split_head_dims(qk_pruning.qk_dim_scores(sums), d // 2)
for h, head in enumerate(sums):
    qk_pruning.solve_head(head, kept[h], pruned[h], 1e-3)
solve_s = time.perf_counter() - start
start = time.perf_counter()
order = torch.argsort(qk_pruning.qk_dim_scores(sums[:1])[0], descending=True)
qk_pruning.head_curve(sums[0], order, 1e-3)
curve_s = time.perf_counter() - start
kept = "summed" if grams.kronecker is not None else "per-image"
assert kept == {"default": "summed" if images > images_worth_the_sums(d) else "per-image"}.get(form, form)
print(json.dumps({"images": images, "form": form, "kept": kept, "statistics_mb": round(held / 2**20, 1),
                  "peak_rss_mb": round(megabytes()), "rss_before_mb": round(before),
                  "collect_s": round(collect_s, 2), "collect_ms_per_image": round(1000 * collect_s / images, 2),
                  "uniform_solves_s": round(solve_s, 2), "one_head_curve_s": round(curve_s, 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default="256,1024,2048,4096")
    parser.add_argument(
        "--per-image-up-to",
        type=int,
        default=2048,
        help="past the images worth the sums, also keep the Grams per image (forced) up to this many images",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for images in (int(n) for n in args.images.split(",")):
        forms = ["default", "summed"] + (
            ["per-image"] if images_worth_the_sums(64) < images <= args.per_image_up_to else []
        )
        for form in forms:
            result = subprocess.run(
                [sys.executable, "-c", POINT, str(images), form], check=True, capture_output=True, text=True
            )
            rows.append(json.loads(result.stdout))
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": f"python -m lab.studies.qk_statistics_memory --images {args.images} "
                f"--per-image-up-to {args.per_image_up_to} --out {args.out}",
                "machine": {"cores": os.cpu_count()},
                "versions": library_versions(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
