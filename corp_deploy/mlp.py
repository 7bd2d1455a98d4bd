"""MLP hidden-channel pruning with centred ridge compensation (docs/method.md §2).

Conventions: ``h = act(fc1(x))`` has ``H`` channels; ``fc2(h) = h @ W2.T + b2`` with
``W2`` of shape ``(out, H)``. ``S`` are the kept channels (ascending), ``P`` the pruned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .stats import MomentAccumulator


def channel_scores(stats: MomentAccumulator, w2: torch.Tensor, ranker: str) -> torch.Tensor:
    """Importance of each hidden channel, float64 ``(H,)``; the lowest are pruned."""
    col_norm2 = (w2.double() ** 2).sum(0)
    if ranker == "energy":
        return stats.second_moment_diag
    if ranker == "magnitude":
        return col_norm2.sqrt()
    if ranker == "combined":
        return stats.second_moment_diag * col_norm2
    if ranker == "active":
        return stats.positive_rate
    if ranker == "variance":
        return torch.diagonal(stats.covariance).clone()
    raise ValueError(f"unknown ranker {ranker!r}")


def split_channels(scores: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(S, P)``, each ascending: ``S`` the ``kept`` highest scores."""
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:kept].sort().values, order[kept:].sort().values


@dataclass
class MlpSolution:
    """Compensation ``h_P ~ B h_S + c`` and its diagnostics.

    ``B``: ``(|P|, |S|)``, ``c``: ``(|P|,)``, float64. Errors are mean squared fc2-output
    errors per token on the calibration data (sum over output channels);
    ``output_energy`` is ``E||W2 h||^2`` for scale.
    """

    kept: torch.Tensor
    pruned: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    ridge_lambda: float
    error_uncompensated: float
    error_compensated: float
    output_energy: float


def solve_mlp(stats: MomentAccumulator, w2: torch.Tensor, kept: torch.Tensor, pruned: torch.Tensor,
              alpha: float, compensate: bool = True) -> MlpSolution:
    """Ridge regression of the pruned channels on the kept ones, from centred statistics.

    ``B = Sigma_PS (Sigma_SS + lambda I)^-1``, ``c = mu_P - B mu_S``, with
    ``lambda = alpha * tr(Sigma_SS) / |S|``. With ``compensate=False`` ``B`` and ``c``
    are zero (plain slicing) and the compensated error equals the uncompensated one.
    """
    cov, mu = stats.covariance, stats.mean
    w2 = w2.double()
    S, P = kept, pruned
    sig_ss = cov[S][:, S]
    sig_ps = cov[P][:, S]
    sig_pp = cov[P][:, P]
    lam = alpha * float(torch.trace(sig_ss)) / max(len(S), 1)
    if compensate and len(P):
        eye = torch.eye(len(S), dtype=cov.dtype, device=cov.device)
        B = _spd_solve(sig_ss + lam * eye, sig_ps.T).T
        c = mu[P] - B @ mu[S]
    else:
        B = torch.zeros(len(P), len(S), dtype=cov.dtype, device=cov.device)
        c = torch.zeros(len(P), dtype=cov.dtype, device=cov.device)
    w2p = w2[:, P]
    centred_pp = _weighted_trace(w2p, sig_pp)  # tr(W2_P Sigma_PP W2_P^T)
    err_unc = centred_pp + float((w2p @ mu[P]).square().sum())
    if compensate and len(P):
        # E||W2_P((h_P - mu_P) - B(h_S - mu_S))||^2 = tr(D R D^T), D = W2_P, with
        # R = Sigma_PP - Sigma_PS B^T - lambda B B^T (uses (Sigma_SS + lambda I) B^T = Sigma_SP).
        e = w2p @ B
        err_comp = centred_pp - float(((w2p @ sig_ps) * e).sum()) - lam * float(e.square().sum())
    else:
        err_comp = err_unc
    # E||W2 h||^2, only a scale for relative errors: float32 is precise enough.
    w32 = w2.float()
    energy = _weighted_trace(w32, cov.float()) + float((w32 @ mu.float()).square().sum())
    return MlpSolution(S, P, B, c, lam, err_unc, err_comp, energy)


def fold_mlp(mlp: nn.Module, kept: torch.Tensor, pruned: torch.Tensor, B: torch.Tensor | None = None,
             c: torch.Tensor | None = None) -> None:
    """Replace ``mlp.fc1``/``mlp.fc2`` by the reduced, compensated layers (in place).

    fc1 keeps rows ``S = kept``; ``W2' = W2[:, S] + W2[:, P] @ B``, ``b2' = b2 + W2[:, P] @ c``
    for ``P = pruned`` (``B`` ``(|P|, |S|)`` and ``c`` ``(|P|,)``; ``None`` means zero, so
    ``fold_mlp(mlp, S, P)`` only slices). fc2 gains a bias if it had none and the shift is
    non-zero.
    """
    fc1, fc2 = mlp.fc1, mlp.fc2
    S, P = kept, pruned
    w2 = fc2.weight.detach().double()
    new_w2 = w2[:, S] if B is None else w2[:, S] + w2[:, P] @ B.double()
    shift = w2[:, P] @ c.double() if c is not None else torch.zeros_like(w2[:, 0])
    needs_bias = fc2.bias is not None or bool(torch.any(shift != 0))
    new_fc1 = nn.Linear(fc1.in_features, len(S), bias=fc1.bias is not None,
                        device=fc1.weight.device, dtype=fc1.weight.dtype)
    new_fc2 = nn.Linear(len(S), fc2.out_features, bias=needs_bias,
                        device=fc2.weight.device, dtype=fc2.weight.dtype)
    with torch.no_grad():
        new_fc1.weight.copy_(fc1.weight[S])
        if fc1.bias is not None:
            new_fc1.bias.copy_(fc1.bias[S])
        new_fc2.weight.copy_(new_w2.to(fc2.weight.dtype))
        if needs_bias:
            b2 = fc2.bias.detach().double() if fc2.bias is not None else torch.zeros_like(shift)
            new_fc2.bias.copy_((b2 + shift).to(fc2.weight.dtype))
    mlp.fc1, mlp.fc2 = new_fc1, new_fc2


def _weighted_trace(w: torch.Tensor, m: torch.Tensor) -> float:
    """``tr(W M W^T)`` for ``W (o, k)``, ``M (k, k)``."""
    if w.shape[1] == 0:
        return 0.0
    return float(((w @ m) * w).sum())


def _spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``a x = b`` for symmetric positive (semi-)definite ``a``: Cholesky, else lstsq."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol)
    return torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd").solution.to(a.device)
