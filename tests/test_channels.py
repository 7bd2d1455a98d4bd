"""MLP compensation against independent computations on raw activations (docs/method.md §2)."""

import pytest
import torch
from timm.layers import Mlp

from corp_deploy import channels as mlp_ops
from corp_deploy.stats import MomentAccumulator
from tests.helpers import FLOAT32


def correlated_activations(n=2000, hidden=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 8, generator=g, dtype=torch.float64)
    mix = torch.randn(8, hidden, generator=g, dtype=torch.float64)
    h = latent @ mix + 0.3 * torch.randn(n, hidden, generator=g, dtype=torch.float64) + 1.5
    return h


def stats_of(h, batches=4):
    acc = MomentAccumulator(h.shape[1])
    for chunk in torch.chunk(h, batches):
        acc.update(chunk.float())
    return acc


def split(hidden=24, kept=14, seed=0):
    perm = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))
    return perm[:kept].sort().values, perm[kept:].sort().values


def test_compensation_equals_least_squares_on_raw_activations():
    h = correlated_activations().float().double()  # what the accumulator sees
    S, P = split()
    sol = mlp_ops.solve_channels(stats_of(h), torch.randn(10, 24), S, P, alpha=0.0)
    design = torch.cat([h[:, S], torch.ones(len(h), 1, dtype=h.dtype)], 1)
    coef = torch.linalg.lstsq(design, h[:, P]).solution  # (|S|+1, |P|)
    # statistics are accumulated in float32 (docs/method.md §1): coefficients agree to ~1e-5,
    # the predictions of the pruned channels to ~1e-6 of their scale
    torch.testing.assert_close(sol.B, coef[:-1].T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sol.c, coef[-1], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(h[:, S] @ sol.B.T + sol.c, design @ coef, rtol=0, atol=1e-5 * float(h.std()))


def test_ridge_equals_augmented_least_squares():
    h = correlated_activations().float().double()
    S, P = split()
    alpha = 0.05
    sol = mlp_ops.solve_channels(stats_of(h), torch.randn(10, 24), S, P, alpha=alpha)
    hc = h - h.mean(0)
    n = len(h)
    lam = alpha * float(torch.trace(hc.T @ hc / n)) / h.shape[1]  # mean variance of all channels
    assert sol.ridge_lambda == pytest.approx(lam, rel=1e-6)
    design = torch.cat([hc[:, S], (n * lam) ** 0.5 * torch.eye(len(S), dtype=h.dtype)])
    target = torch.cat([hc[:, P], torch.zeros(len(S), len(P), dtype=h.dtype)])
    B = torch.linalg.lstsq(design, target).solution.T
    torch.testing.assert_close(sol.B, B, rtol=1e-4, atol=1e-6)


def test_layer_errors_match_closed_form_and_actual_outputs():
    h = correlated_activations().float().double()
    S, P = split()
    w2 = torch.randn(10, 24, dtype=torch.float64)
    sol = mlp_ops.solve_channels(stats_of(h), w2, S, P, alpha=0.0)
    # actual errors of the fc2 output on the calibration samples
    sliced = h[:, P] @ w2[:, P].T
    compensated = (h[:, P] - h[:, S] @ sol.B.T - sol.c) @ w2[:, P].T
    assert sol.error_uncompensated == pytest.approx(float((sliced**2).sum(1).mean()), rel=1e-5)
    assert sol.error_compensated == pytest.approx(float((compensated**2).sum(1).mean()), rel=1e-4)
    # docs/method.md §2 closed form tr(W2_P Sigma_{PP|S} W2_P^T)
    cov = torch.cov(h.T, correction=0)
    cond = cov[P][:, P] - cov[P][:, S] @ torch.linalg.solve(cov[S][:, S], cov[S][:, P])
    assert sol.error_compensated == pytest.approx(float(torch.trace(w2[:, P] @ cond @ w2[:, P].T)), rel=1e-4)
    assert sol.error_compensated < sol.error_uncompensated


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("alpha", [0.0, 1e-3, 1.0])
def test_compensated_error_never_above_uncompensated(seed, alpha):
    h = correlated_activations(n=500, seed=seed)
    S, P = split(seed=seed)
    sol = mlp_ops.solve_channels(stats_of(h), torch.randn(6, 24), S, P, alpha=alpha)
    assert sol.error_compensated <= sol.error_uncompensated + 1e-9


def test_exact_recovery_when_pruned_channels_are_affine_in_kept_ones():
    torch.manual_seed(0)
    mlp = Mlp(16, hidden_features=12, act_layer=torch.nn.Identity).eval()  # h = fc1(x): linear
    S, P = torch.arange(8), torch.arange(8, 12)
    with torch.no_grad():  # make fc1 rows P an affine function of rows S
        A = torch.randn(4, 8)
        mlp.fc1.weight[P] = A @ mlp.fc1.weight[S]
        mlp.fc1.bias[P] = A @ mlp.fc1.bias[S] + torch.randn(4)
    x = torch.randn(400, 16)
    with torch.no_grad():
        dense = mlp(x)
        h = mlp.act(mlp.fc1(x))
        sol = mlp_ops.solve_channels(stats_of(h.double()), mlp.fc2.weight, S, P, alpha=0.0)
        mlp_ops.fold_mlp(mlp, sol.kept, sol.pruned, sol.B, sol.c)
        out = mlp(x)
    assert mlp.fc1.out_features == 8 and mlp.fc2.in_features == 8
    assert sol.error_compensated < 1e-8 * sol.error_uncompensated
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)


