"""Feature fidelity of a compressed model against its dense base, and held-out image sets."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from corp_deploy import CalibrationImages
from corp_deploy.calibration import BUILTIN_PHOTOS

# The bundled photos are split so that held-out images never come from a calibration photo.
HELD_OUT_PHOTOS = ("astronaut.png", "coffee.png", "motorcycle_right.png", "coins.png", "grass.png")
CALIBRATION_PHOTOS = tuple(p for p in BUILTIN_PHOTOS if p not in HELD_OUT_PHOTOS)


def split_builtin_images(transform, n_calib: int, n_held_out: int, batch_size: int = 32, seed: int = 0
                         ) -> tuple[CalibrationImages, CalibrationImages]:
    """Calibration and held-out sets from disjoint bundled photos (seeded crops and flips)."""
    calib = CalibrationImages.from_builtin(transform, count=n_calib, batch_size=batch_size, seed=seed,
                                           photos=CALIBRATION_PHOTOS)
    held = CalibrationImages.from_builtin(transform, count=n_held_out, batch_size=batch_size,
                                          seed=seed + 1, photos=HELD_OUT_PHOTOS)
    return calib, held


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
