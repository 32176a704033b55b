"""The simulated engine's prefix cache (vLLM's, by block counts): a shared prefix is found and
not computed (nor charged), full prompt blocks are cached as computed and published as vLLM's
KV events, eviction is least recently freed first (a prefix's tail first) within the engine's
blocks, and a decode engine caches the prompt it holds, so only what it lacks moves."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from services.bench.routing_oracle import EngineCache
from services.control_plane.wire import EngineRole
from services.engines.requests import (
    DecodeRequest,
    KVHandle,
    PrefillRequest,
    SamplingParams,
    TokenDelta,
)
from services.engines.sim import SimBackend, SimOptions
from services.engines.sim.prefix_cache import SimPrefixCache
from services.engines.sim.scheduler import SimScheduler, SimSequence
from services.kv_events.events import BlockRemoved, BlockStored
from services.kv_events.keys import block_keys
from services.kv_events.subscriber import EventSubscriber
from tests.unit.engines.test_sim_scheduler import _profile

BLOCK = 16


def _scheduler(blocks: int = 100) -> tuple[SimScheduler, SimPrefixCache]:
    cache = SimPrefixCache(BLOCK, record_events=True)
    scheduler = SimScheduler(
        _profile(budget=1000), num_blocks=blocks, block_size=BLOCK, prefix_cache=cache
    )
    return scheduler, cache


def _local(request_id: str, prompt: list[int], max_new: int = 1) -> SimSequence:
    return SimSequence(request_id, len(prompt), max_new_tokens=max_new, prompt=tuple(prompt))


def _run(scheduler: SimScheduler) -> list[tuple[dict[str, tuple[int, int]], float]]:
    """Every step until idle: per request (tokens computed, computed before), duration."""
    steps = []
    while not (plan := scheduler.schedule()).empty:
        scheduler.commit(plan)
        chunks = {c.sequence.request_id: (c.num_tokens, c.computed_before) for c in plan.chunks}
        steps.append((chunks, plan.duration_ms))
    return steps


def test_a_shared_prefix_is_found_cached_and_only_the_rest_is_computed_and_charged() -> None:
    scheduler, cache = _scheduler()
    first = list(range(100))  # six full blocks and four tokens
    keys = block_keys(first, BLOCK, 0)
    a = _local("a", first)
    scheduler.add(a)
    _run(scheduler)
    assert a.cached_tokens == 0
    assert cache.take_events() == [BlockStored(tuple(keys), None, tuple(range(96)), BLOCK)]
    # Six blocks shared, then a new block and a few tokens.
    second = [*range(96), *range(500, 520)]
    b = _local("b", second)
    scheduler.add(b)
    ((chunks, duration),) = _run(scheduler)
    assert b.cached_tokens == 96
    assert chunks == {"b": (20, 96)}  # only the rest, over the cached prefix as context
    assert duration == pytest.approx(scheduler.profile.step_ms(prefill_chunks=[(96, 20)]))
    new_key = block_keys(second, BLOCK, 0)[6]
    assert cache.take_events() == [BlockStored((new_key,), keys[5], tuple(second[96:112]), BLOCK)]
    # A prompt of exactly six cached blocks finds five: its last token is computed.
    c = _local("c", list(range(96)))
    scheduler.add(c)
    _run(scheduler)
    assert c.cached_tokens == 80
    # Nothing held: every block is free or cached.
    assert scheduler.free_blocks + cache.num_cached == scheduler.num_blocks
    assert scheduler.available_blocks == scheduler.num_blocks


def test_eviction_takes_the_least_recently_freed_blocks_a_prefix_tail_first() -> None:
    scheduler, cache = _scheduler(blocks=10)
    prompt = list(range(64))  # four full blocks
    keys = block_keys(prompt, BLOCK, 0)
    scheduler.add(_local("a", prompt))
    _run(scheduler)
    assert cache.num_cached == 4 and scheduler.free_blocks == 6
    cache.take_events()
    # 100 other tokens need seven blocks: one cached block goes, the prefix's tail.
    scheduler.add(_local("b", list(range(1000, 1100))))
    _run(scheduler)
    assert cache.take_events()[0] == BlockRemoved((keys[3],))
    assert cache.evicted == 1
    # What is left of the prefix is still a hit; the capacity is never exceeded.
    again = _local("c", prompt)
    scheduler.add(again)
    _run(scheduler)
    assert again.cached_tokens == 48
    assert scheduler.free_blocks + cache.num_cached == scheduler.num_blocks


def test_a_prefix_two_running_requests_compute_is_cached_once() -> None:
    scheduler, cache = _scheduler()
    prompt = list(range(40))  # two full blocks
    scheduler.add(_local("a", prompt, max_new=3))
    scheduler.add(_local("b", prompt, max_new=3))
    _run(scheduler)
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    assert cache.num_cached == 2
    assert scheduler.free_blocks + cache.num_cached == scheduler.num_blocks


def test_a_sequence_whose_kv_arrived_caches_its_whole_prompt_at_admission() -> None:
    scheduler, cache = _scheduler()
    prompt = list(range(50))  # three full blocks
    pulled = SimSequence("d", 50, max_new_tokens=2, generated=1, computed=50, prompt=tuple(prompt))
    assert scheduler.cached_prefix_tokens(pulled) == 0
    scheduler.add(pulled)
    scheduler.schedule()
    assert cache.num_cached == 3  # before its first decode step ran
    assert scheduler.cached_prefix_tokens(_local("e", prompt)) == 48
    _run(scheduler)
    local = _local("f", prompt)
    scheduler.add(local)
    _run(scheduler)
    assert local.cached_tokens == 48  # a local run on this engine finds it


def _backend(**options: object) -> SimBackend:
    return SimBackend(SimOptions(time_scale=0.0, **options), registry=CollectorRegistry())  # type: ignore[arg-type]


async def _decode(backend: SimBackend, request: DecodeRequest) -> list[TokenDelta]:
    return [delta async for delta in backend.decode(request)]


async def test_usage_reports_cached_tokens_and_the_engine_reports_its_blocks() -> None:
    backend = _backend()
    prompt = tuple(range(1, 101))
    first = await backend.prefill(PrefillRequest("p1", prompt, SamplingParams(max_tokens=1)))
    assert first.usage.cached_tokens == 0 and first.usage.cache_write_tokens == 96
    again = await backend.prefill(PrefillRequest("p2", prompt, SamplingParams(max_tokens=1)))
    assert again.usage.cached_tokens == 96 and again.usage.cache_write_tokens == 0
    assert again.prefill_s < first.prefill_s  # four tokens computed, not a hundred
    local = await _decode(backend, DecodeRequest("d1", prompt, SamplingParams(max_tokens=3)))
    assert local[0].cached_tokens == 96  # from the first chunk, as vLLM's front end needs
    assert local[-1].usage is not None and local[-1].usage.cached_tokens == 96
    load = backend.load()
    assert load.prefix_cache_reported
    assert set(block_keys(prompt, BLOCK, 0)) <= set(load.cached_block_hashes)
    assert load.kv_blocks_free == load.kv_blocks_total  # cached blocks nobody holds are free
    off = _backend(prefix_caching=False)
    again = await off.prefill(PrefillRequest("p3", prompt, SamplingParams(max_tokens=1)))
    assert again.usage.cached_tokens == 0 and not off.load().prefix_cache_reported
    await backend.stop()
    await off.stop()


def _pulled(request_id: str, prompt: tuple[int, ...]) -> DecodeRequest:
    handle = KVHandle("sim-prefill", 1, request_id, (0,), len(prompt), lease_expires_at_s=0.0)
    return DecodeRequest(request_id, prompt, SamplingParams(max_tokens=2), handle, first_token_id=7)


async def test_a_decode_engine_moves_only_what_its_cache_lacks() -> None:
    backend = _backend()
    profile = backend.options.profile
    prompt = tuple(range(1, 1001))
    first = await _decode(backend, _pulled("r1", prompt))
    assert first[0].kv_transfer_s == pytest.approx(profile.transfer_ms(1000) / 1000)
    # The same prompt grown by a turn: the 992 tokens of its 62 full blocks are here.
    longer = (*prompt, *range(2000, 2100))
    second = await _decode(backend, _pulled("r2", longer))
    assert second[0].kv_transfer_s == pytest.approx(profile.transfer_ms(1100 - 992) / 1000)
    moved = sum(
        sample.value
        for family in backend.transfer_metrics.registry.collect()
        if family.name == "pdserve_kv_transfer_bytes"
        for sample in family.samples
        if sample.name == "pdserve_kv_transfer_bytes_total"
        and sample.labels["producer_engine"] == "sim-prefill"
    )
    assert moved == (1000 + 108) * profile.kv_bytes_per_token
    await backend.stop()


async def test_kv_events_go_out_on_vllms_wire_protocol_to_a_subscriber() -> None:
    """The router's reader (the subscriber and the decoding the router uses) follows a sim
    engine: after one request, it holds the prompt's blocks by pdserve's keys."""
    backend = _backend()
    description = backend.describe()
    assert description.kv_events_endpoint and description.kv_events_replay_endpoint
    follower = EngineCache("sim", EngineRole.DECODE, BLOCK)
    port = description.kv_events_endpoint.rpartition(":")[2]
    replay_port = description.kv_events_replay_endpoint.rpartition(":")[2]
    subscriber = EventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", follower
    )
    subscriber.start()
    try:
        prompt = tuple(range(1, 81))  # five full blocks
        await _decode(backend, DecodeRequest("e1", prompt, SamplingParams(max_tokens=2)))
        keys = block_keys(prompt, BLOCK, 0)
        for _ in range(1000):  # up to 20 s on a loaded machine
            if follower.matched(keys) == 5:
                break
            await asyncio.sleep(0.02)
        assert follower.matched(keys) == 5, follower.problems
        # (a batch both replayed and received live is dropped once as a duplicate: normal)
        assert set(follower.problems) <= {"dropped:duplicate"}, follower.problems
        assert backend.load().kv_events_seq >= 0
    finally:
        await subscriber.close()
        await backend.stop()
