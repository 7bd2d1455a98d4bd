"""Streaming calibration statistics.

All accumulators take float32 activations, do the large products in float32 on
per-batch centred data, and keep their running sums in float64 (METHOD.md 1).
"""
from __future__ import annotations

import torch


def symmetric_gram(x: torch.Tensor, block: int = 768) -> torch.Tensor:
    """``x^T x`` for ``x`` of shape ``(n, d)``, computing only the upper block triangle.

    Same result as ``x.T @ x`` at about ``(1 + 1/k) / 2`` of its cost for ``k`` column
    blocks; the lower blocks are mirrored.
    """
    d = x.shape[1]
    if d <= block:
        return x.T @ x
    out = torch.empty(d, d, dtype=x.dtype, device=x.device)
    starts = list(range(0, d, block))
    for i in starts:
        xi = x[:, i:i + block]
        for j in starts:
            if j < i:
                continue
            g = xi.T @ x[:, j:j + block]
            out[i:i + block, j:j + block] = g
            if j > i:
                out[j:j + block, i:i + block] = g.T
    return out


class MomentAccumulator:
    """Mean, covariance and sign frequency of ``d``-dim samples, streamed in batches.

    Batches are merged with Chan et al.'s parallel update: for each batch the centred
    Gram ``M2_b = sum (x - mean_b)(x - mean_b)^T`` is formed in float32, then
    ``M2 += M2_b + delta delta^T * n_a n_b / n`` in float64.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        self.positive = torch.zeros(dim, dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` of shape ``(n_b, d)`` (any leading dims are flattened)."""
        x = x.reshape(-1, x.shape[-1]).float()
        nb = x.shape[0]
        if nb == 0:
            return
        mean_b = x.mean(0)
        m2_b = symmetric_gram(x - mean_b).double()
        mean_b = mean_b.double()
        self.positive += (x > 0).sum(0).double()
        n = self.n + nb
        delta = mean_b - self.mean
        self.m2 += m2_b + torch.outer(delta, delta) * (self.n * nb / n)
        self.mean += delta * (nb / n)
        self.n = n

    @property
    def covariance(self) -> torch.Tensor:
        """Population covariance ``E[(x - mu)(x - mu)^T]``, float64 ``(d, d)``."""
        return self.m2 / max(self.n, 1)

    @property
    def second_moment_diag(self) -> torch.Tensor:
        """``E[x_j^2]`` per dim, float64 ``(d,)``."""
        return torch.diagonal(self.covariance) + self.mean ** 2

    @property
    def positive_rate(self) -> torch.Tensor:
        """``P(x_j > 0)`` per dim, float64 ``(d,)``."""
        return self.positive / max(self.n, 1)


def per_image_head_grams(t: torch.Tensor) -> torch.Tensor:
    """Per-image, per-head Gram matrices ``T^T T`` of query or key activations.

    Args:
        t: ``(B, H, N, d)`` activations of B images (N tokens each), float32.
    Returns:
        ``(B, H, d, d)`` float64, formed in float32 (a sum over one image's tokens).
    """
    return (t.transpose(-1, -2) @ t).double()
