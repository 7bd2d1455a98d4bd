"""Spending a MAC budget (docs/method.md §8): the allocation against brute force, its budget and
floor guarantees, and budget mode end to end on a small ViT."""

import itertools
import math

import pytest
import torch

import corp_deploy.methods.corp as corp_method
from corp_deploy import CompressConfig, compress, count_macs
from corp_deploy.errors import CorpError
from corp_deploy.methods.corp.allocation import Unit, allocate, candidate_sizes


def convex_unit(total, macs_per_dim, scale, power=2.0):
    """A unit whose distortion falls convexly to 0 at full size."""
    k = torch.arange(total + 1, dtype=torch.float64)
    return Unit(total, macs_per_dim, scale * (1 - k / total) ** power)


def brute_force(units, fixed, budget, round_to=1, floor=0.0):
    """The least total distortion over every combination of candidate sizes within the budget."""
    best = None
    for sizes in itertools.product(*[candidate_sizes(u.total, round_to, floor) for u in units]):
        macs = fixed + sum(k * u.macs_per_dim for k, u in zip(sizes, units))
        cost = sum(float(u.distortion[k]) for k, u in zip(sizes, units))
        if macs <= budget and (best is None or cost < best[0] - 1e-12):
            best = (cost, sizes)
    return best


def test_candidate_sizes():
    assert candidate_sizes(10, 1, 0.0) == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert candidate_sizes(10, 4, 0.0) == [10, 8, 4]
    assert candidate_sizes(10, 1, 0.25) == [10, 9, 8, 7, 6, 5, 4, 3]  # ceil(2.5)
    assert candidate_sizes(64, 8, 0.1) == [64, 56, 48, 40, 32, 24, 16, 8]
    assert candidate_sizes(6, 8, 0.5) == [6]  # no multiple of 8 below: the unit stays whole


@pytest.mark.parametrize("budget_fraction", [0.9, 0.7, 0.55, 0.5])
def test_convex_curves_are_allocated_optimally_within_the_budget(budget_fraction):
    units = [convex_unit(8, 3, 1.0), convex_unit(6, 5, 4.0, power=3.0), convex_unit(10, 2, 0.5, power=1.5)]
    fixed = 40
    dense = fixed + sum(u.total * u.macs_per_dim for u in units)
    budget = math.floor(budget_fraction * dense)
    kept = allocate(units, fixed, budget)
    macs = fixed + sum(k * u.macs_per_dim for k, u in zip(kept, units))
    cost = sum(float(u.distortion[k]) for k, u in zip(kept, units))
    assert macs <= budget
    best_cost, _ = brute_force(units, fixed, budget)
    # greedy on convex curves is optimal up to the last step, which may undershoot the budget by
    # less than one unit's step: never worse than the optimum at a budget one step smaller
    assert cost <= brute_force(units, fixed, budget - max(u.macs_per_dim for u in units))[0] + 1e-12
    assert cost >= best_cost - 1e-12


def test_budget_is_never_exceeded_and_rounding_and_floors_hold():
    g = torch.Generator().manual_seed(0)
    units = [
        Unit(t, m, torch.rand(t + 1, generator=g, dtype=torch.float64).sort(descending=True).values)
        for t, m in ((64, 7), (48, 11), (96, 3), (32, 13))
    ]
    for unit in units:
        unit.distortion[-1] = 0.0
    fixed = 500
    dense = fixed + sum(u.total * u.macs_per_dim for u in units)
    for fraction in torch.linspace(0.45, 1.0, 23).tolist():
        budget = math.floor(fraction * dense)
        kept = allocate(units, fixed, budget, round_to=8, floor=0.25)
        assert fixed + sum(k * u.macs_per_dim for k, u in zip(kept, units)) <= budget
        for k, u in zip(kept, units):
            assert k in candidate_sizes(u.total, 8, 0.25)
    assert allocate(units, fixed, dense) == [u.total for u in units]  # F = 1 keeps everything


def test_equal_curves_give_the_uniform_split():
    units = [convex_unit(16, 5, 1.0) for _ in range(4)]
    fixed = 100
    for kept_each in (4, 8, 12):
        budget = fixed + 4 * kept_each * 5
        assert allocate(units, fixed, budget) == [kept_each] * 4
    assert allocate(units, fixed, fixed + 4 * 9 * 5 + 7) == [9, 9, 9, 10]  # ties: earlier units give first


