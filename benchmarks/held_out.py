"""The feature cosine the studies report, on held-out images.

The studies calibrate and measure on :func:`corp_deploy.calibration.split_builtin_images`:
seeded crops and flips of disjoint bundled photos, so a study's fidelity numbers are always held
out.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from exporters.metrics import tensor_cosine


@torch.no_grad()
def feature_cosine(reference: nn.Module, candidate: nn.Module, batches: Iterable[torch.Tensor]) -> dict:
    """Mean per-image cosine between two models' outputs (pooled features or logits) and
    between their final token features (``forward_features``, all tokens flattened)."""
    pooled, tokens = [], []
    for x in batches:
        fr, fc = reference.forward_features(x), candidate.forward_features(x)
        pooled.append(tensor_cosine(reference.forward_head(fr), candidate.forward_head(fc)))
        tokens.append(tensor_cosine(fr.flatten(1), fc.flatten(1)))
    return {"output_cosine": float(torch.cat(pooled).mean()), "token_cosine": float(torch.cat(tokens).mean())}
