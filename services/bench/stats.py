"""Summary statistics the benchmarks share: one percentile rule for every reported figure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], points: Sequence[float]) -> list[float]:
    """Nearest-rank percentiles of ``values``, one per entry of ``points`` (in percent): the
    smallest value with at least that share of all values at or below it (no interpolation,
    so every figure is an observed value). NaN for each point when ``values`` is empty."""
    ordered = sorted(values)
    count = len(ordered)
    if not count:
        return [math.nan for _ in points]
    return [ordered[min(count - 1, max(0, math.ceil(point * count / 100) - 1))] for point in points]
