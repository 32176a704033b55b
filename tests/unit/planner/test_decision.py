"""A pool's desired count: up at once, down only after a window of lower needs, within its
bounds, with the reason of every decision."""

from __future__ import annotations

import pytest

from services.planner.decision import Bounds, PoolPlanner


def _decide(planner: PoolPlanner, needs: list[int]) -> list[tuple[int, str]]:
    return [(d.desired, d.reason) for d in map(planner.decide, needs)]


def test_up_at_once_down_after_the_window_to_the_highest_need_in_it() -> None:
    planner = PoolPlanner(Bounds(1, 10), window=3, initial=5)
    assert _decide(planner, [8, 3, 4, 2, 2, 2]) == [
        (8, "scale_up"),
        (8, "hold_stabilizing"),
        (8, "hold_stabilizing"),
        (4, "scale_down"),  # the window holds 3, 4, 2: all below 8, the highest is 4
        (4, "hold_stabilizing"),  # 4, 2, 2: 4 is not below 4
        (2, "scale_down"),
    ]


def test_an_oscillating_load_never_scales_down_within_the_window() -> None:
    planner = PoolPlanner(Bounds(1, 10), window=3, initial=2)
    decisions = _decide(planner, [6, 2, 6, 2, 6, 2, 6, 2])
    assert [desired for desired, _ in decisions] == [6] * 8
    assert {reason for _, reason in decisions} == {"scale_up", "hold", "hold_stabilizing"}


def test_a_window_of_one_follows_the_need() -> None:
    planner = PoolPlanner(Bounds(1, 10), window=1, initial=5)
    assert _decide(planner, [3, 7, 7]) == [(3, "scale_down"), (7, "scale_up"), (7, "hold")]


def test_needs_beyond_the_bounds_stop_at_them() -> None:
    planner = PoolPlanner(Bounds(2, 4), window=1)
    assert planner.desired == 2  # starts at min without an initial count
    assert _decide(planner, [9, 9, 0, 0]) == [
        (4, "scale_up"),
        (4, "at_max"),
        (2, "scale_down"),
        (2, "at_min"),
    ]
    decision = planner.decide(9)
    assert (decision.desired, decision.needed) == (4, 9)


def test_hold_keeps_the_count_without_forgetting_the_window() -> None:
    planner = PoolPlanner(Bounds(1, 10), window=2, initial=6)
    planner.decide(3)
    assert planner.hold().desired == 6
    assert planner.hold().reason == "no_metrics"
    assert planner.decide(3).desired == 3  # the lower need before the outage still counts


@pytest.mark.parametrize(("low", "high"), [(0, 3), (4, 3)])
def test_bounds_refuse_zero_and_inverted(low: int, high: int) -> None:
    with pytest.raises(ValueError, match="min"):
        Bounds(low, high)
