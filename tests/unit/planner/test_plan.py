"""One planning interval end to end, without I/O: router snapshots in, decisions out."""

from __future__ import annotations

import dataclasses

from services.engines.sim.profile import load_profile
from services.planner.decision import Bounds
from services.planner.observe import RouterSnapshot
from services.planner.plan import BreachMemory, Planner, step_record
from services.planner.predictors import ConstantPredictor
from services.planner.sizing import Load, Slo, decode_size, prefill_size


def _snapshot(
    at_s: float,
    requests: float,
    ready: tuple[int, int] | None = (1, 1),
    tokens: tuple[float, float] | None = None,
) -> RouterSnapshot:
    """``tokens``: every request's prompt and generated length so far (``None``: a router
    that counts no tokens)."""
    ttft_ms, itl_ms = 60.0, 8.0  # means of every request so far
    return RouterSnapshot(
        prompt_tokens=None if tokens is None else (requests * tokens[0], requests),
        generation_tokens=None if tokens is None else (requests * tokens[1], requests),
        at_s=at_s,
        requests=requests,
        ttft_sum_s=requests * ttft_ms / 1000,
        ttft_count=requests,
        itl_sum_s=requests * 100 * itl_ms / 1000,
        itl_count=requests * 100,
        ready_prefill=ready[0] if ready else None,
        ready_decode=ready[1] if ready else None,
    )


def _planner(window: int = 2, *, cached_tokens: bool = True) -> Planner:
    return Planner(
        load_profile(),
        Slo(ttft_ms=200, itl_ms=20),
        ConstantPredictor(),
        prefill=Bounds(1, 6),
        decode=Bounds(1, 6),
        window=window,
        input_tokens=2000,
        output_tokens=500,
        cached_tokens=cached_tokens,
    )


def test_the_first_read_starts_from_the_routers_engines_and_holds() -> None:
    planner = _planner()
    step = planner.step(_snapshot(0, 0, ready=(2, 9)))
    assert (step.prefill.decision.desired, step.decode.decision.desired) == (2, 6)  # max 6
    assert step.prefill.decision.reason == "no_metrics"
    assert step.predicted is None


def test_an_interval_sizes_both_pools_for_the_observed_rate() -> None:
    planner = _planner()
    planner.step(_snapshot(0, 0))
    step = planner.step(_snapshot(10, 400))  # 40 requests/s
    assert step.interval is not None
    assert step.predicted == Load(40, 2000, 500)
    # The sizes are the sizing functions' at the corrected SLOs.
    profile = load_profile()
    prefill = prefill_size(profile, Load(40, 2000, 500), 200 / step.prefill.correction)
    decode = decode_size(profile, Load(40, 2000, 500), 20 / step.decode.correction)
    assert step.prefill.decision.needed == prefill.replicas
    assert step.decode.decision.needed == decode.replicas
    assert step.decode.decision.needed > 1
    assert step.decode.decision.reason == "scale_up"
    record = step_record(step)
    assert record["observed"] == {
        "interval_s": 10.0,
        "rate_rps": 40.0,
        "ttft_ms": 60.0,
        "itl_ms": 8.0,
    }
    assert record["decode"]["desired"] == step.decode.decision.desired  # type: ignore[index]


def test_missing_figures_and_a_router_restart_hold_the_last_decision() -> None:
    planner = _planner()
    planner.step(_snapshot(0, 0))
    grown = planner.step(_snapshot(10, 400))
    held = planner.step(None)
    assert held.decode.decision.desired == grown.decode.decision.desired
    assert held.decode.decision.reason == held.prefill.decision.reason == "no_metrics"
    restarted = planner.step(_snapshot(20, 3))  # the counter went down
    assert restarted.decode.decision.reason == "no_metrics"
    assert restarted.decode.decision.desired == grown.decode.decision.desired


def test_a_slower_fleet_than_the_profile_needs_more_engines() -> None:
    fast, slow = _planner(), _planner()
    fast.step(_snapshot(0, 0))
    slow.step(_snapshot(0, 0))
    quick = fast.step(_snapshot(10, 100))
    late = RouterSnapshot(10, 100, 100 * 0.6, 100, 100 * 100 * 0.04, 100 * 100, 1, 1)
    lagging = slow.step(late)  # TTFT 600 ms, ITL 40 ms observed
    assert lagging.prefill.correction > quick.prefill.correction
    assert lagging.decode.correction > quick.decode.correction
    assert lagging.decode.decision.needed > quick.decode.decision.needed
    assert lagging.prefill.decision.needed > quick.prefill.decision.needed


def test_the_routers_token_figures_replace_the_given_lengths_until_they_are_missing() -> None:
    planner = _planner()
    planner.step(_snapshot(0, 0, tokens=(0, 0)))
    measured = planner.step(_snapshot(10, 400, tokens=(1000, 100)))
    assert measured.predicted == Load(40, 1000, 100)
    assert measured.lengths == "router"
    assert step_record(measured)["predicted"]["lengths"] == "router"  # type: ignore[index]
    # No request finished in the next interval: the last measured lengths hold.
    idle = planner.step(_snapshot(20, 400, tokens=(1000, 100)))
    assert idle.predicted == Load(0, 1000, 100) and idle.lengths == "router"
    # A router without token figures: the settings' lengths, and said so.
    given = _planner()
    given.step(_snapshot(0, 0))
    step = given.step(_snapshot(10, 400))
    assert step.predicted == Load(40, 2000, 500) and step.lengths == "flags"


