"""Numerical parity between two backends' outputs (max abs/rel error, cosine, top-1 agreement)."""
from __future__ import annotations

import numpy as np


def compare_outputs(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """Compare two ``(batch, features)`` outputs row by row.

    Returns ``max_abs``, ``max_rel`` (``|a - b| / max(|a|, 1e-6 * max|a|)``), ``cosine``
    (the smallest per-row cosine) and ``top1_agreement`` (fraction of rows whose argmax agree).
    """
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    cand = np.asarray(candidate, dtype=np.float64).reshape(len(candidate), -1)
    if ref.shape != cand.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {cand.shape}")
    diff = np.abs(ref - cand)
    floor = max(1e-6 * float(np.abs(ref).max(initial=0.0)), 1e-12)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    cosine = np.sum(ref * cand, axis=1) / np.maximum(norms, 1e-30)
    return {"max_abs": float(diff.max(initial=0.0)),
            "max_rel": float((diff / np.maximum(np.abs(ref), floor)).max(initial=0.0)),
            "cosine": float(cosine.min(initial=1.0)),
            "top1_agreement": float(np.mean(ref.argmax(1) == cand.argmax(1)))}


def onnxruntime_outputs(onnx_path, images: np.ndarray) -> np.ndarray:
    """Run an ONNX file on ONNX Runtime's CPU provider (always available)."""
    import onnxruntime as ort
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images.astype(np.float32)})[0]
