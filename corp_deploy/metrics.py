"""How close two models' outputs are, computed here and nowhere else: per-image cosine,
top-1 agreement and the KL divergence of the softmax outputs.

Rows are images: outputs are ``(B, features)`` (or ``(B, classes)`` logits) and every metric
compares them row by row. Two forms, each where its numbers are reported:

* host arrays (what runners return, :mod:`exporters.runners`): NumPy float64, cosine
  ``a.b / max(|a| |b|, 1e-30)``; the export's parity gate and ``bench``'s int8 fidelity;
* tensors (PyTorch model outputs, in the caller's dtype): cosine from
  ``torch.nn.functional.cosine_similarity`` (each norm floored at 1e-8); ``bench``'s fidelity,
  the recovery's validation and its distillation loss (differentiable), and the studies.

On the lowest floor (numpy and torch only), so that every room that measures imports it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def as_rows(outputs: np.ndarray) -> np.ndarray:
    """``(B, ...)`` outputs as float64 rows ``(B, D)``."""
    return np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)


def cosine(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per-row cosine ``(B,)`` of two float64 ``(B, D)`` arrays (:func:`as_rows`)."""
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(candidate, axis=1)
    return np.sum(reference * candidate, axis=1) / np.maximum(norms, 1e-30)


def tensor_cosine(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Per-row cosine ``(B,)`` of two ``(B, D)`` tensors, in their dtype."""
    return F.cosine_similarity(reference, candidate, dim=-1)


def top1_matches(reference, candidate):
    """Whether each row's argmax agrees, ``(B,)`` bool: NumPy arrays or tensors ``(B, classes)``.
    A row with a NaN or infinite value on either side never agrees (argmax would pick the NaN)."""
    finite = torch.isfinite if isinstance(reference, torch.Tensor) else np.isfinite
    return (reference.argmax(-1) == candidate.argmax(-1)) & finite(reference).all(-1) & finite(candidate).all(-1)


def kl_divergence_sum(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``sum_rows KL(softmax(reference) || softmax(candidate))`` of two ``(B, classes)`` logit
    tensors, in float64 (a scalar tensor; one sum over all ``B * classes`` terms)."""
    logp_r, logp_c = F.log_softmax(reference.double(), -1), F.log_softmax(candidate.double(), -1)
    return (logp_r.exp() * (logp_r - logp_c)).sum()
