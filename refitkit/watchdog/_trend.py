"""Robust trend statistics for memory series: Theil–Sen slope and the Mann–Kendall test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median


def theil_sen_slope(values: Sequence[float]) -> float:
    """Median of all pairwise slopes of ``values`` against their index (0.0 for < 2 points).

    Robust to the one-off spikes allocators produce: up to ~29% of points can be outliers
    before the estimate moves.
    """
    n = len(values)
    if n < 2:
        return 0.0
    return median((values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n))


def mann_kendall_p_increasing(values: Sequence[float]) -> float:
    """One-sided p-value that ``values`` trend upwards (Mann–Kendall, normal approximation).

    The variance is corrected for ties, which flat memory produces in bulk (RSS moves in
    pages); a fully tied series has no evidence of a trend and gets p = 1.
    """
    n = len(values)
    if n < 3:
        return 1.0
    s = 0
    for i in range(n):
        vi = values[i]
        for j in range(i + 1, n):
            diff = values[j] - vi
            s += (diff > 0) - (diff < 0)
    tie_sizes: dict[float, int] = {}
    for v in values:
        tie_sizes[v] = tie_sizes.get(v, 0) + 1
    variance = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in tie_sizes.values())) / 18.0
    if variance <= 0.0 or s <= 0:
        return 1.0 if s <= 0 else 0.0
    z = (s - 1) / math.sqrt(variance)  # continuity correction
    return 0.5 * math.erfc(z / math.sqrt(2.0))
