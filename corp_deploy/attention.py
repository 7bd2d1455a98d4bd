"""Attention query/key head-dim pruning with the exact Kronecker compensation (docs/method.md §3).

Per head and calibration image ``i``: ``Q^i = X^i Wq^T + bq`` and ``K^i`` (tokens x d).
Everything here works on per-image Gram matrices ``A^i = Q^i^T Q^i`` and
``G^i = K^i^T K^i`` of the full head dim, shape ``(N_images, H, d, d)`` float64, from
which ranking scores, the normal equations and the logit errors all follow exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import PrunedAttention


def qk_dim_scores(a_full: torch.Tensor, g_full: torch.Tensor) -> torch.Tensor:
    """``s_j = E_image[ ||q_j||^2 ||k_j||^2 ]`` per head and dim: ``(H, d)`` float64."""
    return (torch.diagonal(a_full, dim1=-2, dim2=-1) * torch.diagonal(g_full, dim1=-2, dim2=-1)).mean(0)


def split_head_dims(scores: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the ``kept`` highest-scoring dims ``S`` and the rest ``P``; ``(H, kept)``,
    ``(H, d - kept)``, each row ascending."""
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    return order[:, :kept].sort(dim=1).values, order[:, kept:].sort(dim=1).values


def kronecker_sum(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_i A_i ⊗ G_i`` for symmetric ``A_i, G_i`` of shape ``(N, k, k)``: ``(k^2, k^2)``.

    Formed as one product ``sum_i vec(A_i) vec(G_i)^T`` over the packed upper triangles
    (``k(k+1)/2`` entries, symmetry makes the rest copies), then unpacked and permuted
    from ``[(a, c), (b, d)]`` to ``[(a, b), (c, d)]`` (row-major ``vec``).
    """
    k = a.shape[-1]
    iu = torch.triu_indices(k, k, device=a.device)
    packed = torch.empty(k, k, dtype=torch.long, device=a.device)
    packed[iu[0], iu[1]] = torch.arange(iu.shape[1], device=a.device)
    packed[iu[1], iu[0]] = packed[iu[0], iu[1]]
    z_packed = a[:, iu[0], iu[1]].T @ g[:, iu[0], iu[1]]
    flat = packed.reshape(-1)
    z = z_packed[flat][:, flat]
    return z.reshape(k, k, k, k).permute(0, 2, 1, 3).reshape(k * k, k * k)


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


def solve_head(a_full: torch.Tensor, g_full: torch.Tensor, kept: torch.Tensor, pruned: torch.Tensor,
               alpha: float, compensate: bool = True) -> HeadSolution:
    """Solve ``(sum_i A_i ⊗ G_i + lambda I) vec(M) = vec(sum_i C_i)`` for one head.

    Args:
        a_full, g_full: ``(N, d, d)`` per-image query and key Grams of this head.
        kept, pruned: index tensors ``S`` and ``P`` into the head dim.
        alpha: scale-free ridge; ``lambda = alpha * tr(K) / d'^2``.
        compensate: False gives ``M = 0`` (plain slicing), errors still reported.
    """
    n = a_full.shape[0]
    k = len(kept)
    order = torch.cat([kept, pruned])  # S first: every block below is a view
    a = a_full[:, order][:, :, order]
    g = g_full[:, order][:, :, order]
    a_ss, g_ss = a[:, :k, :k], g[:, :k, :k]
    err_unc = float((a[:, k:, k:] * g[:, k:, k:]).sum())
    energy = float((a_full * g_full).sum())
    if not compensate or len(pruned) == 0:
        zero = torch.zeros(k, k, dtype=a_full.dtype, device=a_full.device)
        return HeadSolution(zero, 0.0, err_unc / n, err_unc / n, energy / n)
    rhs = (a[:, :k, k:] @ g[:, k:, :k]).sum(0).reshape(-1, 1)
    lhs = kronecker_sum(a_ss, g_ss)
    lam = alpha * float(torch.trace(lhs)) / (k * k)
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


def factor_identity_plus(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U, V`` with ``U V^T = I + M`` (not symmetrised), from the SVD of ``I + M``.

    ``I + M = R diag(sig) T^T``, ``U = R diag(sqrt(sig))``, ``V = T diag(sqrt(sig))``.
    ``M = 0`` gives ``U = V = I`` exactly.
    """
    k = m.shape[0]
    eye = torch.eye(k, dtype=m.dtype, device=m.device)
    if not torch.any(m != 0):
        return eye, eye
    r, sig, th = torch.linalg.svd(eye + m)
    root = sig.sqrt()
    return r * root, th.T * root


def fold_attention(attn: nn.Module, kept: torch.Tensor, ms: list[torch.Tensor]) -> PrunedAttention:
    """A :class:`PrunedAttention` with ``Q_S (I + M) K_S^T`` folded into query/key weights.

    Args:
        attn: timm ``Attention`` (fused ``qkv`` laid out ``[q | k | v]``, head-major).
        kept: ``(H, d')`` kept query/key dims per head.
        ms: per head ``M`` (``d' x d'``).
    Per head: ``Wq' = U^T Wq[S]``, ``bq' = U^T bq[S]``, ``Wk' = V^T Wk[S]``,
    ``bk' = V^T bk[S]``; value and output projection unchanged; the original softmax
    scale is kept.
    """
    H, d = attn.num_heads, attn.head_dim
    dim = attn.qkv.in_features
    kq = kept.shape[1]
    w = attn.qkv.weight.detach().double().reshape(3, H, d, dim)
    b = attn.qkv.bias.detach().double().reshape(3, H, d) if attn.qkv.bias is not None else None
    new = PrunedAttention(dim, H, kq, d, attn.scale, qkv_bias=b is not None,
                          proj_bias=attn.proj.bias is not None).to(attn.qkv.weight.device)
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
