"""CORP's query/key head-dim pruning with the exact Kronecker compensation (docs/method.md §3):
ranking, the per-head solves and error curves, and the fold into a :class:`PrunedAttention`.

Per head and calibration image ``i``: ``Q^i = X^i Wq^T + bq`` and ``K^i`` (tokens x d).
Everything here works on the per-image Gram matrices ``A^i = Q^i^T Q^i`` and
``G^i = K^i^T K^i`` of the full head dim, through the sums over images that
:mod:`.qk_statistics` forms from them (kept per image or as their Kronecker sum), from
which ranking scores, the normal equations and the logit errors all follow exactly.

The ridge is ``lambda = alpha * tr(sum_i A_i ⊗ G_i) / d^2`` over the full head dim, the same
whichever dims are kept, so that the systems of nested kept sets are nested (:func:`head_curve`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...layers import PrunedAttention, head_dims
from .qk_statistics import QKSums


def qk_dim_scores(heads: list[QKSums]) -> torch.Tensor:
    """``s_j = E_image[ ||q_j||^2 ||k_j||^2 ]`` per head and dim: ``(H, d)`` float64."""
    return torch.stack([head.products().diagonal() / head.n for head in heads])


def split_head_dims(scores: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the ``kept`` highest-scoring dims ``S`` and the rest ``P``; ``(H, kept)``,
    ``(H, d - kept)``, each row ascending."""
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    return order[:, :kept].sort(dim=1).values, order[:, kept:].sort(dim=1).values


def head_ridge_lambda(sums: QKSums, alpha: float) -> float:
    """``alpha * tr(sum_i A_i ⊗ G_i) / d^2`` over the full head dim: the scale-free ridge,
    independent of the kept set."""
    return alpha * sums.trace_product() / (sums.d * sums.d)


@dataclass
class HeadSolution:
    """Compensation ``M`` (``d' x d'``, float64) of one head and its logit errors.

    Errors are ``sum_i ||L_i - L_i'||_F^2 / N`` in unscaled logit units (multiply by
    ``scale^2`` for the model's logits); ``logit_energy`` is ``sum_i ||Q^i K^i^T||_F^2 / N``.
    """

    M: torch.Tensor
    ridge_lambda: float
    error_uncompensated: float
    error_compensated: float
    logit_energy: float


def solve_head(
    sums: QKSums, kept: torch.Tensor, pruned: torch.Tensor, alpha: float, compensate: bool = True
) -> HeadSolution:
    """Solve ``(sum_i A_i ⊗ G_i + lambda I) vec(M) = vec(sum_i C_i)`` for one head.

    Args:
        sums: the head's query/key sums over images (:mod:`.qk_statistics`).
        kept, pruned: index tensors ``S`` and ``P`` into the head dim.
        alpha: scale-free ridge (:func:`head_ridge_lambda`).
        compensate: False gives ``M = 0`` (plain slicing), errors still reported.
    """
    n, k = sums.n, len(kept)
    products = sums.products()
    err_unc = float(products[pruned][:, pruned].sum())
    energy = float(products.sum())
    if not compensate or len(pruned) == 0:
        zero = torch.zeros(k, k, dtype=products.dtype, device=products.device)
        return HeadSolution(zero, 0.0, err_unc / n, err_unc / n, energy / n)
    rhs = sums.cross(pruned, kept).reshape(-1, 1)
    lhs = sums.kronecker(kept.repeat_interleave(k), kept.repeat(k))
    lam = head_ridge_lambda(sums, alpha)
    lhs.diagonal().add_(lam)
    chol, info = torch.linalg.cholesky_ex(lhs)
    if int(info) == 0:
        m_vec = torch.cholesky_solve(rhs, chol)
    else:
        m_vec = torch.linalg.lstsq(lhs.cpu(), rhs.cpu(), driver="gelsd").solution.to(lhs.device)
    # sum_i ||Q_P K_P^T - Q_S M K_S^T||^2 = err_unc - 2 <m, rhs> + m^T K m,  K = lhs - lam I
    quad = float(m_vec.T @ lhs @ m_vec) - lam * float(m_vec.square().sum())
    err_comp = err_unc - 2.0 * float((m_vec * rhs).sum()) + quad
    return HeadSolution(m_vec.reshape(k, k), lam, err_unc / n, max(err_comp, 0.0) / n, energy / n)


