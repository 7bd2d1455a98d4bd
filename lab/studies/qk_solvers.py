"""Cheaper ways to the query/key curves of budget mode, tried on the real DINOv2 ViT-S/14's Grams
(blocks 0, 5 and 11; 128 calibration crops), against the float64 direct solves the library uses:

* the exact curve (:func:`corp_deploy.methods.corp.qk_pruning.head_curve`) with the Kronecker system built and
  factorised in float32: largest curve error relative to the unit's full error ``J(0)``;
* conjugate gradients on ``sum_i A_i M G_i + lambda M = C`` at kept sizes 8, 24, 40, 56,
  preconditioned with ``(N A_bar ⊗ G_bar + lambda I)^-1`` (mean Grams, two eigendecompositions):
  iterations to a 1e-10 relative residual and the distance to :func:`~corp_deploy.methods.corp.qk_pruning.solve_head`.

    python -m lab.studies.qk_solvers > lab/results/qk_solvers.txt

One thread; times are indicative only (the machine is shared).
"""

from __future__ import annotations

import argparse
import time

import torch

from corp_deploy.blocks import probe_query_keys
from corp_deploy.engine import embed_tokens
from corp_deploy.families import blocks_of
from corp_deploy.methods.corp import qk_pruning
from corp_deploy.methods.corp.qk_statistics import HeadGrams, ImageGrams
from lab.held_out import dinov2_study_setup

ALPHA = 1e-3


def float32_curve(a_full: torch.Tensor, g_full: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``head_curve``'s values with the system built and factorised in float32 (sums in float64)."""
    d = a_full.shape[-1]
    a = a_full[:, order][:, :, order].float()
    g = g_full[:, order][:, :, order].float()
    lam = qk_pruning.head_ridge_lambda(ImageGrams(a_full, g_full), ALPHA)
    pairs = [p for m in range(d) for p in [(m, b) for b in range(m + 1)] + [(a_, m) for a_ in range(m)]]
    perm = torch.tensor([p * d + q for p, q in pairs])
    zr = torch.einsum("npr,nqs->pqrs", a, g).reshape(d * d, d * d)[perm][:, perm]  # sum_i A_i ⊗ G_i
    zr.diagonal().add_(lam)
    chol = torch.linalg.cholesky(zr)
    diag_pos = torch.tensor([m * m + m for m in range(d)])
    y = torch.linalg.solve_triangular(chol, (a @ g).sum(0).reshape(-1)[perm][:, None], upper=False)[:, 0]
    unit = torch.zeros(d * d, d)
    unit[diag_pos, torch.arange(d)] = 1.0
    inv_e = torch.linalg.solve_triangular(chol, unit, upper=False).cumsum(1)
    lt_e = chol[diag_pos].cumsum(0)
    products = (a.double() * g.double()).sum(0)
    sliced = products.flip(0).cumsum(0).flip(0).flip(1).cumsum(1).flip(1).diagonal()
    curve = torch.zeros(d + 1, dtype=torch.float64)
    curve[0] = products.sum()
    for k in range(1, d):
        v = (y[: k * k] - lt_e[k - 1, : k * k] + lam * inv_e[: k * k, k - 1]).double()
        curve[k] = sliced[k] - v.square().sum()
    return curve.clamp_min(0.0) / a_full.shape[0]


def preconditioned_cg(
    a: torch.Tensor, g: torch.Tensor, rhs: torch.Tensor, lam: float, tol: float = 1e-10, max_iter: int = 1000
) -> tuple[torch.Tensor, int]:
    """``M`` with ``sum_i a_i M g_i + lam M = rhs`` (``a``, ``g``: ``(N, k, k)``) and the iterations taken."""
    da, ua = torch.linalg.eigh(a.mean(0))
    dg, ug = torch.linalg.eigh(g.mean(0))
    denominator = a.shape[0] * da[:, None] * dg[None, :] + lam

    def precondition(r: torch.Tensor) -> torch.Tensor:
        return ua @ ((ua.T @ r @ ug) / denominator) @ ug.T

    def apply(m: torch.Tensor) -> torch.Tensor:
        return (a @ m @ g).sum(0) + lam * m

    x = precondition(rhs)
    r = rhs - apply(x)
    z = precondition(r)
    p, rz = z.clone(), (r * z).sum()
    for iteration in range(max_iter):
        if r.norm() <= tol * rhs.norm():
            return x, iteration
        q = apply(p)
        step = rz / (p * q).sum()
        x += step * p
        r -= step * q
        z = precondition(r)
        rz, previous = (r * z).sum(), rz
        p = z + (rz / previous) * p
    return x, max_iter


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help only
    torch.manual_seed(0)
    dense, _, calib, _ = dinov2_study_setup(128, 8)
    grams = {}
    with torch.no_grad():
        hidden = [embed_tokens(dense, batch) for batch in calib]
        for index, block in enumerate(blocks_of(dense)):
            if index in (0, 5, 11):
                heads = HeadGrams(summed_after=10**9)  # kept per image
                for x in hidden:
                    probe_query_keys(block, x, heads.add)
                grams[index] = (
                    torch.cat(heads.query).double().transpose(0, 1).contiguous(),
                    torch.cat(heads.key).double().transpose(0, 1).contiguous(),
                )
            hidden = [block(x) for x in hidden]
    torch.set_num_threads(1)
    print(
        "block head | float32 curve: max |error| / J(0) | CG per k=8,24,40,56: iterations, "
        "relative distance to the direct solve, direct s / CG s"
    )
    for index, (a_full, g_full) in grams.items():
        sums = [ImageGrams(a, g) for a, g in zip(a_full, g_full)]
        orders = torch.argsort(qk_pruning.qk_dim_scores(sums), dim=1, descending=True, stable=True)
        for h in range(a_full.shape[0]):
            exact, _ = qk_pruning.head_curve(sums[h], orders[h], ALPHA)
            error32 = float((float32_curve(a_full[h], g_full[h], orders[h]) - exact).abs().max() / exact[0])
            lam = qk_pruning.head_ridge_lambda(sums[h], ALPHA)
            cells = []
            for k in (8, 24, 40, 56):
                kept, pruned = orders[h, :k].sort().values, orders[h, k:].sort().values
                start = time.perf_counter()
                direct = qk_pruning.solve_head(sums[h], kept, pruned, ALPHA)
                direct_s = time.perf_counter() - start
                order = torch.cat([kept, pruned])
                a = a_full[h][:, order][:, :, order]
                g = g_full[h][:, order][:, :, order]
                start = time.perf_counter()
                m, iterations = preconditioned_cg(
                    a[:, :k, :k].contiguous(), g[:, :k, :k].contiguous(), (a[:, :k, k:] @ g[:, k:, :k]).sum(0), lam
                )
                cg_s = time.perf_counter() - start
                distance = float((m - direct.M).norm() / direct.M.norm())
                cells.append(f"{iterations} {distance:.1e} {direct_s:.2f}/{cg_s:.2f}")
            print(f"{index} {h} | {error32:.1e} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
