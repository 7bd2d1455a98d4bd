"""Where budget mode's error-curve pass spends its time: a cProfile of
:func:`corp_deploy.methods.corp.curves.measure_curves` on DeiT-B (random weights; cost does not depend on them).

    python -m lab.studies.curves_profile --images 256 --macs 0.6 \\
        > lab/results/curves_profile_deit_base.txt

Prints the time of one plain forward pass over the same images, the curves pass's total and the
cumulative profile of the library's functions and the linear-algebra kernels they call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import timm
import torch

from corp_deploy import CalibrationImages, CompressConfig, model_transform
from corp_deploy.engine import embed_all
from corp_deploy.methods.corp.curves import measure_curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_base_patch16_224")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--macs", type=float, default=0.6)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = timm.create_model(args.model).eval()
    transform, _ = model_transform(model)
    images = list(CalibrationImages.from_builtin(transform, count=args.images, batch_size=32, seed=0))
    with torch.no_grad():
        start = time.perf_counter()
        for batch in images:
            model(batch)
        print(f"plain forward pass over {args.images} images: {time.perf_counter() - start:.1f} s")
        cache, _ = embed_all(model, images, torch.device("cpu"), lambda count: None)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        measure_curves(model, cache, CompressConfig.from_settings(macs=args.macs))
        profile.disable()
        print(f"curves pass: {time.perf_counter() - start:.1f} s")
    pstats.Stats(profile).sort_stats("cumulative").print_stats("corp_deploy|cholesky|solve_triangular", 25)


if __name__ == "__main__":
    main()