def head_curve(
    sums: QKSums, order: torch.Tensor, alpha: float, solutions_at: Iterable[int] = ()
) -> tuple[torch.Tensor, dict[int, HeadSolution]]:
    """The ridge objective of one head for every kept prefix ``S_k = order[:k]``, k = 0..d, and the
    solution (what :func:`solve_head` returns for ``S_k``) of the prefixes ``k`` in ``solutions_at``.

    ``J(k) = min_M sum_i ||Q_P K_P^T - Q_S M K_S^T||^2 + lambda ||M||^2`` divided by the number
    of images (unscaled logit units), ``(d + 1,)`` float64; the compensated logit error is
    ``J(k) - lambda ||M_k||^2 / N`` (exactly ``J`` when ``alpha = 0``).

    With the pairs ``(a, b)`` of ranked dims listed by ``max(a, b)``, the system of prefix ``k``
    is the leading ``k^2`` block of ``Zr = sum_i A_i ⊗ G_i + lambda I``, so one Cholesky
    factor ``L`` of ``Zr`` serves every ``k``. Its right-hand side is
    ``r_k = vec(sum_i A_i G_i)|_k - Zr_k e_k + lambda e_k`` (``e_k``: the identity of ``S_k``),
    hence ``L_k^-1 r_k = y_k - L_k^T e_k + lambda L_k^-1 e_k`` with ``y = L^-1 vec(sum_i A_i G_i)``,
    ``J(k) = err_sliced(k) - ||L_k^-1 r_k||^2`` and ``vec(M_k) = L_k^-T L_k^-1 r_k``
    (docs/method.md §8). Every ``M_k`` comes from one triangular solve with the full ``L^T``: its
    right-hand side ``L_k^-1 r_k`` padded with zeros has a solution that is zero beyond ``k^2``.
    Each ``M_k`` is ``(k, k)`` in the coordinates of ``S_k`` sorted ascending, as
    :func:`solve_head` and :func:`fold_attention` take it.
    Cost: a ``d^2 x d^2`` factorisation (``d^6 / 3`` multiply-adds).
    """
    n, d = sums.n, sums.d
    products = sums.products()
    device, dtype = products.device, products.dtype
    lam = head_ridge_lambda(sums, alpha)
    # pair (a, b) -> position in "max order": shell m = max(a, b) lists (m, 0..m), then (0..m-1, m)
    pairs = [p for m in range(d) for p in [(m, b) for b in range(m + 1)] + [(a_, m) for a_ in range(m)]]
    rows, cols = torch.tensor(pairs, device=device).T
    zr = sums.kronecker(order[rows], order[cols])
    zr.diagonal().add_(lam)
    chol = torch.linalg.cholesky(zr)
    del zr
    diag_pos = torch.tensor([m * m + m for m in range(d)], device=device)
    # one triangular solve for y = L^-1 r and the columns L^-1 e_(j) of the identity's diagonal pairs
    rhs = torch.zeros(d * d, d + 1, dtype=dtype, device=device)
    every = torch.arange(d, device=device)
    rhs[:, 0] = sums.cross(every, every)[order[rows], order[cols]]
    rhs[diag_pos, torch.arange(1, d + 1, device=device)] = 1.0
    solved = torch.linalg.solve_triangular(chol, rhs, upper=False)
    y, inv_e = solved[:, 0], solved[:, 1:].cumsum(1)  # column k-1 of inv_e: L^-1 e_k
    lt_e = chol[diag_pos].cumsum(0)  # row k-1: (L^T e_k)^T
    v = y - lt_e + lam * inv_e.T  # row k-1: L_k^-1 r_k on its first k^2 entries
    prefix = torch.arange(d * d, device=device) < torch.arange(1, d + 1, device=device)[:, None] ** 2
    ranked = products[order][:, order]  # sum_i A_i ∘ G_i: err_sliced(k) sums its trailing block [k:, k:]
    sliced = ranked.flip(0).cumsum(0).flip(0).flip(1).cumsum(1).flip(1).diagonal()
    curve = torch.zeros(d + 1, dtype=dtype, device=device)
    curve[0] = ranked.sum()
    curve[1:d] = sliced[1:] - (v.square() * prefix).sum(1)[: d - 1]
    energy = float(curve[0]) / n
    solutions_at = set(solutions_at)
    wanted = sorted(size for size in solutions_at if 0 < size < d)
    padded = torch.zeros(d * d, len(wanted), dtype=dtype, device=device)
    for column, k in enumerate(wanted):
        padded[: k * k, column] = v[k - 1, : k * k]
    m_vecs = torch.linalg.solve_triangular(chol.T, padded, upper=True)  # column j: vec(M_k), zero beyond k^2
    solutions = {}
    for column, k in enumerate(wanted):
        m_vec = m_vecs[: k * k, column]
        m_ranked = torch.zeros(k, k, dtype=dtype, device=device)
        m_ranked[rows[: k * k], cols[: k * k]] = m_vec
        ascending = torch.argsort(order[:k])
        compensated = float(curve[k]) - lam * float(m_vec.square().sum())  # J(k) without its ridge term
        solutions[k] = HeadSolution(
            m_ranked[ascending][:, ascending], lam, float(sliced[k]) / n, max(compensated, 0.0) / n, energy
        )
    if d in solutions_at:  # nothing pruned
        solutions[d] = HeadSolution(torch.zeros(d, d, dtype=dtype, device=device), 0.0, 0.0, 0.0, energy)
    return curve.clamp_min(0.0) / n, solutions