def test_a_budget_below_the_floors_is_refused():
    units = [convex_unit(10, 10, 1.0), convex_unit(10, 10, 1.0)]
    with pytest.raises(CorpError, match="below what the floors allow"):
        allocate(units, 50, 50 + 2 * 10 * 2 - 1, floor=0.2)
    assert allocate(units, 50, 50 + 2 * 10 * 2, floor=0.2) == [2, 2]
    with pytest.raises(CorpError, match=r"floor \(4 dims\) .*; raise the budget or lower round_to"):
        allocate(units, 50, 50 + 2 * 4 * 2 - 1, round_to=4)
    with pytest.raises(CorpError) as refused:
        allocate(units, 50, 50 + 2 * 1 * 2 - 1)
    assert str(refused.value) == (  # one unit (MACs, for a model this small) and shares of the dense model
        "the budget (53 MACs, 0.212 of the dense model's 250 MACs) is below what the floors allow: with "
        "every unit at its floor (1 dim) the model still needs 70 MACs, 0.28 of the dense model's; raise the budget"
    )


@pytest.fixture
def budget_batches(image_batches):
    return image_batches(3, 8)


def test_full_budget_reproduces_the_dense_model(vit, budget_batches, image_batches):
    x = image_batches(1, 4, seed=7)[0]
    model, report = compress(vit, budget_batches, CompressConfig.from_settings(macs=1.0))
    assert report["macs"]["compressed"] == report["macs"]["dense"]
    assert all(u["kept"] == u["total"] for u in report["budget"]["units"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs", [dict(macs=0.6), dict(speedup=2.0, round_to=4), dict(macs=0.5, equal_head_dims=True)]
)
def test_budget_mode_meets_the_budget_and_records_every_unit(vit, budget_batches, kwargs):
    config = CompressConfig.from_settings(**kwargs)
    model, report = compress(vit, budget_batches, config)
    budget = report["budget"]
    dense = count_macs(vit, (3, 32, 32))
    assert budget["budget_macs"] == math.floor(config.options.macs_fraction * dense)
    assert report["macs"]["compressed"] == count_macs(model, (3, 32, 32)) == budget["planned_macs"]
    assert budget["planned_macs"] <= budget["budget_macs"]
    parts = ["mlp", "qkvo"] if config.options.equal_head_dims else ["mlp", "qk", "vo"]
    assert [(u["block"], u["part"]) for u in budget["units"]] == [(b, p) for b in range(2) for p in parts]
    for unit in budget["units"]:
        assert unit["kept"] % config.round_to == 0 or unit["kept"] == unit["total"]
    for unit, layer in zip(budget["units"][:: len(parts)], report["layers"]):
        assert unit["kept"] == layer["dims"]["mlp_hidden"]
    for layer in report["layers"]:
        dims = layer["dims"]
        assert dims["attention"] == "pruned"
        if config.options.equal_head_dims:
            assert dims["qk_head_dim"] == dims["v_head_dim"]


def test_independent_budget_compression_reuses_the_curves_selection(vit, budget_batches, monkeypatch):
    """The orders and query/key solutions from the curves pass are those the compression pass
    would compute again: the same kept sets, the same weights up to the float64 rounding of two
    ways of solving the same system (then stored in float32)."""
    config = CompressConfig.from_settings(macs=0.5)
    reused, report = compress(vit, budget_batches, config)
    assert any(u["part"] == "qk" and u["kept"] < u["total"] for u in report["budget"]["units"])
    plan = corp_method.plan_budget

    def plan_without_orders(model, run, config):
        sizes, report = plan(model, run, config)
        return [type(s)(s.mlp, s.qk, s.v) for s in sizes], report

    monkeypatch.setattr(corp_method, "plan_budget", plan_without_orders)
    selected_again, _ = compress(vit, budget_batches, config)
    assert reused.state_dict().keys() == selected_again.state_dict().keys()
    for a, b in zip(reused.state_dict().values(), selected_again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
