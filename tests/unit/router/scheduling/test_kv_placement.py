"""Placement from KV events: prefill and decode by cached prefix balanced with load, the local
(conditional disaggregation) threshold, stale engines placed by load, engines without events
on the old behaviour, and every decision counted."""

from __future__ import annotations

import contextlib

from services.control_plane.wire import EngineLoad, EngineRole
from services.kv_events.events import BlockStored, EventBatch
from services.router.scheduling.policies import PromptInfo, Stage
from tests.unit.router.fakes import runtime, sample, view

PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
BS = 4
PROMPT = tuple(range(40))  # 10 full blocks


def evented(engine_id, role, *, queue=0, block_bytes=0):
    return view(
        engine_id,
        role,
        load=EngineLoad(queue_depth=queue),
        kv_block_bytes=block_bytes,
        kv_events_endpoint=f"tcp://127.0.0.1:{len(engine_id)}",
        kv_events_replay_endpoint="tcp://127.0.0.1:2",
    )


def setup(*views, **settings):
    rt = runtime(policy="prefix_aware", **settings)
    for v in views:
        rt.pool.update(v.engine_id, v)
    assert rt.kv_events is not None
    return rt, rt.kv_events.index


def holds(rt, index, engine_id, blocks):
    """``engine_id``'s events stored the first ``blocks`` blocks of PROMPT."""
    tokens = PROMPT[: blocks * BS]
    hashes = tuple(hash((engine_id, i)) for i in range(blocks))
    index.apply(rt.pool.get(engine_id), EventBatch(0.0, (BlockStored(hashes, None, tokens, BS),)))


def test_prefill_goes_to_the_engine_holding_the_longest_prefix():
    rt, index = setup(evented("p1", PREFILL), evented("p2", PREFILL), evented("d", DECODE))
    holds(rt, index, "p1", 3)
    holds(rt, index, "p2", 8)
    for _ in range(3):  # not a rotation: every time
        plan = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
        assert plan.prefill is not None and plan.prefill.engine_id == "p2"
    assert (
        sample(rt, "pdserve_router_placement_decisions_total", pool="prefill", reason="cached") == 3
    )
    assert sample(rt, "pdserve_router_cached_tokens_sum", pool="prefill") == 3 * 8 * BS
    # The decode engine holds nothing: all 10 blocks move (of unknown bytes: not observed).
    assert sample(rt, "pdserve_router_kv_blocks_moved_sum") == 3 * 10
    assert sample(rt, "pdserve_router_kv_bytes_moved_count") == 0
    assert sample(rt, "pdserve_router_placement_decisions_total", pool="decode", reason="load") == 3


def test_load_outweighs_a_cached_prefix_past_the_weight():
    """Score = weight * cached share - load: 4 * 0.8 - 3 > 0 - 0, but 4 * 0.8 - 4 < 0."""
    rt, index = setup(evented("p1", PREFILL), evented("p2", PREFILL, queue=3), evented("d", DECODE))
    holds(rt, index, "p2", 8)
    assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p2"
    rt.pool.update("p2", evented("p2", PREFILL, queue=4))
    assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p1"
    rt2, index2 = setup(
        evented("p1", PREFILL),
        evented("p2", PREFILL, queue=4),
        evented("d", DECODE),
        prefill_cache_weight=10.0,
    )
    holds(rt2, index2, "p2", 8)
    assert rt2.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p2"


def test_decode_prefers_the_engine_holding_the_prompt_so_fewer_blocks_move():
    rt, index = setup(
        evented("p", PREFILL),
        evented("d1", DECODE),
        evented("d2", DECODE, block_bytes=4096),
        evented("d3", DECODE),
    )
    holds(rt, index, "d2", 6)
    for _ in range(3):
        plan = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
        assert plan.prefill is not None and plan.decode.engine_id == "d2"
    assert (
        sample(rt, "pdserve_router_placement_decisions_total", pool="decode", reason="cached") == 3
    )
    assert sample(rt, "pdserve_router_kv_blocks_moved_sum") == 3 * (10 - 6)
    assert sample(rt, "pdserve_router_kv_bytes_moved_sum") == 3 * (10 - 6) * 4096
    assert sample(rt, "pdserve_router_cached_tokens_sum", pool="decode") == 3 * 6 * BS


def test_a_prompt_the_decode_engine_holds_past_the_threshold_runs_there_alone():
    rt, index = setup(
        evented("p", PREFILL),
        evented("d1", DECODE),
        evented("d2", DECODE),
        local_cached_fraction=0.8,
    )
    holds(rt, index, "d2", 7)  # 0.7 of the prompt: disaggregated, on d2
    plan = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
    assert plan.prefill is not None and plan.decode.engine_id == "d2"
    holds(rt, index, "d2", 8)  # 0.8: local on d2
    plan = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
    assert plan.prefill is None and plan.local_reason == "cached_prompt"
    assert plan.decode.engine_id == "d2"
    assert (
        sample(rt, "pdserve_router_placement_decisions_total", pool="local", reason="cached_prompt")
        == 1
    )
    assert sample(rt, "pdserve_router_cached_tokens_sum", pool="local") == 8 * BS


