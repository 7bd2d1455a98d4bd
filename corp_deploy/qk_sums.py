"""The sums over calibration images that one query/key head's system needs (docs/method.md §3, §8),
in one of two forms with one interface.

Per image ``i`` (or attention group, for windowed attention) and head: ``A_i = Q_i^T Q_i`` and
``G_i = K_i^T K_i``, ``d x d``. CORP's ranking, normal equations, ridge and logit errors are all
sums over images of products of one entry of ``A_i`` and one of ``G_i``, that is, entries of the
Kronecker sum ``Z = sum_i A_i ⊗ G_i`` (``Z[(p, q), (r, s)] = sum_i A_i[p, r] G_i[q, s]``):

* :class:`ImageGrams` keeps the per-image Grams ``(N, d, d)`` and sums what is asked over the images
  (memory grows with ``N``; a system over the ``k`` kept dims costs ``N k^4 / 4``);
* :class:`KroneckerSums` keeps ``Z`` itself, packed over the Grams' upper triangles:
  ``(m, m)`` float64 with ``m = d (d + 1) / 2`` (34.6 MB at ``d = 64``), whatever ``N``.

Both answer every question exactly (the second up to float64 summation order), so the solvers in
:mod:`corp_deploy.attention` take either.
"""

from __future__ import annotations

import torch


def packed_index(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(d, d)`` long: entry ``[p, r]`` is the position of ``A[min(p, r), max(p, r)]`` in the packed
    upper triangle (row-major, ``torch.triu_indices`` order), symmetric."""
    iu = torch.triu_indices(d, d, device=device)
    index = torch.empty(d, d, dtype=torch.long, device=device)
    index[iu[0], iu[1]] = torch.arange(iu.shape[1], device=device)
    index[iu[1], iu[0]] = index[iu[0], iu[1]]
    return index


def pack(grams: torch.Tensor) -> torch.Tensor:
    """Upper triangles of symmetric ``(..., d, d)`` Grams as ``(..., m)`` float64, ``m = d (d + 1) / 2``."""
    d = grams.shape[-1]
    iu = torch.triu_indices(d, d, device=grams.device)
    return grams[..., iu[0], iu[1]].double()


def _gather(z: torch.Tensor, index: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``Z[(p, q), (p', q')] = z[idx(p, p'), idx(q, q')]`` for the listed pairs from the packed sum
    ``z``, through ``Z`` unpacked over the dims the pairs use (``[p, p', q, q']``, ``k^4`` entries for
    ``k`` dims) and gathered in the pairs' order."""
    dims = torch.unique(torch.cat([p, q]))  # sorted
    flat = index[dims][:, dims].reshape(-1)
    k = len(dims)
    unpacked = z[flat[:, None], flat[None, :]].view(k, k, k, k)
    p, q = torch.searchsorted(dims, p), torch.searchsorted(dims, q)
    return unpacked[p[:, None], p[None, :], q[:, None], q[None, :]]


class ImageGrams:
    """One head's per-image query and key Grams ``a``, ``g``: ``(N, d, d)`` (float32 or float64;
    every sum is formed in float64)."""

    def __init__(self, a: torch.Tensor, g: torch.Tensor) -> None:
        self.a, self.g = a, g
        self.n, self.d = a.shape[0], a.shape[-1]

    def products(self) -> torch.Tensor:
        """``sum_i A_i ∘ G_i`` (elementwise), ``(d, d)`` float64."""
        return (self.a.double() * self.g.double()).sum(0)

    def trace_product(self) -> float:
        """``sum_i tr(A_i) tr(G_i)`` (``= tr Z``)."""
        traces = torch.diagonal(self.a, dim1=-2, dim2=-1).double().sum(-1) * torch.diagonal(
            self.g, dim1=-2, dim2=-1
        ).double().sum(-1)
        return float(traces.sum())

    def cross(self, inner: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
        """``sum_i A_i[outer, inner] G_i[inner, outer]``, ``(len(outer), len(outer))`` float64."""
        return (self.a[:, outer][:, :, inner].double() @ self.g[:, inner][:, :, outer].double()).sum(0)

    def kronecker(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``Z`` with rows and columns listed by the index pairs ``(p[j], q[j])``: ``(m, m)`` float64,
        ``m = len(p)``. Formed over the dims the pairs use only (one product of the packed Grams)."""
        dims = torch.unique(torch.cat([p, q]))  # sorted
        z = pack(self.a[:, dims][:, :, dims]).T @ pack(self.g[:, dims][:, :, dims])
        return _gather(z, packed_index(len(dims), z.device), torch.searchsorted(dims, p), torch.searchsorted(dims, q))


class KroneckerSums:
    """One head's Kronecker sum ``Z`` packed over the Grams' upper triangles, ``(m, m)`` float64
    (``z[u, v] = sum_i pack(A_i)[u] pack(G_i)[v]``), over ``n`` images of head dim ``d``. Its
    methods answer as :class:`ImageGrams`'s do, each by an index gather from ``z``."""

    def __init__(self, z: torch.Tensor, n: int, d: int) -> None:
        self.z, self.n, self.d = z, n, d
        self.index = packed_index(d, z.device)

    def products(self) -> torch.Tensor:
        return self.z.diagonal()[self.index]

    def trace_product(self) -> float:
        diagonal = self.index.diagonal()
        return float(self.z[diagonal][:, diagonal].sum())

    def cross(self, inner: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
        rows = self.index[outer][:, inner]  # [p, r] -> idx(p, r)
        cols = self.index[inner][:, outer]  # [r, s] -> idx(r, s)
        return self.z[rows[:, :, None], cols[None, :, :]].sum(1)

    def kronecker(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return _gather(self.z, self.index, p, q)


QKSums = ImageGrams | KroneckerSums