def test_a_missed_slo_the_profile_cannot_explain_asks_one_engine_more() -> None:
    planner = _planner()
    planner.step(_snapshot(0, 0, ready=(2, 2)))
    # 1 request/s: the profile sizes both pools at one engine, at any bounded correction; but
    # the interval's TTFT (600 ms) and ITL (40 ms) miss the SLOs (200 ms, 20 ms).
    late = RouterSnapshot(10, 10, 10 * 0.6, 10, 10 * 100 * 0.04, 10 * 100, 2, 2)
    step = planner.step(late)
    assert step.prefill.size is not None and step.prefill.size.replicas <= 2
    assert step.decode.size is not None and step.decode.size.replicas <= 2
    assert (step.prefill.decision.needed, step.decode.decision.needed) == (3, 3)
    assert (step.prefill.decision.desired, step.decode.decision.desired) == (3, 3)
    assert step.prefill.slo_breach and step.decode.slo_breach
    assert step_record(step)["decode"]["slo_breach"] is True  # type: ignore[index]
    # Within the SLOs the profile's size stands (no breach, and the pools wait out the window).
    # Ten more requests at TTFT 60 ms and ITL 8 ms (the sums are cumulative).
    fine = planner.step(RouterSnapshot(20, 20, 6.0 + 0.6, 20, 40.0 + 8.0, 2000, 3, 3))
    assert fine.interval is not None and round(fine.interval.ttft_ms or 0, 6) == 60.0
    assert fine.prefill.decision.reason == "hold_stabilizing"
    assert not fine.prefill.slo_breach and not fine.decode.slo_breach
    assert fine.decode.decision.desired == 3
    assert "slo_breach" not in step_record(fine)["decode"]  # type: ignore[operator]


def test_a_size_that_missed_is_not_chosen_again_at_that_rate() -> None:
    memory = BreachMemory(margin=0.8, keep_intervals=3)
    memory.record(1, 8.0)  # one engine missed its SLO at 8 requests/s
    assert memory.floor(1, 8.0) == 2
    assert memory.floor(1, 6.5) == 2  # within the margin of the rate it missed at
    assert memory.floor(1, 6.0) == 1  # the load fell: one engine again
    memory.record(2, 9.0)
    assert memory.floor(1, 9.0) == 3
    memory.record(1, 4.0)  # the lowest rate counts
    assert memory.floor(1, 4.0) == 2 and memory.floor(1, 3.0) == 1
    for _ in range(3):
        memory.tick()
    assert memory.floor(1, 9.0) == 1  # forgotten


def test_after_a_breach_the_pool_does_not_go_back_down_at_the_same_load() -> None:
    planner = _planner(window=1)  # no stabilization: only the memory keeps the pool up
    planner.step(_snapshot(0, 0, ready=(1, 1)))
    # 1 request/s, ITL 40 ms observed with one decode engine: the SLO (20 ms) missed.
    missed = planner.step(RouterSnapshot(10, 10, 0.6, 10, 10 * 100 * 0.04, 1000, 1, 1))
    assert missed.decode.slo_breach and missed.decode.decision.desired == 2
    # Two engines meet it at the same rate: the profile says one is enough, the memory keeps 2.
    met = planner.step(RouterSnapshot(20, 20, 1.2, 20, 40.0 + 8.0, 2000, 1, 2))
    assert not met.decode.slo_breach
    assert met.decode.size is not None and met.decode.size.replicas == 1
    assert met.decode.decision.desired == 2
    # The load falls well below the rate one engine missed at: back to one.
    quiet = planner.step(RouterSnapshot(30, 22, 1.32, 22, 48.0 + 1.6, 2200, 1, 2))
    assert quiet.decode.decision.desired == 1


def test_the_prefill_pool_is_sized_for_what_the_router_found_uncached() -> None:
    """The router's cached tokens per prefill placement reach the sizing: a fleet whose
    prompts mostly hit is not sized as if every token were computed."""
    sized = {}
    for cached in (0.0, 1800.0):
        planner = _planner()
        for at_s, requests in ((0, 0), (10, 1200)):  # 120 requests/s
            snapshot = _snapshot(at_s, requests, tokens=(2000, 500))
            snapshot = dataclasses.replace(
                snapshot, prefill_cached_tokens=(requests * cached, requests)
            )
            step = planner.step(snapshot)
        assert step.predicted is not None and step.predicted.cached_tokens == cached
        assert step_record(step)["predicted"]["cached_tokens"] == cached  # type: ignore[index]
        sized[cached] = step.prefill.decision.needed
    assert sized[1800.0] < sized[0.0], sized


def test_a_planner_told_to_ignore_the_cache_sizes_as_if_every_token_were_computed() -> None:
    """``cached_tokens=False`` (``pdserve planner --no-cached-tokens``, the comparison run of
    ``pdserve bench goodput --trace``): the same cached figures change nothing."""
    needed = {}
    for use in (True, False):
        planner = _planner(cached_tokens=use)
        for at_s, requests in ((0, 0), (10, 1200)):
            snapshot = dataclasses.replace(
                _snapshot(at_s, requests, tokens=(2000, 500)),
                prefill_cached_tokens=(requests * 1800.0, requests),
            )
            step = planner.step(snapshot)
        assert step.predicted is not None
        assert step.predicted.cached_tokens == (1800.0 if use else 0.0)
        needed[use] = step.prefill.decision.needed
    assert needed[True] < needed[False], needed
