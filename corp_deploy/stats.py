"""Streaming calibration statistics.

All accumulators take float32 activations, do the large products in float32 on
per-batch centred data, and keep their running sums in float64 (docs/method.md §1).
"""

from __future__ import annotations

import numpy as np
import torch

from . import distributed
from .qk_sums import ImageGrams, KroneckerSums, QKSums, pack


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
    matrix is held), so no samples can be added after that.
    """

    def __init__(
        self, dim: int, device: torch.device | str = "cpu", *, track_positive: bool = True, flush_samples: int = 65536
    ) -> None:
        self.n = 0
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


def per_image_head_grams(t: torch.Tensor) -> torch.Tensor:
    """Per-image, per-head Gram matrices ``T^T T`` of query or key activations.

    Args:
        t: ``(B, H, N, d)`` activations of B images (N tokens each), float32.
    Returns:
        ``(B, H, d, d)`` float32 (a sum over one image's tokens; every sum over images is float64).
    """
    t = t.contiguous()  # batched matmul on a strided view is several times slower
    return t.transpose(-1, -2) @ t


def images_worth_the_sums(head_dim: int) -> int:
    """Images whose per-image query and key Grams (float32) take the memory of the packed Kronecker
    sum (float64, ``(d(d+1)/2)^2`` per head): 1056 at head dim 64, 272 at 32."""
    m = head_dim * (head_dim + 1) // 2
    return m * m * 8 // (2 * head_dim * head_dim * 4)


class HeadGrams:
    """The query/key statistics of one attention layer, collected batch by batch
    (:mod:`corp_deploy.qk_sums`): the per-image Grams until they would take more memory than their
    packed Kronecker sums (past :func:`images_worth_the_sums` images: 1056 at head dim 64, or
    attention groups for windowed attention), then those sums, into which the Grams kept so far
    and every later batch's are folded. Memory stays at most about twice the sums' (34.6 MB per
    head at head dim 64) whatever the number of images.

    ``summed_after``: switch after this many images instead (0: from the first batch on).
    """

    def __init__(self, summed_after: int | None = None) -> None:
        self.summed_after = summed_after
        self.n = self.d = 0
        self.query: list[torch.Tensor] = []  # (B, H, d, d) float32 per batch, until the switch
        self.key: list[torch.Tensor] = []
        self.kronecker: torch.Tensor | None = None  # (H, m, m) float64 from the switch on

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """``q``, ``k``: ``(B, H, N, d)`` (``v`` is not used: the signature of a heads probe)."""
        a, g = per_image_head_grams(q), per_image_head_grams(k)
        self.n, self.d = self.n + a.shape[0], a.shape[-1]
        if self.kronecker is not None:
            self._fold(a, g)
            return
        self.query.append(a)
        self.key.append(g)
        if self.n > self._image_limit():
            self._switch_to_sums()

    def _image_limit(self) -> int:
        return self.summed_after if self.summed_after is not None else images_worth_the_sums(self.d)

    def _fold(self, a: torch.Tensor, g: torch.Tensor) -> None:
        """Add ``sum_i pack(A_i) pack(G_i)^T`` per head to the sums (``a``, ``g``: ``(B, H, d, d)``)."""
        a, g = pack(a), pack(g)  # (B, H, m)
        if self.kronecker is None:
            self.kronecker = a.new_zeros(a.shape[1], a.shape[2], a.shape[2])
        self.kronecker.baddbmm_(a.permute(1, 2, 0), g.transpose(0, 1))

    def _switch_to_sums(self) -> None:
        """Fold the Grams kept so far into the sums, freeing them batch by batch."""
        while self.query:
            self._fold(self.query.pop(0), self.key.pop(0))

    def all_reduce(self) -> None:
        """Sum over the ranks of torch.distributed (no-op in one process): where the whole set's
        images pass the limit every rank switches to the sums (a rank that switched while adding
        holds more than the limit itself) and the sums are summed, else the per-image Grams are
        gathered in rank order."""
        if not distributed.active():
            return
        total = sum(distributed.gather_counts(self.n))
        if total > self._image_limit():
            self._switch_to_sums()
            distributed.all_reduce_sum(self.kronecker)
        else:
            self.query = [distributed.all_gather_rows(torch.cat(self.query))]
            self.key = [distributed.all_gather_rows(torch.cat(self.key))]
        self.n = total

    def heads(self) -> list[QKSums]:
        """Every head's sums, in head order."""
        if self.kronecker is not None:
            return [KroneckerSums(z, self.n, self.d) for z in self.kronecker]
        a, g = torch.cat(self.query), torch.cat(self.key)
        return [ImageGrams(a[:, h], g[:, h]) for h in range(a.shape[1])]
