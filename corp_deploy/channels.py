"""Pruning the channels between a producer and a consumer layer with centred ridge
compensation (docs/method.md §2): MLP hidden channels (fc1 -> fc2) and, unchanged, value
channels (value rows -> proj columns, §4).

Conventions: the producer emits ``h`` with ``H`` channels; the consumer computes
``h @ W.T + b`` with ``W`` of shape ``(out, H)``. ``S`` are the kept channels, ``P`` the pruned
ones. The ridge is ``lambda = alpha * tr(Sigma) / H``: the mean variance of all ``H`` channels,
the same whichever channels are kept, so that the problems for nested kept sets are nested too
(:func:`prefix_objective`, §8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import keep_rows
from .stats import MomentAccumulator

#: Rankers that score channels one by one (``channel_scores``); ``greedy`` selects by
#: closed-form error reduction instead (:func:`greedy_order`).
SCORE_RANKERS = ("combined", "energy", "magnitude", "active", "variance")
RANKERS = (*SCORE_RANKERS, "greedy")
#: Steps of the greedy selection between two rank-b updates of its Schur complement.
GREEDY_PANEL = 64


def channel_scores(stats: MomentAccumulator, w2: torch.Tensor, ranker: str) -> torch.Tensor:
    """Importance of each channel, float64 ``(H,)``; the lowest are pruned."""
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
    return split_order(torch.argsort(scores, descending=True, stable=True), kept)


def split_order(order: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, P)``, each ascending, for the nested kept set ``S = order[:kept]``."""
    return order[:kept].sort().values, order[kept:].sort().values


def ridge_lambda(stats: MomentAccumulator, alpha: float) -> float:
    """``alpha * tr(Sigma) / H``, the scale-free ridge of a layer (independent of the kept set)."""
    cov = stats.covariance
    return alpha * float(torch.trace(cov)) / max(cov.shape[0], 1)


@dataclass
class ChannelSolution:
    """Compensation ``h_P ~ B h_S + c`` and its diagnostics.

    ``B``: ``(|P|, |S|)``, ``c``: ``(|P|,)``, float64. Errors are mean squared consumer-output
    errors per sample on the calibration data (sum over output channels);
    ``output_energy`` is ``E||W h||^2`` for scale.
    """

    kept: torch.Tensor
    pruned: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    ridge_lambda: float
    error_uncompensated: float
    error_compensated: float
    output_energy: float


def solve_channels(
    stats: MomentAccumulator,
    w2: torch.Tensor,
    kept: torch.Tensor,
    pruned: torch.Tensor,
    alpha: float,
    compensate: bool = True,
) -> ChannelSolution:
    """Ridge regression of the pruned channels on the kept ones, from centred statistics.

    ``B = Sigma_PS (Sigma_SS + lambda I)^-1``, ``c = mu_P - B mu_S``, with ``lambda`` from
    :func:`ridge_lambda`. With ``compensate=False`` ``B`` and ``c`` are zero (plain slicing)
    and the compensated error equals the uncompensated one.
    """
    cov, mu = stats.covariance, stats.mean
    w2 = w2.double()
    S, P = kept, pruned
    sig_ss = cov[S][:, S]
    sig_ps = cov[P][:, S]
    sig_pp = cov[P][:, P]
    lam = ridge_lambda(stats, alpha)
    if compensate and len(P):
        B = spd_solve(add_ridge_(sig_ss, lam), sig_ps.T).T  # sig_ss is a copy (indexed) and not used again
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
    return ChannelSolution(S, P, B, c, lam, err_unc, err_comp, output_energy(stats, w2))


def output_energy(stats: MomentAccumulator, w2: torch.Tensor) -> float:
    """``E||W2 h||^2``, only a scale for relative errors: float32 is precise enough."""
    w32 = w2.float()
    return _weighted_trace(w32, stats.covariance.float()) + float((w32 @ stats.mean.float()).square().sum())


