"""Interleaved latency measurement: several callables timed round-robin in one process.

On a shared, noisy machine two things measured one after the other see different machines;
timed in alternation, each round gives both the same conditions, and the per-round ratio
is what a speedup should be computed from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def interleaved(
    runs: dict[str, Callable[[], object]],
    *,
    warmup: int = 3,
    min_time: float = 2.0,
    min_rounds: int = 5,
    max_rounds: int = 10_000,
    timed: bool = False,
) -> dict[str, list[float]]:
    """Wall times (s) of each callable, measured in rounds in which every callable runs once; with
    ``timed``, each callable times itself and returns its seconds (CUDA events around work left on
    a GPU: :func:`exporters.runners.cuda_event_timer`), which are recorded instead.

    After ``warmup`` untimed rounds, rounds continue until every callable has been timed for
    ``min_time`` seconds in total and at least ``min_rounds`` times (at most ``max_rounds``).
    The order inside a round alternates (A B, B A, ...) so that neither side always runs first.
    """
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or min(sum(s) for s in samples.values()) < min_time):
        for name in names if rounds % 2 == 0 else reversed(names):
            start = time.perf_counter()
            took = runs[name]()
            samples[name].append(took if timed else time.perf_counter() - start)
        rounds += 1
    return samples


def summarize(samples: list[float], batch: int) -> dict:
    """Percentiles (s) of one callable's latency and its throughput (images/s at the median)."""
    t = np.asarray(samples)
    p50, p90, p99 = np.percentile(t, [50, 90, 99])
    return {
        "runs": len(t),
        "p50_s": float(p50),
        "p90_s": float(p90),
        "p99_s": float(p99),
        "mean_s": float(t.mean()),
        "min_s": float(t.min()),
        "throughput_ips": batch / float(p50),
    }


def speedup(slow: list[float], fast: list[float]) -> dict:
    """``slow / fast`` per round (both timed in the same round): median and spread."""
    ratios = np.asarray(slow) / np.asarray(fast)
    p10, median, p90 = np.percentile(ratios, [10, 50, 90])
    return {
        "median": float(median),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "rounds": len(ratios),
    }
