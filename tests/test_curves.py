"""Error curves (docs/method.md §8) against direct re-solves and actual errors, and the greedy
selection against brute force."""

import pytest
import torch

from corp_deploy import CompressConfig, channels, compress
from corp_deploy.blocks import BoundaryCache
from corp_deploy.engine import embed_tokens
from corp_deploy.methods.corp import qk_pruning
from corp_deploy.methods.corp.curves import PROBE_IMAGES, measure_curves, qk_probe_sizes
from corp_deploy.methods.corp.qk_statistics import ImageGrams, KroneckerSums, pack, per_image_head_grams
from corp_deploy.stats import MomentAccumulator


def correlated_stats(n=3000, hidden=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 8, generator=g, dtype=torch.float64)
    h = (
        latent @ torch.randn(8, hidden, generator=g, dtype=torch.float64)
        + 0.3 * torch.randn(n, hidden, generator=g, dtype=torch.float64)
        + 1.0
    )
    stats = MomentAccumulator(hidden)
    stats.update(h.float())
    return stats, torch.randn(10, hidden, generator=g, dtype=torch.float64)


def direct_objective(stats, w, order, k, alpha):
    """J(k) by re-solving the kept prefix: compensated error + lambda ||W_P B||^2."""
    if k == len(order):
        return 0.0
    S, P = channels.split_order(order, k)
    sol = channels.solve_channels(stats, w, S, P, alpha)
    return sol.error_compensated + sol.ridge_lambda * float((w[:, P] @ sol.B).square().sum())


@pytest.mark.parametrize("ranker", ["combined", "greedy"])
@pytest.mark.parametrize("alpha", [0.0, 1e-2])
def test_channel_curve_matches_direct_re_solves(ranker, alpha):
    stats, w = correlated_stats()
    order = channels.keep_order(stats, w, ranker, alpha)
    curve = channels.prefix_objective(stats, w, order, alpha)
    assert curve.shape == (25,) and curve[-1] == 0
    for k in (0, 1, 5, 12, 23, 24):
        assert float(curve[k]) == pytest.approx(direct_objective(stats, w, order, k, alpha), rel=1e-7, abs=1e-9)
    assert torch.all(curve[:-1] >= curve[1:] - 1e-9)  # more kept channels never hurt


def test_greedy_takes_the_best_channel_at_every_step():
    stats, w = correlated_stats(hidden=12, seed=3)
    alpha = 1e-3
    order = channels.greedy_order(stats, w, alpha)
    for step in range(4):

        def objective_with(i, step=step):
            if i in order[:step]:
                return float("inf")
            kept = order[:step].tolist() + [i]
            return direct_objective(
                stats, w, torch.tensor(kept + [j for j in range(12) if j not in kept]), step + 1, alpha
            )

        objectives = sorted(objective_with(i) for i in range(12))
        assert objectives[0] < objectives[1]  # a unique best channel
        assert objective_with(int(order[step])) == objectives[0]