def keep_order(
    stats: MomentAccumulator, weight: torch.Tensor, ranker: str, alpha: float, groups: int = 1, kept: int | None = None
) -> torch.Tensor:
    """The channels ``(H,)`` in the order they are kept (prefixes are the kept sets).

    ``ranker``: a score of :data:`SCORE_RANKERS` (highest first) or ``greedy``
    (:func:`greedy_order`). With ``groups = G`` the channels form ``G`` consecutive equal groups
    (the value dims of ``G`` heads) and every prefix of ``G * k`` keeps ``k`` of each group.
    ``kept``: only the first ``kept`` positions are needed (the greedy selection stops there;
    the rest follows in ascending order).
    """
    if ranker == "greedy":
        return greedy_order(stats, weight, alpha, groups, kept)
    scores = channel_scores(stats, weight, ranker)
    per_group = torch.argsort(scores.reshape(groups, -1), dim=1, descending=True, stable=True)
    width = per_group.shape[1]
    per_group = per_group + torch.arange(groups, device=scores.device)[:, None] * width
    return per_group.T.reshape(-1)  # rank 0 of every group, then rank 1, ...


def prefix_objective(stats: MomentAccumulator, weight: torch.Tensor, order: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ridge-compensated consumer error of every kept prefix ``S_k = order[:k]``, k = 0..H,
    ``(H + 1,)`` float64:

    ``J(k) = min_B E||W_P((h_P - mu_P) - B(h_S - mu_S))||^2 + lambda ||W_P B||^2``, the
    compensated error plus ``lambda ||W_P B||^2`` (exactly the error when ``alpha = 0``).
    With ``Mreg = Sigma + lambda I`` in ``order`` and its Cholesky factor ``L``,
    ``J(k) = ||W_P L_PP||^2 - lambda ||W_P||^2``, and ``W_P L_PP`` is the trailing columns of
    ``W L``: one factorisation gives every ``k`` (docs/method.md §8).
    """
    lam = ridge_lambda(stats, alpha)
    reg = add_ridge_(stats.covariance[order][:, order], lam)
    w = weight.double()[:, order]
    trailing = (w @ _cholesky(reg)).square().sum(0) - lam * w.square().sum(0)
    return torch.cat([trailing.flip(0).cumsum(0).flip(0), trailing.new_zeros(1)]).clamp_min(0.0)


def greedy_order(
    stats: MomentAccumulator, weight: torch.Tensor, alpha: float, groups: int = 1, kept: int | None = None
) -> torch.Tensor:
    """Channels in the order a greedy selection keeps them (docs/method.md §7): each step adds the channel whose
    inclusion lowers the ridge objective ``J`` (:func:`prefix_objective`) most. This is a
    pivoted Cholesky of ``Mreg = Sigma + lambda I`` with the consumer's output error as the
    pivot criterion, as OBS-style selection does: adding channel ``i`` to ``S`` lowers ``J`` by
    ``||W m_i||^2 / m_ii - lambda ||W_i||^2``, ``m_i`` column ``i`` of the Schur complement
    ``Mreg_{.|S}``. ``groups`` and ``kept`` as in :func:`keep_order`.

    Blocked: the Schur complement ``R`` and ``G = W R`` are updated every :data:`GREEDY_PANEL`
    steps by one rank-``b`` product (BLAS-3); inside a panel, the new columns are taken from
    ``R`` minus the panel's own columns ``C_p`` and ``(W R)^T u = G^T u - C_p^T (U_p u)`` with
    ``U_p = W C_p^T``. Per step that is two ``out x H`` products; per panel ``H^2 b``.
    """
    cov = stats.covariance
    H = cov.shape[0]
    steps = H if kept is None else kept
    # a vanishing floor keeps the pivots positive when alpha = 0 and a channel is fully explained
    lam = max(ridge_lambda(stats, alpha), 1e-12 * float(torch.trace(cov)) / H)
    schur = add_ridge_(cov.clone(), lam)  # Mreg_{.|S} at the panel start
    w = weight.double()
    w_norm2 = w.square().sum(0)
    resid_diag = torch.diagonal(schur).clone()
    g = w @ schur  # W Mreg_{.|S} at the panel start, (out, H)
    g_norm2 = g.square().sum(0)  # column norms of W Mreg_{.|S}, kept current every step
    panel = min(GREEDY_PANEL, steps)
    columns = torch.zeros(panel, H, dtype=cov.dtype, device=cov.device)  # this panel's factor columns
    images = torch.zeros(panel, w.shape[0], dtype=cov.dtype, device=cov.device)  # W times each
    group = torch.arange(H, device=cov.device) // (H // groups)
    free = torch.ones(H, dtype=torch.bool, device=cov.device)
    open_groups = torch.ones(groups, dtype=torch.bool, device=cov.device)
    order = []
    for t in range(steps):
        p = t % panel
        gain = g_norm2 / resid_diag - lam * w_norm2
        gain[~(free & open_groups[group])] = -torch.inf
        i = int(torch.argmax(gain))
        col = schur[:, i] - columns[:p].T @ columns[:p, i]
        col /= col[i].sqrt()
        u = w @ col
        g_u = g.T @ u - columns[:p].T @ (images[:p] @ u)  # (W Mreg_{.|S})^T u before this step
        g_norm2 += col * (col * u.dot(u) - 2.0 * g_u)
        columns[p], images[p] = col, u
        resid_diag -= col.square()
        if p == panel - 1 or t == steps - 1:
            schur.addmm_(columns[: p + 1].T, columns[: p + 1], alpha=-1.0)
            g.addmm_(images[: p + 1].T, columns[: p + 1], alpha=-1.0)
        free[i] = False
        open_groups[group[i]] = False
        if not open_groups.any():
            open_groups[:] = True
        order.append(i)
    rest = torch.nonzero(free).flatten()
    return torch.cat([torch.tensor(order, dtype=torch.long, device=cov.device), rest])


def fold_mlp(
    mlp: nn.Module,
    kept: torch.Tensor,
    pruned: torch.Tensor,
    B: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
) -> None:
    """Replace ``mlp.fc1``/``mlp.fc2`` by the reduced, compensated layers (in place).

    fc1 (an ``nn.Linear`` or a :class:`~corp_deploy.layers.GatedLinear`) keeps rows ``S = kept``;
    ``W2' = W2[:, S] + W2[:, P] @ B``, ``b2' = b2 + W2[:, P] @ c`` for ``P = pruned``
    (``B`` ``(|P|, |S|)`` and ``c`` ``(|P|,)``; ``None`` means zero, so ``fold_mlp(mlp, S, P)``
    only slices). fc2 gains a bias if it had none and the shift is non-zero.
    """
    mlp.fc1, mlp.fc2 = keep_rows(mlp.fc1, kept), compensated_consumer(mlp.fc2, kept, pruned, B, c)


def compensated_consumer(
    layer: nn.Linear,
    kept: torch.Tensor,
    pruned: torch.Tensor,
    B: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
) -> nn.Linear:
    """The consumer ``layer`` reading only channels ``kept``, with the compensation folded in:
    ``W' = W[:, S] + W[:, P] @ B``, ``b' = b + W[:, P] @ c`` (``None``: zero). It gains a bias if
    it had none and the shift is non-zero."""
    w = layer.weight.detach().double()
    new_w = w[:, kept] if B is None else w[:, kept] + w[:, pruned] @ B.double()
    shift = w[:, pruned] @ c.double() if c is not None else torch.zeros_like(w[:, 0])
    needs_bias = layer.bias is not None or bool(torch.any(shift != 0))
    new = nn.Linear(
        len(kept), layer.out_features, bias=needs_bias, device=layer.weight.device, dtype=layer.weight.dtype
    )
    with torch.no_grad():
        new.weight.copy_(new_w.to(layer.weight.dtype))
        if needs_bias:
            b = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(shift)
            new.bias.copy_((b + shift).to(layer.weight.dtype))
    return new


def add_ridge_(matrix: torch.Tensor, lam: float) -> torch.Tensor:
    """``matrix + lam I`` in place (no ``d x d`` identity formed); returns ``matrix``."""
    matrix.diagonal().add_(lam)
    return matrix


def _weighted_trace(w: torch.Tensor, m: torch.Tensor) -> float:
    """``tr(W M W^T)`` for ``W (o, k)``, ``M (k, k)``."""
    if w.shape[1] == 0:
        return 0.0
    return float(((w @ m) * w).sum())


def _cholesky(a: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric positive semi-definite matrix; a vanishing jitter is
    added only if the plain factorisation fails (a zero-variance channel without ridge). ValueError for a
    matrix that is not finite, which no jitter makes factorisable (the statistics are checked before
    they reach here: :func:`~corp_deploy.stats.check_finite_sums`)."""
    if not bool(torch.isfinite(a).all()):
        raise ValueError("the matrix to factorise holds NaN or infinite values")
    chol, info = torch.linalg.cholesky_ex(a)
    jitter = 1e-12 * max(float(torch.diagonal(a).abs().max()), 1e-300)
    while int(info) != 0:
        chol, info = torch.linalg.cholesky_ex(add_ridge_(a.clone(), jitter))
        jitter *= 10
    return chol


def spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``a x = b`` for symmetric positive (semi-)definite ``a``: Cholesky, else lstsq."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol)
    return torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd").solution.to(a.device)
