"""Calibration and held-out images for the studies, and the feature cosine they report.

Calibration and held-out sets are seeded crops and flips of disjoint bundled photos, so a
study's fidelity numbers are always held out.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.fidelity import held_out_images
from corp_deploy import CalibrationImages
from corp_deploy.calibration import CALIBRATION_PHOTOS


def split_builtin_images(transform, n_calib: int, n_held_out: int, batch_size: int = 32, seed: int = 0
                         ) -> tuple[CalibrationImages, CalibrationImages]:
    """Calibration and held-out sets from disjoint bundled photos (seeded crops and flips)."""
    calib = CalibrationImages.from_builtin(transform, count=n_calib, batch_size=batch_size, seed=seed,
                                           photos=CALIBRATION_PHOTOS)
    return calib, held_out_images(transform, n_held_out, batch_size, seed)


@torch.no_grad()
def feature_cosine(reference: nn.Module, candidate: nn.Module, batches: Iterable[torch.Tensor]) -> dict:
    """Mean per-image cosine between two models' outputs (pooled features or logits) and
    between their final token features (``forward_features``, all tokens flattened)."""
    pooled, tokens = [], []
    for x in batches:
        fr, fc = reference.forward_features(x), candidate.forward_features(x)
        pooled.append(F.cosine_similarity(reference.forward_head(fr), candidate.forward_head(fc), dim=-1))
        tokens.append(F.cosine_similarity(fr.flatten(1), fc.flatten(1), dim=-1))
    return {"output_cosine": float(torch.cat(pooled).mean()), "token_cosine": float(torch.cat(tokens).mean())}
