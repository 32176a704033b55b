"""The router's pool across a control-plane outage (issue 49): engines it had READY are held
when Redis comes back without them, until their new generation is READY, a call on them fails
or the holdover ends; requests it cannot place are 503s naming the outage, never 404s.

The pool is fed views directly (a state machine); the same against a real Redis killed under
load is tests/integration/services/test_redis_restart.py."""

from __future__ import annotations

import pytest

from services.control_plane.wire import EngineRole, EngineState
from services.router.errors import NoEngineAvailable
from services.router.runtime import RouterRuntime
from services.router.scheduling.policies import PromptInfo
from tests.unit.router.fakes import runtime, sample, view

PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
HOLDOVER_S = 10.0
PROMPT = PromptInfo(tuple(range(40)))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ready_pair(clock: Clock) -> RouterRuntime:
    rt = runtime(control_plane_holdover_s=HOLDOVER_S)
    rt.pool._clock = clock
    for v in (view("p", PREFILL), view("d", DECODE)):
        rt.pool.update(v.engine_id, v, resync="start")
    rt.pool._synced.set()
    return rt


def holdovers(rt: RouterRuntime, outcome: str) -> float:
    return sample(rt, "pdserve_router_engine_holdovers_total", outcome=outcome)


def generations(rt: RouterRuntime) -> dict[str, int]:
    return {s.engine_id: s.record.generation for s in rt.pool.slots()}


def test_engines_missing_from_the_re_read_after_an_outage_are_held_until_their_new_generation():
    clock = Clock()
    rt = ready_pair(clock)
    # Redis came back empty: the re-read after the reconnect lists neither engine.
    rt.pool.update("p", None, resync="reconnect")
    rt.pool.update("d", None, resync="reconnect")
    assert rt.pool.held() == ["d", "p"]
    assert rt.scheduler.ready()
    plan = rt.scheduler.plan("tiny", PROMPT)
    assert plan.prefill is not None and plan.prefill.engine_id == "p"
    assert holdovers(rt, "held") == 2
    assert sample(rt, "pdserve_router_ready_engines", role="decode") == 1
    # The engines register again: PENDING at a new generation keeps the hold, READY replaces.
    rt.pool.update("p", view("p", PREFILL, generation=2, state=EngineState.PENDING))
    assert rt.pool.held() == ["d", "p"] and generations(rt) == {"d": 1, "p": 1}
    rt.pool.update("p", view("p", PREFILL, generation=2))
    rt.pool.update("d", view("d", DECODE, generation=2))
    assert rt.pool.held() == []
    assert generations(rt) == {"d": 2, "p": 2}
    assert holdovers(rt, "replaced") == 2


def test_a_held_engine_leaves_when_a_call_on_it_fails_or_its_holdover_ends():
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("p", None, resync="reconnect")
    rt.pool.update("d", None, resync="reconnect")
    prefill = rt.pool.get("p")
    assert prefill is not None
    rt.pool.call_failed(prefill)
    assert rt.pool.get("p") is None and rt.pool.held() == ["d"]
    assert holdovers(rt, "failed") == 1
    clock.now += HOLDOVER_S - 1
    rt.pool.expire_held()
    assert rt.pool.held() == ["d"]
    clock.now += 1
    rt.pool.expire_held()
    assert rt.pool.slots() == ()
    assert holdovers(rt, "expired") == 1
    # Nothing left and nothing registered: a 503 naming the cause, not the 404 of before.
    with pytest.raises(NoEngineAvailable, match="no engine registered in the control plane"):
        rt.scheduler.plan("tiny", PROMPT)


def test_a_hold_that_ran_out_ends_at_the_next_view_of_the_engine():
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("d", None, resync="reconnect")
    clock.now += HOLDOVER_S
    rt.pool.update("d", None, resync="periodic")
    assert rt.pool.get("d") is None and rt.pool.held() == []
    assert holdovers(rt, "expired") == 1


