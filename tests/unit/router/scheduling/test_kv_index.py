"""The KV-event index: stores, removals by the engine's hashes, clears, generations, bounds,
model/LoRA separation and longest-prefix lookups (no sockets: batches applied directly)."""

from __future__ import annotations

from services.control_plane.wire import EngineRole
from services.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from services.router.scheduling.kv_feed import _SlotSink
from services.router.scheduling.kv_index import KVIndex, block_keys, chain_root
from services.router.scheduling.policies import PromptInfo, prompt_block_hashes
from tests.unit.router.fakes import runtime, sample, view

PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
BS = 4


def stored(hashes, tokens, parent=None, *, lora=None, block_size=BS):
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size, lora)


def batch(*events):
    return EventBatch(0.0, tuple(events))


def evented(engine_id, role=PREFILL, *, generation=1, model="tiny"):
    return view(
        engine_id,
        role,
        generation=generation,
        model=model,
        kv_events_endpoint="tcp://127.0.0.1:1",
        kv_events_replay_endpoint="tcp://127.0.0.1:2",
    )


def rt_with(*views, **settings):
    rt = runtime(policy="prefix_aware", **settings)
    for v in views:
        rt.pool.update(v.engine_id, v)
    assert rt.kv_events is not None
    return rt, rt.kv_events.index


def keys(tokens, model="tiny", lora=None):
    return PromptInfo(tuple(tokens), lora_name=lora).block_keys(model, BS)


def test_keys_chain_like_the_prompt_hashes_from_a_root_naming_model_and_lora():
    tokens = list(range(12))
    assert block_keys(tokens, BS, 0) == prompt_block_hashes(tokens, BS)
    assert keys(tokens) != keys(tokens, model="other")
    assert keys(tokens) != keys(tokens, lora="adapter")
    assert chain_root("tiny") == chain_root("tiny", None) == chain_root("tiny", "")
    assert len(keys(range(11))) == 2  # full blocks only


def test_stored_blocks_chained_over_events_give_the_longest_prefix():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    # Two events: the second continues the first through the engine's own parent hash.
    index.apply(slot, batch(stored([0xA1, 0xA2], range(8))))
    index.apply(slot, batch(stored([b"\x01" * 32], range(8, 12), parent=0xA2)))
    assert len(index) == 3
    assert index.matched(slot, keys(range(16))) == 3
    assert index.matched(slot, keys([*range(4), 99, 99, 99, 99])) == 1
    assert index.matched(slot, keys(range(100, 112))) == 0


def test_removals_by_engine_hash_end_the_prefix_and_clear_empties_the_engine():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    index.apply(slot, batch(stored([1, 2, 3], range(12))))
    index.apply(slot, batch(BlockRemoved((2, 404))))  # an unknown hash is ignored
    assert index.matched(slot, keys(range(12))) == 1  # block 3 remains, but the prefix ends
    assert len(index) == 2
    index.apply(slot, batch(AllBlocksCleared()))
    assert len(index) == 0
    assert index.matched(slot, keys(range(12))) == 0


def test_a_block_stored_under_two_engine_hashes_stays_until_both_are_removed():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    index.apply(slot, batch(stored([1], range(4)), stored([2], range(4))))
    index.apply(slot, batch(BlockRemoved((1,))))
    assert index.matched(slot, keys(range(4))) == 1
    index.apply(slot, batch(BlockRemoved((2,))))
    assert index.matched(slot, keys(range(4))) == 0


def test_lora_blocks_match_only_prompts_of_that_adapter():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    index.apply(slot, batch(stored([1, 2], range(8), lora="sql")))
    assert index.matched(slot, keys(range(8))) == 0
    assert index.matched(slot, keys(range(8), lora="sql")) == 2


def test_engines_of_other_models_never_share_entries():
    rt, index = rt_with(evented("a", model="m1"), evented("b", model="m2"))
    a, b = rt.pool.get("a"), rt.pool.get("b")
    index.apply(a, batch(stored([1, 2], range(8))))
    index.apply(b, batch(stored([1, 2], range(8))))
    assert index.matched(a, keys(range(8), model="m1")) == 2
    assert index.matched(a, keys(range(8), model="m2")) == 0
    assert index.matched(b, keys(range(8), model="m2")) == 2


