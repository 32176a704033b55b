"""Routing policies and scheduling decisions over a pool fed with control-plane views."""

from __future__ import annotations

import gc

import pytest

from services.control_plane.wire import EngineLoad, EngineRole, EngineState
from services.router.errors import NoEngineAvailable
from services.router.scheduling.policies import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    PromptInfo,
    RoundRobinPolicy,
    Stage,
    prompt_block_hashes,
)
from tests.unit.router.fakes import runtime, sample, view

PREFILL, DECODE, BOTH = EngineRole.PREFILL, EngineRole.DECODE, EngineRole.BOTH


def pool_of(rt, *views):
    for v in views:
        rt.pool.update(v.engine_id, v)
    return rt.pool


def test_block_hashes_are_chained_over_full_blocks_only():
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2
    assert a[0] == b[0]
    assert a[1] != b[1]
    # Same block contents after a different prefix hash differently.
    assert prompt_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != a[1]


def test_round_robin_rotates_over_candidates():
    rt = runtime()
    slots = pool_of(rt, view("a", PREFILL), view("b", PREFILL), view("c", PREFILL)).slots()
    policy = RoundRobinPolicy()
    prompt = PromptInfo((1, 2, 3))
    chosen = [policy.choose(slots, prompt, Stage.PREFILL).engine_id for _ in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_spreads_a_burst_through_reservations():
    """Reported load is equal and stale; reservations taken per request keep a burst of
    requests from herding onto one engine."""
    rt = runtime()
    pool = pool_of(rt, view("a", DECODE), view("b", DECODE), view("c", DECODE))
    policy = LeastLoadedPolicy()
    prompt = PromptInfo((1,))
    held = []
    for _ in range(6):
        slot = policy.choose(pool.slots(), prompt, Stage.DECODE)
        context = pool.reserve(slot)
        context.__enter__()
        held.append((slot, context))
    counts = {s.engine_id: s.inflight for s in pool.slots()}
    assert counts == {"a": 2, "b": 2, "c": 2}
    assert sample(rt, "pdserve_router_engine_inflight", engine="a", role="decode") == 2
    for _, context in held:
        context.__exit__(None, None, None)
    assert all(s.inflight == 0 for s in pool.slots())


def test_least_loaded_ties_rotate_per_stage_so_prefill_and_decode_both_spread():
    """Requests that finish before the next one (no reservation left): each stage's ties rotate
    on their own, so alternating prefill and decode picks still spread over both engines of
    each role (one shared rotation sent every prefill to the first and every decode to the
    second)."""
    rt = runtime()
    pool = pool_of(
        rt, view("p1", PREFILL), view("p2", PREFILL), view("d1", DECODE), view("d2", DECODE)
    )
    prefills = [s for s in pool.slots() if s.engine_id.startswith("p")]
    decodes = [s for s in pool.slots() if s.engine_id.startswith("d")]
    for policy in (LeastLoadedPolicy(), PrefixAwarePolicy(64, 4)):
        chosen = []
        for _ in range(4):
            chosen.append(policy.choose(prefills, PromptInfo((1,)), Stage.PREFILL).engine_id)
            chosen.append(policy.choose(decodes, PromptInfo((1,)), Stage.DECODE).engine_id)
        assert sorted(chosen) == ["d1", "d1", "d2", "d2", "p1", "p1", "p2", "p2"]


def test_least_loaded_counts_the_queue_engines_report():
    rt = runtime()
    pool = pool_of(
        rt,
        view("a", DECODE, load=EngineLoad(queue_depth=5)),
        view("b", DECODE, load=EngineLoad(queue_depth=0)),
    )
    policy = LeastLoadedPolicy()
    assert policy.choose(pool.slots(), PromptInfo((1,)), Stage.DECODE).engine_id == "b"
    assert (
        sample(rt, "pdserve_router_engine_load", engine="a", role="decode", kind="queue_depth") == 5
    )


def test_prefix_aware_prefers_the_engine_that_holds_the_prefix():
    rt = runtime()
    pool = pool_of(rt, view("a", PREFILL), view("b", PREFILL))
    policy = PrefixAwarePolicy(capacity_blocks=100, load_slack=2)
    shared = tuple(range(16))
    first = PromptInfo((*shared, 100, 101))
    slot_b = pool.get("b")
    assert slot_b is not None
    policy.routed(slot_b, first)
    second = PromptInfo((*shared, 200, 201, 202))
    for _ in range(3):
        assert policy.choose(pool.slots(), second, Stage.PREFILL).engine_id == "b"
    assert policy.cached_blocks(slot_b, second) == 4


def reported(*hashes: int, queue_depth: int = 0) -> EngineLoad:
    return EngineLoad(
        queue_depth=queue_depth, prefix_cache_reported=True, cached_block_hashes=hashes
    )


def test_prefix_aware_trusts_what_engines_report_over_what_it_sent():
    rt = runtime()
    shared = tuple(range(16))
    hashes = prompt_block_hashes(shared, 4)  # the views' block size
    # "a" reports the prompt's blocks although this router never sent it the prompt; "b" was
    # sent it but reports an empty cache (evicted, or another router's engine restarted).
    pool = pool_of(
        rt, view("a", PREFILL, load=reported(*hashes[::-1])), view("b", PREFILL, load=reported())
    )
    policy = PrefixAwarePolicy(capacity_blocks=100, load_slack=2)
    slot_a, slot_b = pool.get("a"), pool.get("b")
    assert slot_a is not None and slot_b is not None
    prompt = PromptInfo((*shared, 7))
    assert policy.cached_blocks(slot_a, prompt) == 4
    # What the router sends a reporting engine counts until its next report.
    longer = PromptInfo((*shared, *range(100, 108)))
    policy.routed(slot_b, longer)
    assert policy.cached_blocks(slot_b, longer) == 6
    assert policy.choose(pool.slots(), longer, Stage.PREFILL).engine_id == "b"
    rt.pool.update("b", view("b", PREFILL, load=reported()))  # the next heartbeat: not kept
    assert policy.cached_blocks(slot_b, longer) == 0
    assert policy.choose(pool.slots(), longer, Stage.PREFILL).engine_id == "a"
    # A report that holds only later blocks of the chain matches nothing (chained hashes).
    rt.pool.update("b", view("b", PREFILL, load=reported(hashes[3])))
    assert policy.cached_blocks(slot_b, prompt) == 0


def test_router_and_reference_engine_hash_blocks_alike():
    from services.engines.reference.prefix_cache import block_keys  # noqa: PLC0415

    tokens = list(range(50, 90))
    assert prompt_block_hashes(tokens, 16) == block_keys(tokens, 16, len(tokens))


def test_prefix_aware_gives_up_the_cache_when_that_engine_is_overloaded():
    rt = runtime()
    pool = pool_of(rt, view("a", PREFILL), view("b", PREFILL, load=EngineLoad(queue_depth=10)))
    policy = PrefixAwarePolicy(capacity_blocks=100, load_slack=2)
    prompt = PromptInfo(tuple(range(16)))
    slot_b = pool.get("b")
    assert slot_b is not None
    policy.routed(slot_b, prompt)
    assert policy.choose(pool.slots(), prompt, Stage.PREFILL).engine_id == "a"


def test_prefix_aware_forgets_an_engine_that_restarted():
    rt = runtime()
    pool = pool_of(rt, view("a", PREFILL))
    policy = PrefixAwarePolicy(capacity_blocks=100, load_slack=2)
    prompt = PromptInfo(tuple(range(16)))
    slot = pool.get("a")
    assert slot is not None
    policy.routed(slot, prompt)
    assert policy.cached_blocks(slot, prompt) == 4
    rt.pool.update("a", view("a", PREFILL, generation=2))
    restarted = pool.get("a")
    assert restarted is not None and restarted is not slot
    assert policy.cached_blocks(restarted, prompt) == 0


def test_prefix_aware_drops_the_index_of_an_engine_that_left():
    rt = runtime()
    pool = pool_of(rt, view("a", PREFILL))
    policy = PrefixAwarePolicy(capacity_blocks=100, load_slack=2)
    slot = pool.get("a")
    assert slot is not None
    policy.routed(slot, PromptInfo(tuple(range(16))))
    assert len(policy._index._blocks) == 1
    rt.pool.update("a", None)
    del slot
    gc.collect()
    assert len(policy._index._blocks) == 0


def test_plan_pairs_only_engines_with_the_same_compat_hash_and_block_size():
    rt = runtime()
    pool_of(
        rt,
        view("p-other-hash", PREFILL, compat_hash="h2"),
        view("p-other-block", PREFILL, block_size=16),
        view("p-good", PREFILL),
        view("d", DECODE),
    )
    for _ in range(5):
        plan = rt.scheduler.plan("tiny", PromptInfo(tuple(range(10))))
        assert plan.prefill is not None and plan.prefill.engine_id == "p-good"
        assert plan.decode.engine_id == "d"


def test_plan_without_a_compatible_prefill_engine_is_a_counted_fallback():
    rt = runtime()
    pool_of(rt, view("p", PREFILL, compat_hash="other"), view("d", DECODE))
    assert not rt.scheduler.ready()
    plan = rt.scheduler.plan("tiny", PromptInfo((1, 2, 3)))
    assert plan.prefill is None and plan.local_reason == "no_prefill_engine"
    assert sample(rt, "pdserve_router_fallbacks_total", reason="no_prefill_engine") == 1


def test_plan_refuses_instead_of_falling_back_when_local_fallback_is_off():
    rt = runtime(local_fallback=False)
    pool_of(rt, view("d", DECODE))
    with pytest.raises(NoEngineAvailable):
        rt.scheduler.plan("tiny", PromptInfo((1, 2, 3)))


def test_colocated_engines_serve_locally_without_a_fallback():
    rt = runtime()
    pool_of(rt, view("both", BOTH))
    assert rt.scheduler.ready()
    plan = rt.scheduler.plan("tiny", PromptInfo((1, 2, 3)))
    assert plan.prefill is None and plan.local_reason == "colocated"
    assert sample(rt, "pdserve_router_fallbacks_total", reason="no_prefill_engine") == 0


def test_short_prompts_run_locally_when_configured():
    rt = runtime(local_max_prompt_tokens=4)
    pool_of(rt, view("p", PREFILL), view("d", DECODE))
    assert rt.scheduler.plan("tiny", PromptInfo((1, 2, 3, 4))).local_reason == "short_prompt"
    assert rt.scheduler.plan("tiny", PromptInfo((1, 2, 3, 4, 5))).prefill is not None


def test_mostly_cached_prompts_run_on_the_decode_engine():
    rt = runtime(policy="prefix_aware", local_cached_fraction=0.75)
    pool_of(rt, view("p", PREFILL), view("d", DECODE))
    first = PromptInfo(tuple(range(16)))
    assert rt.scheduler.plan("tiny", first).prefill is not None
    # The next turn repeats the 16 tokens (4 blocks) and adds 4: 4 of 5 blocks cached.
    follow_up = PromptInfo((*range(16), 50, 51, 52, 53))
    plan = rt.scheduler.plan("tiny", follow_up)
    assert plan.prefill is None and plan.local_reason == "cached_prompt"
    unrelated = PromptInfo(tuple(range(100, 120)))
    assert rt.scheduler.plan("tiny", unrelated).prefill is not None


def test_unregistered_and_unready_models_are_told_apart_both_503():
    """The front end lets only the served model through, so neither is a 404 (issue 49)."""
    rt = runtime()
    pool_of(rt, view("p", PREFILL), view("d", DECODE, model="other", state=EngineState.PENDING))
    with pytest.raises(
        NoEngineAvailable,
        match=r"^no engine registered in the control plane serves 'nope' "
        r"\(they serve other, tiny\)$",
    ):
        rt.scheduler.plan("nope", PromptInfo((1,)))
    with pytest.raises(NoEngineAvailable, match=r"^no READY decode engine serves 'other'$"):
        rt.scheduler.plan("other", PromptInfo((1,)))


def test_engines_leave_the_pool_as_soon_as_they_are_not_ready():
    rt = runtime()
    pool_of(rt, view("p", PREFILL), view("d", DECODE))
    assert rt.scheduler.ready()
    rt.pool.update("d", view("d", DECODE, state=EngineState.INVALID))
    assert not rt.scheduler.ready()
    assert [s.engine_id for s in rt.pool.slots()] == ["p"]
    assert sample(rt, "pdserve_router_ready_engines", role="decode") == 0
    assert sample(rt, "pdserve_router_ready_engines", role="prefill") == 1


def test_the_pools_ordered_slots_follow_joins_leaves_and_replacements():
    rt = runtime()
    pool = pool_of(rt, view("p", PREFILL), view("d2", DECODE))
    decode_roles = (DECODE, BOTH)
    assert [s.engine_id for s in pool.slots(decode_roles)] == ["d2"]  # (kept from here on)
    pool_of(rt, view("d1", BOTH))
    assert [s.engine_id for s in pool.slots(decode_roles)] == ["d1", "d2"]
    assert [s.engine_id for s in pool.slots()] == ["d1", "d2", "p"]
    before = pool.slots((PREFILL,))[0]
    pool_of(rt, view("p", PREFILL, generation=2))  # a new record: a new slot
    assert pool.slots((PREFILL,))[0] is not before
    pool.update("d2", None)
    assert [s.engine_id for s in pool.slots(decode_roles)] == ["d1"]


def test_colocated_router_runs_everything_on_decode_engines_and_is_ready_with_one():
    rt = runtime(colocated=True)
    pool_of(rt, view("p", PREFILL), view("d", DECODE))
    assert rt.scheduler.ready()
    plan = rt.scheduler.plan("tiny", PromptInfo(tuple(range(40))))
    assert plan.prefill is None and plan.local_reason == "colocated"
    assert sample(rt, "pdserve_router_fallbacks_total", reason="no_prefill_engine") == 0


def test_plan_does_not_hash_the_prompt_for_a_policy_without_a_prefix_index():
    rt = runtime(policy="round_robin", local_max_prompt_tokens=0)
    pool_of(rt, view("p", PREFILL), view("d", DECODE))
    prompt = PromptInfo(tuple(range(64)))
    plan = rt.scheduler.plan("tiny", prompt)
    assert plan.prefill is not None
    assert prompt._hashes == {}


def test_plan_picks_only_engines_whose_context_holds_the_request():
    rt = runtime()
    pool_of(
        rt,
        view("p-short", PREFILL, max_model_len=64),
        view("p-long", PREFILL, max_model_len=1024),
        view("d-short", DECODE, max_model_len=64),
        view("d-long", DECODE, max_model_len=1024),
    )
    for _ in range(4):
        plan = rt.scheduler.plan("tiny", PromptInfo(tuple(range(10)), context_tokens=200))
        assert plan.prefill is not None and plan.prefill.engine_id == "p-long"
        assert plan.decode.engine_id == "d-long"
    chosen = {
        rt.scheduler.plan("tiny", PromptInfo(tuple(range(10)), context_tokens=20)).decode.engine_id
        for _ in range(4)
    }
    assert "d-short" in chosen  # a request that fits is not kept off the short engines
    with pytest.raises(NoEngineAvailable, match="holds 2000 tokens"):
        rt.scheduler.plan("tiny", PromptInfo(tuple(range(10)), context_tokens=2000))