def test_a_lease_running_out_just_after_the_outage_is_held_too():
    """After a Sentinel failover the re-read still lists the engines; their leases run out a
    moment later (their heartbeats had not reached the new master yet): a periodic re-read
    within the holdover of the reconnect holds them; an event or a later one does not."""
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("p", view("p", PREFILL), resync="reconnect")  # listed: nothing held
    assert rt.pool.held() == []
    clock.now += HOLDOVER_S - 1
    rt.pool.update("p", None, resync="periodic")
    assert rt.pool.held() == ["p"]
    rt.pool.update("d", None)  # an event (deregistered): Redis's word
    assert rt.pool.get("d") is None
    rt = ready_pair(clock)
    rt.pool.update("p", view("p", PREFILL), resync="reconnect")
    clock.now += HOLDOVER_S + 1
    rt.pool.update("p", None, resync="periodic")
    assert rt.pool.get("p") is None


def test_a_re_registration_just_after_the_outage_is_held_until_its_generation_is_ready():
    """After a Sentinel failover the re-read still lists the engines; the decode engine's
    heartbeat then finds its lease gone before any re-read does, and registers again: its new
    generation's event (PENDING) holds the old one, which serves until the new one is READY.
    Later, or without an outage, a new generation replaces the old one at once."""
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("d", view("d", DECODE), resync="reconnect")  # listed: nothing held
    clock.now += 1
    rt.pool.update("d", view("d", DECODE, generation=2, state=EngineState.PENDING))
    assert rt.pool.held() == ["d"] and generations(rt) == {"d": 1, "p": 1}
    assert rt.scheduler.ready()
    rt.pool.update("d", view("d", DECODE, generation=2))
    assert rt.pool.held() == [] and generations(rt) == {"d": 2, "p": 1}
    assert holdovers(rt, "replaced") == 1
    rt.pool.update("p", None)  # an event (deregistered) within the holdover: Redis's word
    assert rt.pool.get("p") is None
    for since_reconnect in (HOLDOVER_S + 1, None):
        rt = ready_pair(clock)
        if since_reconnect is not None:
            rt.pool.update("d", view("d", DECODE), resync="reconnect")
            clock.now += since_reconnect
        rt.pool.update("d", view("d", DECODE, generation=2, state=EngineState.PENDING))
        assert rt.pool.get("d") is None and not rt.scheduler.ready()


def test_redis_listing_the_same_generation_again_ends_the_hold():
    """A Sentinel replica promoted with the registrations: nothing to replace."""
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("d", None, resync="reconnect")
    slot = rt.pool.get("d")
    rt.pool.update("d", view("d", DECODE))
    assert rt.pool.held() == [] and rt.pool.get("d") is slot
    assert holdovers(rt, "confirmed") == 1


def test_only_the_re_read_after_a_reconnect_holds_and_only_engines_that_answer():
    clock = Clock()
    rt = ready_pair(clock)
    rt.pool.update("p", None)  # an event: deregistered (a clean stop)
    rt.pool.update("d", None, resync="periodic")  # a lease that ran out while Redis was up
    assert rt.pool.slots() == ()
    rt = ready_pair(clock)
    decode = rt.pool.get("d")
    assert decode is not None
    rt.pool.call_failed(decode)  # its breaker is open: nothing vouches for it
    rt.pool.update("d", None, resync="reconnect")
    rt.pool.update("p", None, resync="reconnect")
    assert rt.pool.held() == ["p"]
    assert holdovers(rt, "held") == 1


def test_an_outage_is_measured_and_named_in_the_503_when_no_decode_engine_answers():
    clock = Clock()
    rt = ready_pair(clock)
    assert rt.pool.control_plane_unreachable_s() == 0
    rt.pool._following_since = clock.now  # the watcher lost Redis (follow() sets it)
    clock.now += 42
    assert rt.pool.control_plane_unreachable_s() == 42
    assert sample(rt, "pdserve_router_control_plane_unreachable_seconds") == 42
    # The last view still serves while the engines answer.
    assert rt.scheduler.plan("tiny", PROMPT).decode.engine_id == "d"
    decode = rt.pool.get("d")
    assert decode is not None
    rt.pool.call_failed(decode)
    with pytest.raises(NoEngineAvailable) as refused:
        rt.scheduler.plan("tiny", PROMPT)
    assert refused.value.status_code == 503
    assert refused.value.message == (
        "no decode engine of 'tiny' answers (the last call on each failed) "
        "(the control plane has been unreachable for 42 s)"
    )
