"""The arithmetic of kept dimensions."""

from __future__ import annotations

import math


def kept_count(total: int, sparsity: float, round_to: int = 1) -> int:
    """Number of dims kept out of ``total`` at ``sparsity``.

    ``total - round(sparsity * total)`` (halves round up), then rounded to the nearest
    multiple of ``round_to`` (at least ``round_to``, at most ``total``).
    """
    kept = total - math.floor(sparsity * total + 0.5)
    if round_to > 1:
        kept = round_to * math.floor(kept / round_to + 0.5)
        kept = max(round_to, kept)
    return max(1, min(total, kept))
