"""The engines' own load as a floor under the planner's sizing: a full decode KV cache and a
prefill queue beyond what the TTFT SLO allows each ask one engine more, never fewer, and a
missing figure changes nothing; end to end through :class:`Planner` and its JSON line."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from services.engines.sim.profile import load_profile
from services.planner.decision import Bounds
from services.planner.main import publish
from services.planner.metrics import PlannerMetrics
from services.planner.observe import EngineReport, PoolLoad, RouterSnapshot
from services.planner.plan import Planner, PlanStep, step_record
from services.planner.predictors import ConstantPredictor
from services.planner.pressure import allowed_queue, kv_pressure_need, queue_need
from services.planner.sizing import Slo


def _load(queue: float = 0, free: float = 0, total: float = 0, engines: int = 2) -> PoolLoad:
    return PoolLoad(engines, queue, 0, free, total)


def test_kv_usage_above_the_limit_asks_one_decode_engine_more() -> None:
    assert kv_pressure_need(_load(free=100, total=1000), ready=2, limit=0.9) is None  # 0.9
    assert kv_pressure_need(_load(free=99, total=1000), ready=2, limit=0.9) == 3
    assert kv_pressure_need(_load(free=0, total=1000), ready=None, limit=0.9) == 3  # reporters
    assert kv_pressure_need(_load(free=0, total=1000), ready=2, limit=1.0) is None  # off
    # Unknown: no relay, or engines that report no KV capacity.
    assert kv_pressure_need(None, ready=2, limit=0.9) is None
    assert kv_pressure_need(_load(free=0, total=0), ready=2, limit=0.9) is None


def test_a_queue_above_the_limit_asks_one_prefill_engine_more() -> None:
    assert queue_need(_load(queue=6), ready=2, limit=3) is None  # 3 an engine
    assert queue_need(_load(queue=7), ready=2, limit=3) == 3
    assert queue_need(_load(queue=7, engines=1), ready=None, limit=3) == 2
    assert queue_need(None, ready=2, limit=3) is None


def test_the_allowed_queue_is_the_ttft_slo_over_one_prefill_of_the_mean_prompt() -> None:
    profile = load_profile()
    one = profile.prefill_ms(2000)
    assert allowed_queue(profile, 2000, 10 * one) == pytest.approx(10)
    assert allowed_queue(profile, 2000, one / 2) == 1  # never below one request
    assert allowed_queue(profile, 500, 10 * one) > 10  # shorter prompts: a longer queue


def _planner(kv_usage_limit: float, prefill_queue_limit: float | None) -> Planner:
    return Planner(
        load_profile(),
        Slo(ttft_ms=2000, itl_ms=20),
        ConstantPredictor(),
        prefill=Bounds(1, 8),
        decode=Bounds(1, 8),
        window=3,
        input_tokens=2000,
        output_tokens=500,
        kv_usage_limit=kv_usage_limit,
        prefill_queue_limit=prefill_queue_limit,
    )


def _snapshot(
    at_s: float, requests: float, loads: tuple[EngineReport, ...] | None
) -> RouterSnapshot:
    """Every request so far at TTFT 60 ms and ITL 8 ms (within the SLOs), two engines a pool."""
    return RouterSnapshot(
        at_s=at_s,
        requests=requests,
        ttft_sum_s=requests * 0.06,
        ttft_count=requests,
        itl_sum_s=requests * 100 * 0.008,
        itl_count=requests * 100,
        ready_prefill=2,
        ready_decode=2,
        engine_loads=loads,
    )


def _engines(prefill_queue: int, decode_free: int) -> tuple[EngineReport, ...]:
    """Two engines a pool: the prefill queue split over its two, decode's free blocks of
    2 x 1000 likewise."""
    return (
        EngineReport("d0", "decode", 0, 10, decode_free // 2, 1000),
        EngineReport("d1", "decode", 0, 10, decode_free - decode_free // 2, 1000),
        EngineReport("p0", "prefill", prefill_queue // 2, 1, 1000, 1000),
        EngineReport("p1", "prefill", prefill_queue - prefill_queue // 2, 1, 1000, 1000),
    )


def _second_step(
    requests: float,
    loads: tuple[EngineReport, ...] | None,
    kv_usage_limit: float = 0.9,
    prefill_queue_limit: float | None = None,
) -> PlanStep:
    """The planner's step after a first read: ``requests`` in 10 s, the engines' ``loads``
    at both reads."""
    planner = _planner(kv_usage_limit, prefill_queue_limit)
    planner.step(_snapshot(0, 0, loads))
    return planner.step(_snapshot(10, requests, loads))


def test_the_rules_raise_a_low_need_and_say_why() -> None:
    calm = _second_step(10, _engines(prefill_queue=0, decode_free=1000))
    assert (calm.prefill.decision.needed, calm.decode.decision.needed) == (1, 1)
    assert calm.prefill.pressure is None and calm.decode.pressure is None
    # 1 request/s sizes both pools at one engine; the engines say otherwise.
    allowed = allowed_queue(load_profile(), 2000, 2000)
    queued = 2 * int(allowed) + 4  # over the allowed queue on each of the two engines
    busy = _second_step(10, _engines(prefill_queue=queued, decode_free=100))
    assert busy.prefill.size is not None and busy.prefill.size.replicas == 1
    assert busy.decode.size is not None and busy.decode.size.replicas == 1
    assert (busy.prefill.decision.needed, busy.decode.decision.needed) == (3, 3)
    assert (busy.prefill.decision.desired, busy.decode.decision.desired) == (3, 3)
    assert (busy.prefill.pressure, busy.decode.pressure) == ("queue", "kv_pressure")
    record = step_record(busy)
    assert record["prefill"]["pressure"] == "queue"  # type: ignore[index]
    assert record["prefill"]["queue_depth"] == queued  # type: ignore[index]
    assert record["decode"]["pressure"] == "kv_pressure"  # type: ignore[index]
    assert record["decode"]["kv_usage"] == 0.95  # type: ignore[index]
    assert "pressure" not in step_record(calm)["decode"]  # type: ignore[operator]


def test_the_rules_never_lower_a_need() -> None:
    # 200 requests/s needs more than three engines a pool whatever the engines say.
    plain = _second_step(2000, _engines(prefill_queue=0, decode_free=1000))
    busy = _second_step(2000, _engines(prefill_queue=400, decode_free=0))
    assert plain.decode.decision.needed > 3 and plain.prefill.decision.needed > 3
    assert busy.decode.decision.needed == plain.decode.decision.needed
    assert busy.prefill.decision.needed == plain.prefill.decision.needed
    assert busy.decode.pressure == "kv_pressure"  # fired, but the profile asked for more


def test_a_missing_signal_changes_nothing() -> None:
    bare = _second_step(10, None)  # a router that relays no engine load
    assert (bare.prefill.decision.needed, bare.decode.decision.needed) == (1, 1)
    assert bare.prefill.load is None and bare.prefill.pressure is None
    assert "kv_usage" not in step_record(bare)["decode"]  # type: ignore[operator]
    no_kv = tuple(
        replace(report, kv_blocks_free=0, kv_blocks_total=0)
        for report in _engines(prefill_queue=0, decode_free=0)
    )
    unknown = _second_step(10, no_kv)  # engines that report no KV capacity
    assert unknown.decode.decision.needed == 1 and unknown.decode.pressure is None
    assert step_record(unknown)["decode"]["kv_usage"] is None  # type: ignore[index]


def test_the_limits_are_settings() -> None:
    loads = _engines(prefill_queue=4, decode_free=400)  # 2 queued an engine, KV 80% used
    default = _second_step(10, loads)
    assert default.prefill.pressure is None and default.decode.pressure is None
    tight = _second_step(10, loads, kv_usage_limit=0.75, prefill_queue_limit=1)
    assert (tight.prefill.pressure, tight.decode.pressure) == ("queue", "kv_pressure")
    assert (tight.prefill.decision.needed, tight.decode.decision.needed) == (3, 3)


def test_the_pools_load_is_published_and_withdrawn_when_unknown() -> None:
    metrics = PlannerMetrics(CollectorRegistry())
    busy = _second_step(10, _engines(prefill_queue=6, decode_free=100))
    publish(metrics, busy)
    value = metrics.registry.get_sample_value
    assert value("pdserve_planner_queued_requests", {"pool": "prefill"}) == 6
    assert value("pdserve_planner_kv_usage_ratio", {"pool": "decode"}) == pytest.approx(0.95)
    publish(metrics, _second_step(10, None))
    assert value("pdserve_planner_queued_requests", {"pool": "prefill"}) is None
    assert value("pdserve_planner_kv_usage_ratio", {"pool": "decode"}) is None