def test_a_stale_engine_is_placed_by_load_only():
    rt, index = setup(evented("p1", PREFILL), evented("p2", PREFILL, queue=1), evented("d", DECODE))
    holds(rt, index, "p2", 10)
    assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p2"
    index.set_stale(rt.pool.get("p2"), stale=True)
    for _ in range(3):
        assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p1"
    index.set_stale(rt.pool.get("p2"), stale=False)
    assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p2"


def test_engines_without_events_keep_the_approximate_policy():
    rt = runtime(policy="prefix_aware")
    for v in (view("p1", PREFILL), view("p2", PREFILL), view("d1", DECODE), view("d2", DECODE)):
        rt.pool.update(v.engine_id, v)
    first = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
    again = rt.scheduler.plan("tiny", PromptInfo((*PROMPT, 1, 2, 3, 4, 5)))
    assert again.prefill is not None and again.prefill.engine_id == first.prefill.engine_id
    assert (
        sample(
            rt, "pdserve_router_placement_decisions_total", pool="prefill", reason="cached_approx"
        )
        == 1
    )
    # The approximate decode choice is least-loaded, whatever it was sent before.
    slots = rt.pool.slots((DECODE,))
    policy = rt.scheduler._policy
    chosen = {policy.choose(slots, PromptInfo(PROMPT), Stage.DECODE).engine_id for _ in range(4)}
    assert chosen == {"d1", "d2"}


def test_without_kv_events_setting_no_index_is_built():
    rt = runtime(policy="prefix_aware", kv_events=False)
    assert rt.kv_events is None
    rt = runtime(policy="round_robin")
    assert rt.kv_events is None


def test_new_prompts_between_cached_ones_still_rotate_over_tied_engines():
    """A clear winner does not turn the tie rotation: prompts held by p2, each followed by a
    prompt no engine holds, send the new ones to p1 and p2 in turn."""
    rt, index = setup(evented("p1", PREFILL), evented("p2", PREFILL), evented("d", DECODE))
    holds(rt, index, "p2", 8)
    fresh: list[str] = []
    for offset in range(4):
        cached = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
        assert cached.prefill is not None and cached.prefill.engine_id == "p2"
        new = rt.scheduler.plan("tiny", PromptInfo(tuple(range(100 + offset, 140 + offset))))
        assert new.prefill is not None
        fresh.append(new.prefill.engine_id)
    assert sorted(fresh) == ["p1", "p1", "p2", "p2"]


def test_a_decode_engine_holding_the_prompt_never_outweighs_a_request_in_flight():
    """On the decode pool a cached block only saves its transfer (``decode_cache_weight`` 1):
    the holder wins at equal load, an engine with a request less in flight wins otherwise."""
    rt, index = setup(evented("p", PREFILL), evented("d1", DECODE), evented("d2", DECODE))
    holds(rt, index, "d2", 8)  # 0.8 of the prompt, below local_cached_fraction
    assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).decode.engine_id == "d2"
    with rt.pool.reserve(rt.pool.get("d2")):
        assert rt.scheduler.plan("tiny", PromptInfo(PROMPT)).decode.engine_id == "d1"
    decisions = "pdserve_router_placement_decisions_total"
    assert sample(rt, decisions, pool="decode", reason="cached") == 1
    assert sample(rt, decisions, pool="decode", reason="load") == 1
    # The prefill pool still weighs a cached prompt as four queued requests.
    rt2, index2 = setup(
        evented("p1", PREFILL), evented("p2", PREFILL, queue=3), evented("d", DECODE)
    )
    holds(rt2, index2, "p2", 10)
    assert rt2.scheduler.plan("tiny", PromptInfo(PROMPT)).prefill.engine_id == "p2"


def test_requests_in_flight_spread_over_decode_engines_though_one_holds_their_prefix():
    """The herding a weight of 4 caused: a decode engine holding a shared system prompt (half
    of each prompt) drew every concurrent conversation. At 1, concurrent requests spread."""
    for weight, expected in ((4.0, [3, 1]), (1.0, [1, 1, 1])):
        rt, index = setup(
            evented("p", PREFILL),
            *(evented(f"d{i}", DECODE) for i in (1, 2, 3)),
            decode_cache_weight=weight,
        )
        holds(rt, index, "d1", 5)
        placed: dict[str, int] = {}
        with contextlib.ExitStack() as in_flight:
            for _ in range(sum(expected)):
                decode = rt.scheduler.plan("tiny", PromptInfo(PROMPT)).decode
                in_flight.enter_context(rt.pool.reserve(decode))
                placed[decode.engine_id] = placed.get(decode.engine_id, 0) + 1
        assert sorted(placed.values(), reverse=True) == expected, (weight, placed)
        assert placed["d1"] == expected[0]  # the holder took the first, at 4 the most


def test_local_placement_weighs_a_cached_prompt_as_a_prefill_does():
    """A local run computes the prompt on the engine, so its cached blocks are weighed with
    ``prefill_cache_weight``: the holder wins with two requests queued (4 * 0.8 - 2 > 0)."""
    rt, index = setup(evented("d1", DECODE), evented("d2", DECODE, queue=2), colocated=True)
    holds(rt, index, "d2", 8)
    plan = rt.scheduler.plan("tiny", PromptInfo(PROMPT))
    assert plan.prefill is None and plan.local_reason == "colocated"
    assert plan.decode.engine_id == "d2"
