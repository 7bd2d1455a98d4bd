"""Streaming calibration statistics: :class:`MomentAccumulator`, the mean and covariance of
activations (CORP's query/key statistics: :mod:`corp_deploy.methods.corp.qk_statistics`).

It takes float32 activations, does the large products in float32 on per-batch centred data, and
keeps its running sums in float64 (docs/method.md §1). Every statistic checks its sums when first
read, before anything is solved from them (:func:`check_finite_sums`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import distributed
from .errors import CorpError

#: What the statistics of CORP and its peers are taken of, as :func:`check_finite_sums` names them.
MLP_HIDDEN, PROJ_INPUTS = "the MLP hidden activations", "the inputs of the attention's output projection"


def check_finite_sums(activations: str, *sums: torch.Tensor) -> None:
    """CorpError when any of ``sums`` over the calibration samples of ``activations`` (what they are,
    e.g. ``the MLP hidden activations``) holds NaN or infinity: the activations overflowed float32
    (or their sums float64), as on images far larger than normalised ones, and nothing solved from
    them could mean anything."""
    if not all(bool(torch.isfinite(tensor).all()) for tensor in sums):
        raise CorpError(
            f"the calibration activations overflowed: the sums of {activations} over the calibration images are "
            "infinite or NaN; give images preprocessed as the model's transform does (normalised values of a few units)"
        )


def _add_lower_gram(out: torch.Tensor, x: torch.Tensor, block: int = 384) -> None:
    """``out += x^T x`` on the lower triangle of ``out`` (``(d, d)``); ``x``: ``(n, d)``.

    On the CPU in float32 this is BLAS ``ssyrk`` (half the products of ``x.T @ x``);
    elsewhere column panels of ``block`` columns, about ``(1 + 1/k) / 2`` of the products
    for ``k`` panels. The strict upper triangle of ``out`` is left unchanged (zero in
    the accumulators); :func:`symmetrize_lower_` completes the matrix.
    """
    if out.device.type == "cpu" and out.dtype == x.dtype == torch.float32 and out.is_contiguous():
        from scipy.linalg.blas import ssyrk

        c = out.numpy().T  # Fortran-ordered view: its upper triangle is out's lower one
        result = ssyrk(1.0, x.contiguous().numpy().T, beta=1.0, c=c, trans=0, lower=0, overwrite_c=1)
        if result is not c and not np.shares_memory(result, c):
            c[...] = result
        return
    d = x.shape[1]
    for i in range(0, d, block):
        out[i:, i : i + block].addmm_(x[:, i:].T, x[:, i : i + block])


def symmetrize_lower_(matrix: torch.Tensor, block: int = 384) -> torch.Tensor:
    """Copy the lower triangle of square ``matrix`` onto its upper one, in place, by row
    panels of ``block`` rows (cache-friendlier than one big transpose); returns it."""
    d = matrix.shape[0]
    for i in range(0, d, block):
        diag = matrix[i : i + block, i : i + block]
        diag.copy_(torch.tril(diag) + torch.tril(diag, -1).T)
        matrix[i : i + block, i + block :] = matrix[i + block :, i : i + block].T
    return matrix


class MomentAccumulator:
    """Mean, covariance and (optionally) sign frequency of ``d``-dim samples, streamed.

    Uses the shifted-data algorithm: samples are centred on a fixed shift ``K`` (the
    first batch's mean), ``sum (x - K)`` is kept in float64 and the Gram
    ``sum (x - K)(x - K)^T`` is accumulated in float32 by in-place symmetric rank-k
    updates (one triangle) and flushed into a float64 total every ``flush_samples``
    samples. Then ``Sigma = G / n - delta delta^T`` with
    ``delta = sum (x - K) / n`` in float64; since ``K`` is close to the mean,
    ``delta`` is small and the subtraction loses little precision.

    The covariance is formed in place of the Gram when first read (no second ``d x d`` float64
    matrix is held), so no samples can be added after that; it is then checked to be finite, with
    the sum (:func:`check_finite_sums`, naming ``activations``: what the samples are).
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str = "cpu",
        *,
        track_positive: bool = True,
        flush_samples: int = 65536,
        activations: str = "the activations",
    ) -> None:
        self.n = 0
        self.activations = activations
        self._flush_samples = flush_samples
        self._shift: torch.Tensor | None = None
        self._sum = torch.zeros(dim, dtype=torch.float64, device=device)
        self._gram64 = torch.zeros(dim, dim, dtype=torch.float64, device=device)
        self._gram32 = torch.zeros(dim, dim, dtype=torch.float32, device=device)
        self._pending = 0
        self._covariance: torch.Tensor | None = None
        self.positive = torch.zeros(dim, dtype=torch.float64, device=device) if track_positive else None
        self._reduced = False

    #: Rows centred and added at a time, as a number of elements: bounds the float32 copy that
    #: :meth:`update` makes (64 MiB whatever the batch).
    CHUNK_ELEMENTS = 1 << 24

    def update(self, *parts: torch.Tensor) -> None:
        """Add samples: ``parts`` of shapes ``(..., d_j)`` with equal leading dims (flattened), joined
        along the last dim into ``d``-dim samples (one part: the samples themselves). The joined and
        centred float32 copy is made :data:`CHUNK_ELEMENTS` at a time."""
        if self._reduced:
            raise RuntimeError("samples added after all_reduce: the sums of the ranks would be counted twice")
        self._check_open()
        parts = [part.reshape(-1, part.shape[-1]) for part in parts]
        rows = parts[0].shape[0]
        if rows == 0:
            return
        if self._shift is None:
            self._shift = torch.cat([part.float().mean(0) for part in parts])
        step = max(1, self.CHUNK_ELEMENTS // len(self._shift))
        for start in range(0, rows, step):
            chunk = [part[start : start + step].float() for part in parts]
            x = chunk[0] if len(chunk) == 1 else torch.cat(chunk, -1)
            if self.positive is not None:
                self.positive += torch.count_nonzero(x > 0, dim=0).double()
            xc = x - self._shift
            self._sum += xc.sum(0).double()
            _add_lower_gram(self._gram32, xc)
        self.n += rows
        self._pending += rows
        if self._pending >= self._flush_samples:
            self._flush()

    def all_reduce(self) -> None:
        """Sum the statistics over the ranks of torch.distributed (no-op in one process): every
        rank then holds those of all ranks' samples; no samples may be added afterwards.

        Each rank's sums are first moved onto a common shift ``c`` (the ranks' shifts averaged,
        weighted by their samples) with ``delta = K_r - c``: ``sum (x - c) = s + n delta`` and
        ``sum (x - c)(x - c)^T = G + delta s^T + s delta^T + n delta delta^T``."""
        if not distributed.active():
            return
        self._check_open()
        self._flush()
        own = self._shift.double() if self._shift is not None else self._sum.new_zeros(self._sum.shape)
        weighted = distributed.all_reduce_sum(torch.cat([own * self.n, own.new_tensor([self.n])]))
        total = int(weighted[-1])
        common = weighted[:-1] / max(total, 1)
        delta = own - common
        self._gram64 += (
            torch.outer(delta, self._sum) + torch.outer(self._sum, delta) + self.n * torch.outer(delta, delta)
        )
        self._sum += self.n * delta
        distributed.all_reduce_sum(self._sum)
        distributed.all_reduce_sum(self._gram64)
        if self.positive is not None:
            distributed.all_reduce_sum(self.positive)
        self.n, self._shift = total, common
        self._reduced = True

    def _check_open(self) -> None:
        if self._gram64 is None:
            raise RuntimeError("samples added after the covariance was read: it replaced the sums")

    def _flush(self) -> None:
        self._gram64 += self._gram32
        self._gram32.zero_()
        self._pending = 0

    @property
    def mean(self) -> torch.Tensor:
        """``E[x]``, float64 ``(d,)``."""
        shift = self._shift.double() if self._shift is not None else 0.0
        return self._sum / max(self.n, 1) + shift

    @property
    def covariance(self) -> torch.Tensor:
        """Population covariance ``E[(x - mu)(x - mu)^T]``, float64 ``(d, d)`` (formed once, in place
        of the Gram)."""
        if self._covariance is None:
            self._flush()
            n = max(self.n, 1)
            delta = self._sum / n
            self._covariance = symmetrize_lower_(self._gram64).mul_(1.0 / n).addr_(delta, delta, alpha=-1.0)
            self._gram64 = self._gram32 = None
            check_finite_sums(self.activations, self._sum, self._covariance)
        return self._covariance

    @property
    def second_moment_diag(self) -> torch.Tensor:
        """``E[x_j^2]`` per dim, float64 ``(d,)``."""
        return torch.diagonal(self.covariance) + self.mean**2

    @property
    def positive_rate(self) -> torch.Tensor:
        """``P(x_j > 0)`` per dim, float64 ``(d,)`` (needs ``track_positive``)."""
        if self.positive is None:
            raise ValueError("this accumulator was created with track_positive=False")
        return self.positive / max(self.n, 1)