def test_unknown_parents_and_other_block_sizes_are_counted_and_skipped():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    index.apply(slot, batch(stored([5], range(4, 8), parent=77)))
    index.apply(slot, batch(stored([6], range(8), block_size=8)))
    assert len(index) == 0
    assert sample(rt, "pdserve_router_kv_events_dropped_total", reason="unknown_parent") == 1
    assert sample(rt, "pdserve_router_kv_events_dropped_total", reason="block_size") == 1


def test_a_new_generation_or_deregistration_drops_the_engines_entries():
    rt, index = rt_with(evented("p"), evented("q"))
    old = rt.pool.get("p")
    index.apply(old, batch(stored([1, 2], range(8))))
    index.apply(rt.pool.get("q"), batch(stored([1], range(4))))
    assert len(index) == 3
    rt.pool.update("p", evented("p", generation=2))
    new = rt.pool.get("p")
    assert new is not old
    assert index.matched(new, keys(range(8))) == 0
    assert not index.tracks(old) and index.tracks(new)
    assert len(index) == 1
    rt.pool.update("q", None)
    assert len(index) == 0


def flood(index, slot, prompts):
    """A hostile engine stores ``prompts`` distinct 4-block prompts."""
    for n in range(prompts):
        tokens = [n * 100 + t for t in range(16)]
        index.apply(slot, batch(stored(range(n * 10, n * 10 + 4), tokens)))


def test_an_engine_cannot_grow_the_index_past_its_own_bound():
    evictions = []
    index = KVIndex(max_blocks_per_engine=8, max_blocks_total=1000, on_evicted=evictions.append)
    rt, _ = rt_with(evented("a"))
    a = rt.pool.get("a")
    index.track(a)
    flood(index, a, 1000)
    assert index.blocks_of(a) == len(index) == 8
    assert evictions == ["engine"] * (4000 - 8)
    # What it still holds is its latest prompts (the oldest entries went first).
    assert index.matched(a, keys([999 * 100 + t for t in range(16)])) == 4
    assert index.matched(a, keys(range(16))) == 0


def test_the_total_bound_takes_from_the_largest_engine_not_the_honest_one():
    evictions = []
    index = KVIndex(max_blocks_per_engine=1000, max_blocks_total=12, on_evicted=evictions.append)
    rt, _ = rt_with(evented("a"), evented("b"))
    a, b = rt.pool.get("a"), rt.pool.get("b")
    index.track(a)
    index.track(b)
    index.apply(b, batch(stored(range(1000, 1006), range(24))))  # 6 blocks of an honest engine
    flood(index, a, 1000)
    assert len(index) == 12
    assert set(evictions) == {"total"}
    assert index.blocks_of(b) == 6
    assert index.matched(b, keys(range(24))) == 6


def test_a_stale_engine_matches_nothing_and_a_lost_stream_drops_its_entries():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    index.apply(slot, batch(stored([1, 2], range(8))))
    index.set_stale(slot, stale=True)
    assert index.matched(slot, keys(range(8))) == 0 and index.stale_count() == 1
    index.set_stale(slot, stale=False)
    assert index.matched(slot, keys(range(8))) == 2
    index.set_stale(slot, stale=True, lost=True)
    index.set_stale(slot, stale=False)
    assert index.matched(slot, keys(range(8))) == 0 and len(index) == 0


def test_the_feed_marks_stale_once_per_episode_logs_once_and_a_lost_stream_drops_entries(caplog):
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    sink = _SlotSink(rt.kv_events, slot)
    sink.apply(0, batch(stored([1, 2], range(8))))
    assert sample(rt, "pdserve_router_kv_index_blocks") == 2
    sink.stale("disconnected", lost=False)
    sink.stale("disconnected", lost=False)  # the same episode: counted once
    assert sample(rt, "pdserve_router_kv_events_stale_total", reason="disconnected") == 1
    assert sample(rt, "pdserve_router_kv_events_stale_engines") == 1
    assert index.blocks_of(slot) == 2 and index.matched(slot, keys(range(8))) == 0
    sink.resumed()
    assert index.matched(slot, keys(range(8))) == 2
    assert sample(rt, "pdserve_router_kv_events_stale_engines") == 0
    sink.stale("gap", lost=True)
    assert index.blocks_of(slot) == 0
    assert sample(rt, "pdserve_router_kv_events_stale_total", reason="gap") == 1
    sink.dropped("malformed")
    assert sample(rt, "pdserve_router_kv_events_dropped_total", reason="malformed") == 1
    warnings = [r for r in caplog.records if "placed by load only" in r.getMessage()]
    assert len(warnings) == 1


