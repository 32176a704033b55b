"""The benchmarks' one percentile rule (nearest rank)."""

from __future__ import annotations

import math

from services.bench.stats import percentiles


def test_nearest_rank_percentiles_are_observed_values() -> None:
    assert percentiles(range(1, 101), (0, 50, 90, 99, 100)) == [1, 50, 90, 99, 100]
    assert percentiles([2.0, 1.0], (50, 99)) == [1.0, 2.0]
    assert percentiles([7.0], (50, 99)) == [7.0, 7.0]


def test_no_values_give_nan() -> None:
    assert all(math.isnan(value) for value in percentiles([], (50, 99)))
