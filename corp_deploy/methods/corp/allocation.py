"""Spending a MAC budget over the prunable units where their distortion grows least
(docs/method.md §8).

Every unit's MACs are linear in its kept size (``macs_per_dim`` per kept dim; the rest of the
model is fixed), so the problem is: choose a kept size ``k_u`` for every unit, among multiples
of ``round_to`` (or the full size) above a floor, minimising ``sum_u D_u(k_u)`` subject to
``fixed + sum_u macs_per_dim_u * k_u <= budget``. Each unit's steps from its full size
downwards are ranked by the slope of the lower convex hull of its (MACs saved, distortion)
points (the marginal distortion per MAC saved, made monotone); the steps of all units are taken
in order of slope until the budget is met. Optimal whenever the curves are convex; the result
is never above the budget and at most one step below it. Deterministic: ties go to the earlier
step, then the earlier unit, so equal curves give equal sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...cost import share_text
from ...errors import BadUsage, SettingError


@dataclass(frozen=True)
class Unit:
    """What the allocation needs of a unit: its full size, the MACs of one kept dim, and its
    distortion ``(total + 1,)`` by kept size."""

    total: int
    macs_per_dim: int
    distortion: torch.Tensor


def candidate_sizes(total: int, round_to: int, floor: float) -> list[int]:
    """Kept sizes a unit may take, from ``total`` downwards: ``total``, then the multiples of
    ``round_to`` below it down to ``ceil(floor * total)`` rounded up to a multiple (at least one
    multiple, and never above ``total``)."""
    lowest = max(round_to, round_to * math.ceil(math.ceil(floor * total) / round_to))
    top = round_to * ((total - 1) // round_to)  # the largest multiple below total
    return [total] + list(range(top, lowest - 1, -round_to))


def _macs_text(macs: int, dense_macs: int) -> str:
    """``macs`` in the unit that suits the dense model's ``dense_macs``: GMACs, or MACs for a model
    of under a million (so that every number of one message is in one unit)."""
    return f"{macs / 1e9:.4g} GMACs" if dense_macs >= 1e6 else f"{macs:,} MACs"


def check_feasible(
    shapes: Sequence[tuple[int, int]], fixed_macs: int, budget_macs: int, round_to: int = 1, floor: float = 0.0
) -> None:
    """CorpError when even every unit at its smallest size exceeds the budget. ``shapes``: every
    unit's ``(total, macs_per_dim)``."""
    lowest = fixed_macs + sum(candidate_sizes(total, round_to, floor)[-1] * per_dim for total, per_dim in shapes)
    if lowest > budget_macs:
        dense = fixed_macs + sum(total * per_dim for total, per_dim in shapes)

        def amount(macs: int) -> str:
            return f"{_macs_text(macs, dense)}, {share_text(macs / dense)} of the dense model's"

        needs = (
            f"the budget ({amount(budget_macs)} {_macs_text(dense, dense)}) is below what the floors "
            f"allow: with every unit at its floor ({floor_text(floor, round_to)}) the model still needs "
            f"{amount(lowest)}; raise the budget"
        )
        if floor > 0:
            raise SettingError(f"{needs} or lower {{setting}}", "unit_floor")
        if round_to > 1:
            raise SettingError(f"{needs} or lower {{setting}}", "round_to")
        raise BadUsage(needs)


def floor_text(floor: float, round_to: int) -> str:
    """The smallest size a unit may keep, in words: ``floor`` of its dims, and at least one ``round_to`` step."""
    step = f"{round_to} dim{'s' if round_to > 1 else ''}"
    return f"{floor:.0%} of its dims, at least {step}" if floor > 0 else step


def allocate(
    units: Sequence[Unit], fixed_macs: int, budget_macs: int, round_to: int = 1, floor: float = 0.0
) -> list[int]:
    """Kept size of every unit (see the module docstring). ``fixed_macs``: the MACs of
    everything that is not pruned. CorpError when even every unit at its floor exceeds the budget."""
    check_feasible([(u.total, u.macs_per_dim) for u in units], fixed_macs, budget_macs, round_to, floor)
    kept = [u.total for u in units]
    macs = fixed_macs + sum(u.total * u.macs_per_dim for u in units)
    steps = []
    for index, unit in enumerate(units):
        sizes = candidate_sizes(unit.total, round_to, floor)
        saved = [(unit.total - k) * unit.macs_per_dim for k in sizes]
        cost = [float(unit.distortion[k]) for k in sizes]
        for step, slope in enumerate(_hull_slopes(saved, cost), start=1):
            steps.append((slope, step, index, sizes[step], saved[step] - saved[step - 1]))
    for _, _, index, size, step_macs in sorted(steps, key=lambda s: s[:3]):
        if macs <= budget_macs:
            break
        kept[index] = size
        macs -= step_macs
    return kept


def _hull_slopes(x: list[int], y: list[float]) -> list[float]:
    """For points with increasing ``x`` (from ``x[0] = 0``), the slope of the lower convex hull
    over each step ``i - 1 -> i`` (every step inside a hull segment gets the segment's slope)."""
    hull = [0]
    for i in range(1, len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (y[b] - y[a]) * (x[i] - x[b]) >= (y[i] - y[b]) * (x[b] - x[a]):
                hull.pop()  # b lies on or above the chord a -> i
            else:
                break
        hull.append(i)
    slopes = []
    for a, b in zip(hull, hull[1:]):
        slope = (y[b] - y[a]) / (x[b] - x[a])
        slopes += [slope] * (b - a)
    return slopes