def factor_identity_plus(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U, V`` with ``U V^T = I + M`` (not symmetrised): the balanced split of the polar form.

    With the SVD ``I + M = R diag(sig) T^T``: ``V = T diag(sqrt(sig)) T^T`` (the square root of
    ``P = ((I + M)^T (I + M))^(1/2)``, symmetric, positive definite when ``I + M`` is invertible)
    and ``U = R diag(sqrt(sig)) T^T``, so ``U^T U = V^T V = P``. Both are functions of ``M`` alone:
    the SVD's free signs (and its free rotations between equal singular values) cancel, so every
    machine and LAPACK build folds the same weights up to rounding. ``M = 0`` gives ``U = V = I``
    exactly.
    """
    k = m.shape[0]
    eye = torch.eye(k, dtype=m.dtype, device=m.device)
    if not torch.any(m != 0):
        return eye, eye
    r, sig, th = torch.linalg.svd(eye + m)  # th = T^T
    root = sig.sqrt()
    return (r * root) @ th, (th.T * root) @ th


def fold_attention(attn: nn.Module, kept: torch.Tensor, ms: list[torch.Tensor]) -> PrunedAttention:
    """A :class:`PrunedAttention` with ``Q_S (I + M) K_S^T`` folded into query/key weights.

    Args:
        attn: timm ``Attention`` or a full-width :class:`PrunedAttention` (fused ``qkv`` laid out
            ``[q | k | v]``, head-major, query/key and value heads equally wide).
        kept: ``(H, d')`` kept query/key dims per head.
        ms: per head ``M`` (``d' x d'``).
    Per head: ``Wq' = U^T Wq[S]``, ``bq' = U^T bq[S]``, ``Wk' = V^T Wk[S]``,
    ``bk' = V^T bk[S]``; value and output projection unchanged; the original softmax
    scale is kept.
    """
    H, d = attn.num_heads, head_dims(attn)[0]
    dim = attn.qkv.in_features
    kq = kept.shape[1]
    w = attn.qkv.weight.detach().double().reshape(3, H, d, dim)
    b = attn.qkv.bias.detach().double().reshape(3, H, d) if attn.qkv.bias is not None else None
    new = PrunedAttention.replacing(attn, kq, d)
    wq, wk, bq, bk = [], [], [], []
    for h in range(H):
        S = kept[h]
        u, v = factor_identity_plus(ms[h])
        wq.append(u.T @ w[0, h, S])
        wk.append(v.T @ w[1, h, S])
        if b is not None:
            bq.append(u.T @ b[0, h, S])
            bk.append(v.T @ b[1, h, S])
    dtype = attn.qkv.weight.dtype
    with torch.no_grad():
        new.qkv.weight.copy_(torch.cat(wq + wk + [w[2].reshape(H * d, dim)]).to(dtype))
        if b is not None:
            new.qkv.bias.copy_(torch.cat(bq + bk + [b[2].reshape(H * d)]).to(dtype))
        new.proj.load_state_dict(attn.proj.state_dict())
    return new
