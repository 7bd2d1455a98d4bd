"""CORP's query/key statistics (docs/method.md §3, §8): the sums over calibration images that one
query/key head's system needs, in one of two forms with one interface, and :class:`HeadGrams`,
which collects them for every head of an attention layer batch by batch.

Per image ``i`` (or attention group, for windowed attention) and head: ``A_i = Q_i^T Q_i`` and
``G_i = K_i^T K_i``, ``d x d``. CORP's ranking, normal equations, ridge and logit errors are all
sums over images of products of one entry of ``A_i`` and one of ``G_i``, that is, entries of the
Kronecker sum ``Z = sum_i A_i ⊗ G_i`` (``Z[(p, q), (r, s)] = sum_i A_i[p, r] G_i[q, s]``):

* :class:`ImageGrams` keeps the per-image Grams ``(N, d, d)`` and sums what is asked over the images
  (memory grows with ``N``; a system over the ``k`` kept dims costs ``N k^4 / 4``);
* :class:`KroneckerSums` keeps ``Z`` itself, packed over the Grams' upper triangles:
  ``(m, m)`` float64 with ``m = d (d + 1) / 2`` (34.6 MB at ``d = 64``), whatever ``N``.

Both answer every question exactly (the second up to float64 summation order), so the solvers in
:mod:`.qk_pruning` take either.
"""

from __future__ import annotations

import torch

from ... import distributed
from ...stats import check_finite_sums

#: What :class:`HeadGrams` sums, for messages.
_ACTIVATIONS = "the attention's queries and keys"


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
    """The query/key statistics of one attention layer, collected batch by batch: the per-image
    Grams until they would take more memory than their packed Kronecker sums (past
    :func:`images_worth_the_sums` images: 1056 at head dim 64, or attention groups for windowed
    attention), then those sums, into which the Grams kept so far and every later batch's are
    folded. Memory stays at most about twice the sums' (34.6 MB per head at head dim 64) whatever
    the number of images.

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
        """Every head's sums, in head order, checked to be finite (:func:`~corp_deploy.stats.check_finite_sums`)."""
        if self.kronecker is not None:
            check_finite_sums(_ACTIVATIONS, self.kronecker)
            return [KroneckerSums(z, self.n, self.d) for z in self.kronecker]
        a, g = torch.cat(self.query), torch.cat(self.key)
        check_finite_sums(_ACTIVATIONS, a, g)
        return [ImageGrams(a[:, h], g[:, h]) for h in range(a.shape[1])]
