"""``pdserve up --autoscale``'s reading of the planner and the planner's command line."""

from __future__ import annotations

from services.cli.up_autoscale import planner_argv_flags, read_planner

PLANNER_METRICS = """\
# HELP pdserve_planner_desired_replicas Engines the planner wants in each pool.
# TYPE pdserve_planner_desired_replicas gauge
pdserve_planner_desired_replicas{pool="prefill"} 2.0
pdserve_planner_desired_replicas{pool="decode"} 3.0
# HELP pdserve_planner_decisions_total Decisions by pool and reason.
# TYPE pdserve_planner_decisions_total counter
pdserve_planner_decisions_total{pool="prefill",reason="scale_up"} 1.0
"""


def test_the_planners_desired_sizes_count_once_it_decided() -> None:
    view = read_planner(PLANNER_METRICS)
    assert view.decided
    assert view.desired == {"prefill": 2, "decode": 3}


def test_before_its_first_decision_the_published_sizes_are_not_acted_on() -> None:
    # At start the planner publishes its bounds' view (the minimum) before any decision.
    text = PLANNER_METRICS.split("# HELP pdserve_planner_decisions_total", maxsplit=1)[0]
    view = read_planner(text)
    assert not view.decided
    assert view.desired == {"prefill": 2, "decode": 3}


def test_the_sim_profile_is_the_planners_unless_one_is_named() -> None:
    assert planner_argv_flags("llama", ["--ttft-ms=300"]) == ["--profile=llama", "--ttft-ms=300"]
    assert planner_argv_flags("llama", ["--profile", "x.json"]) == ["--profile", "x.json"]
    assert planner_argv_flags("llama", ["--profile=x.json"]) == ["--profile=x.json"]
    assert planner_argv_flags(None, []) == []