# -- parents cached before the subscription (adopted from prompts this router sent) -----------

SYSTEM = list(range(500, 512))
"""A 3-block prefix the engine cached before the router subscribed (no events seen for it)."""


def test_a_parent_cached_before_the_subscription_is_adopted_from_a_prompt_sent_there():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    turn = [*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8]  # the prefix, then two new blocks
    policy = rt.scheduler._policy
    policy.routed(slot, PromptInfo(tuple(turn)))  # what the scheduler calls on sending it
    # The engine stores only the new blocks, chained to its hash of the prefix's last block.
    index.apply(slot, batch(stored([0xB1, 0xB2], turn[12:], parent=0xA3)))
    assert sample(rt, "pdserve_router_kv_parents_adopted_total") == 1
    assert sample(rt, "pdserve_router_kv_events_dropped_total", reason="unknown_parent") == 0
    assert index.matched(slot, keys(turn)) == 5  # the inferred prefix and the stored blocks
    assert len(index) == 5
    # The adopted hash chains later events and its removal applies.
    index.apply(slot, batch(stored([0xC1], [9, 9, 9, 9], parent=0xA3)))
    assert index.matched(slot, keys([*SYSTEM, 9, 9, 9, 9])) == 4
    index.apply(slot, batch(BlockRemoved((0xA3,))))
    assert index.matched(slot, keys(turn)) == 2  # the inferred first two blocks remain


def test_an_inferred_block_gives_way_to_its_hash_and_leaves_with_a_clear():
    rt, index = rt_with(evented("p"))
    slot = rt.pool.get("p")
    turn = [*SYSTEM, 1, 2, 3, 4]
    index.sent(slot, turn, keys(turn))
    index.apply(slot, batch(stored([0xB1], turn[12:], parent=0xA3)))
    assert len(index) == 4  # two inferred, the adopted parent, the stored block
    # The engine stores the prefix again under its hashes (recomputed after an eviction the
    # router could not see): one entry per block, not two.
    index.apply(slot, batch(stored([0xA1, 0xA2], SYSTEM[:8])))
    assert len(index) == 4 and index.matched(slot, keys(turn)) == 4
    index.apply(slot, batch(BlockRemoved((0xA1,))))
    assert index.matched(slot, keys(turn)) == 0
    index.apply(slot, batch(AllBlocksCleared()))
    assert len(index) == 0


def test_only_a_prompt_sent_to_that_engine_for_its_model_and_adapter_is_adopted():
    rt, index = rt_with(evented("p"), evented("q"))
    p, q = rt.pool.get("p"), rt.pool.get("q")
    turn = [*SYSTEM, 1, 2, 3, 4]
    index.sent(q, turn, keys(turn))  # sent to another engine
    index.sent(p, turn, keys(turn, lora="sql"))  # for another adapter
    index.sent(p, turn, keys(turn, model="other"))  # for another model
    index.apply(p, batch(stored([0xB1], turn[12:], parent=0xA3)))
    assert len(index) == 0
    assert sample(rt, "pdserve_router_kv_events_dropped_total", reason="unknown_parent") == 1
    # The same adapter's prompt is found.
    index.apply(p, batch(stored([0xB1], turn[12:], parent=0xA3, lora="sql")))
    assert index.matched(p, keys(turn, lora="sql")) == 4


def test_prompts_past_the_token_bound_are_forgotten():
    index = KVIndex(max_blocks_per_engine=100, max_blocks_total=100, sent_tokens_per_engine=40)
    rt, _ = rt_with(evented("a"))
    a = rt.pool.get("a")
    index.track(a)
    old = [*SYSTEM, 1, 2, 3, 4]
    index.sent(a, old, keys(old))
    for n in range(3):  # 48 tokens more: the oldest prompt goes
        newer = [n] * 16
        index.sent(a, newer, keys(newer))
    index.apply(a, batch(stored([0xB1], old[12:], parent=0xA3)))
    assert len(index) == 0