def test_grouped_selection_keeps_equal_counts_and_stops_early():
    stats, w = correlated_stats(hidden=24)
    for ranker in ("combined", "greedy"):
        order = channels.keep_order(stats, w, ranker, 1e-3, groups=3)
        for k in range(1, 9):
            assert torch.bincount(order[: 3 * k] // 8, minlength=3).tolist() == [k] * 3
        partial = channels.keep_order(stats, w, ranker, 1e-3, groups=3, kept=6)
        assert torch.equal(partial[:6], order[:6]) and sorted(partial.tolist()) == list(range(24))


@pytest.mark.parametrize("form", ["images", "summed"])
@pytest.mark.parametrize("alpha", [0.0, 1e-2])
def test_head_curve_and_its_solutions_match_direct_re_solves(alpha, form):
    """On the per-image Grams and on their Kronecker sums (corp_deploy/methods/corp/qk_statistics.py): the re-solves
    always use the per-image Grams."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20, 1, 15, 8, generator=g)
    k = torch.randn(20, 1, 15, 8, generator=g) + 0.3 * q
    a, gk = per_image_head_grams(q)[:, 0], per_image_head_grams(k)[:, 0]
    by_image = ImageGrams(a, gk)
    sums = by_image if form == "images" else KroneckerSums(pack(a).T @ pack(gk), 20, 8)
    order = torch.argsort(qk_pruning.qk_dim_scores([sums])[0], descending=True, stable=True)
    curve, solutions = qk_pruning.head_curve(sums, order, alpha, solutions_at=(1, 3, 5, 8))
    assert curve[0] == pytest.approx(float((a.double() * gk.double()).sum()) / 20) and curve[8] == 0
    for kept in range(1, 9):
        S, P = order[:kept].sort().values, order[kept:].sort().values
        sol = qk_pruning.solve_head(by_image, S, P, alpha)
        assert float(curve[kept]) == pytest.approx(
            sol.error_compensated + sol.ridge_lambda * float(sol.M.square().sum()) / 20, rel=1e-9
        )
        if kept in solutions:
            shared = solutions[kept]
            torch.testing.assert_close(shared.M, sol.M, rtol=1e-8, atol=1e-10)
            assert shared.ridge_lambda == pytest.approx(sol.ridge_lambda, rel=1e-12, abs=0)
            for name in ("error_uncompensated", "error_compensated", "logit_energy"):
                assert getattr(shared, name) == pytest.approx(getattr(sol, name), rel=1e-9, abs=1e-12), name


def test_qk_probe_sizes():
    assert qk_probe_sizes(64) == (8, 16, 24, 32, 40, 48, 56)
    assert qk_probe_sizes(16) == (2, 4, 6, 8, 10, 12, 14)
    assert qk_probe_sizes(4) == (1, 2, 3)  # rounding duplicates collapse; never 0 or the full dim


def test_measured_curves_equal_the_errors_of_compressing_at_that_size(batches, small_vit):
    """At a uniform size, each unit's curve gives the error of CORP's compression at that size:
    the reported MLP and value errors (no ridge, so the objective is the error itself), and the
    query/key unit's attention-output error measured on the probe images (8 is a probe size)."""
    vit = small_vit()
    config = CompressConfig.from_settings(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5, ridge=0.0)
    _, report = compress(vit, batches, config)
    cache = BoundaryCache()
    cache.batches = [embed_tokens(vit, b) for b in batches]
    with torch.no_grad():
        inputs = torch.cat(cache.batches)[:PROBE_IMAGES]
        curves = measure_curves(vit, cache, config)
    assert [(c.block, c.part) for c in curves] == [(b, p) for b in range(2) for p in ("mlp", "qk", "vo")]
    for curve in curves:
        layer = report["layers"][curve.block]
        assert curve.error[0] >= curve.error[curve.total // 2] >= curve.error[curve.total] == 0
        if curve.part == "mlp":
            assert float(curve.error[96]) == pytest.approx(layer["mlp"]["error_compensated"], rel=1e-6)
        if curve.part == "vo":
            assert float(curve.error[8]) == pytest.approx(layer["values"]["error_compensated"], rel=1e-6)
        assert (
            curve.macs_per_dim
            == {"mlp": 2 * 17 * 48, "qk": 3 * (2 * 17 * 48 + 17**2), "vo": 3 * (2 * 17 * 48 + 17**2)}[curve.part]
        )
    qk_model, _ = compress(
        vit, batches, CompressConfig.from_settings(target="attn", s_attn=0.5, ridge=0.0, refit="none")
    )
    with torch.no_grad():
        for index, (dense_block, qk_block) in enumerate(zip(vit.blocks, qk_model.blocks)):
            x = dense_block.norm1(inputs)
            actual = (dense_block.ls1(qk_block.attn(x)) - dense_block.ls1(dense_block.attn(x))).double().square()
            assert float(curves[3 * index + 1].error[8]) == pytest.approx(float(actual.sum(-1).mean()), rel=1e-4)
            inputs = dense_block(inputs)


def test_equal_head_dims_ties_query_key_and_value_units(batches, small_vit):
    vit = small_vit()
    cache = BoundaryCache()
    cache.batches = [embed_tokens(vit, b) for b in batches]
    with torch.no_grad():
        curves = measure_curves(vit, cache, CompressConfig.from_settings(macs=0.5, equal_head_dims=True))
    assert [c.part for c in curves] == ["mlp", "qkvo"] * 2
    assert curves[1].macs_per_dim == 2 * 3 * (2 * 17 * 48 + 17**2)


def test_normed_distortion_weighs_errors_and_energy_as_the_next_norm_reads_them(batches, small_vit):
    """``normed``: each unit's error and the stream's energy where the next norm reads it, weighted
    by that norm's gain: the MLP's by the next block's ``norm1`` (the final ``norm`` after the last
    block) after the MLP, the attention's by the block's ``norm2`` after the attention. Checked
    against the actual errors of the compressed blocks (no ridge: the objective is the error)."""
    vit = small_vit()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for norm in [b.norm1 for b in vit.blocks] + [b.norm2 for b in vit.blocks] + [vit.norm]:
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) * 2)
    config = CompressConfig.from_settings(
        target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5, ridge=0.0, distortion="normed", refit="none"
    )
    mlp_model, _ = compress(vit, batches, config)
    qk_model, _ = compress(
        vit, batches, CompressConfig.from_settings(target="attn", s_attn=0.5, ridge=0.0, refit="none")
    )
    cache = BoundaryCache()
    cache.batches = [embed_tokens(vit, b) for b in batches]
    inputs = torch.cat(cache.batches)
    with torch.no_grad():
        curves = measure_curves(vit, cache, config)
        gain_after_mlp = [vit.blocks[1].norm1.weight, vit.norm.weight]
        for index, dense in enumerate(vit.blocks):
            mid = inputs + dense.ls1(dense.attn(dense.norm1(inputs)))
            out = mid + dense.ls2(dense.mlp(dense.norm2(mid)))
            h = dense.norm2(mid)
            checks = [
                (
                    curves[3 * index],
                    96,
                    gain_after_mlp[index],
                    out,
                    dense.ls2(mlp_model.blocks[index].mlp(h)) - dense.ls2(dense.mlp(h)),
                )
            ]
            x = dense.norm1(inputs[:PROBE_IMAGES])
            checks.append(
                (
                    curves[3 * index + 1],
                    8,
                    dense.norm2.weight,
                    mid,
                    dense.ls1(qk_model.blocks[index].attn(x)) - dense.ls1(dense.attn(x)),
                )
            )
            for curve, size, gain, stream, error in checks:
                expected = float((error * gain).double().square().sum(-1).mean())
                energy = float(((stream - stream.mean(-1, keepdim=True)) * gain).double().square().sum(-1).mean())
                assert float(curve.error[size]) == pytest.approx(expected, rel=1e-4)
                assert float(curve.distortion[size]) == pytest.approx(expected / energy, rel=1e-4)
            inputs = out