def test_fold_applies_the_solution_to_the_module():
    torch.manual_seed(1)
    mlp = Mlp(16, hidden_features=24).eval()
    x = torch.randn(600, 16)
    with torch.no_grad():
        h = mlp.act(mlp.fc1(x))
        dense = mlp(x)
        w2 = mlp.fc2.weight.double()
        S, P = split()
        sol = mlp_ops.solve_channels(stats_of(h), mlp.fc2.weight, S, P, alpha=1e-3)
        expected = (
            h.double()[:, S] @ w2[:, S].T + (h.double()[:, S] @ sol.B.T + sol.c) @ w2[:, P].T + mlp.fc2.bias.double()
        )
        mlp_ops.fold_mlp(mlp, sol.kept, sol.pruned, sol.B, sol.c)
        out = mlp(x)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    assert float(((out - dense) ** 2).sum(1).mean()) == pytest.approx(sol.error_compensated, rel=1e-3)


def test_no_compensation_is_plain_slicing():
    torch.manual_seed(2)
    mlp = Mlp(16, hidden_features=24).eval()
    x = torch.randn(100, 16)
    S, P = split()
    with torch.no_grad():
        h = mlp.act(mlp.fc1(x))
        sliced = h[:, S] @ mlp.fc2.weight[:, S].T + mlp.fc2.bias
        sol = mlp_ops.solve_channels(stats_of(h), mlp.fc2.weight, S, P, alpha=1e-3, compensate=False)
        mlp_ops.fold_mlp(mlp, sol.kept, sol.pruned, sol.B, sol.c)
        out = mlp(x)
    torch.testing.assert_close(out, sliced)
    assert sol.error_compensated == sol.error_uncompensated


def test_rankers():
    h = torch.tensor([[0.0, 2.0, -1.0], [0.0, 2.0, 3.0], [1.0, -2.0, 3.0], [1.0, 2.0, 3.0]])
    stats = stats_of(h, batches=2)
    w2 = torch.tensor([[1.0, 0.1, 0.5], [0.0, 0.1, 0.5]])
    energy = (h.double() ** 2).mean(0)
    col = (w2.double() ** 2).sum(0)
    # moments are accumulated from float32 samples: compared at float32's resolution
    torch.testing.assert_close(mlp_ops.channel_scores(stats, w2, "energy"), energy, **FLOAT32)
    torch.testing.assert_close(mlp_ops.channel_scores(stats, w2, "magnitude"), col.sqrt())
    torch.testing.assert_close(mlp_ops.channel_scores(stats, w2, "combined"), energy * col, **FLOAT32)
    torch.testing.assert_close(
        mlp_ops.channel_scores(stats, w2, "active"), torch.tensor([0.5, 0.75, 0.75], dtype=torch.float64)
    )
    torch.testing.assert_close(
        mlp_ops.channel_scores(stats, w2, "variance"), h.double().var(0, correction=0), **FLOAT32
    )
    S, P = mlp_ops.split_channels(torch.tensor([3.0, 1.0, 2.0, 0.5]), 2)
    assert S.tolist() == [0, 2] and P.tolist() == [1, 3]
