"""Held-out feature fidelity of CORP on the real DINOv2 ViT-S/14, per calibration mode, and of
the peer methods per part (VBP on the MLP; ToaSt on the attention and on the FFN separately).

    python -m lab.studies.dinov2_fidelity --calib 128 --held-out 64 --out lab/results/dinov2_fidelity.json

Calibration and held-out images are seeded crops of disjoint bundled photos
(lab/held_out.py). For every setting: mean held-out cosine to the dense model of
the pooled output (class token) and of all final token features, and compress wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from corp_deploy import CompressConfig, compress
from lab.held_out import dinov2_study_setup, feature_cosine, write_dinov2_study

SETTINGS = [
    # (label, config kwargs)
    *[
        (f"both s={s} {name}", dict(s_mlp=s, s_attn=s, **cfg))
        for s in (0.3, 0.5, 0.7)
        for name, cfg in (
            ("sliced", dict(compensation=False, calibration="independent")),
            ("CORP independent", dict(calibration="independent")),
            ("CORP sequential", dict(calibration="sequential")),
        )
    ],
    *[
        (f"attn s=0.5 {name}", dict(target="attn", s_attn=0.5, **cfg))
        for name, cfg in (
            ("sliced", dict(compensation=False, calibration="independent")),
            ("CORP independent", dict(calibration="independent")),
            ("CORP sequential", dict(calibration="sequential")),
        )
    ],
    *[
        (f"mlp s=0.5 {name}", dict(target="mlp", s_mlp=0.5, **cfg))
        for name, cfg in (
            ("sliced", dict(compensation=False, calibration="independent")),
            ("CORP independent", dict(calibration="independent")),
            ("CORP sequential", dict(calibration="sequential")),
        )
    ],
    *[
        (f"{part} s={s} {method}", dict(method=method, target=part, sparsity=s))
        for s in (0.1, 0.3, 0.5)
        for part, method in (("attn", "toast"), ("mlp", "toast"), ("mlp", "vbp"))
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument(
        "--only", default="", help="run only settings whose label contains one of these comma-separated texts"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dense, _, calib, held = dinov2_study_setup(args.calib, args.held_out)
    rows = []
    for label, cfg in [(label, cfg) for label, cfg in SETTINGS if any(part in label for part in args.only.split(","))]:
        start = time.perf_counter()
        ridge = {"ridge": args.ridge} if cfg.get("method", "corp") == "corp" else {}  # CORP's setting only
        model, report = compress(dense, calib, CompressConfig.from_settings(**cfg, **ridge))
        seconds = time.perf_counter() - start
        rows.append(
            {
                "setting": label,
                **feature_cosine(dense, model, held),
                "params_m": round(report["params"]["compressed"] / 1e6, 2),
                "gmacs": round(report["macs"]["compressed"] / 1e9, 3),
                "compress_s": round(seconds, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    write_dinov2_study(
        args.out,
        f"python -m lab.studies.dinov2_fidelity --calib {args.calib} --held-out "
        f"{args.held_out} --ridge {args.ridge} --only '{args.only}' --out {args.out}",
        rows=rows,
    )


if __name__ == "__main__":
    main()
