"""The reference engine's prefix cache records vLLM-shaped KV events: BlockStored for the full
blocks that enter (chained keys, parent, token ids), BlockRemoved for evictions,
AllBlocksCleared on a reset; the scheduler's requests drive it as the engine loop would."""

from __future__ import annotations

from services.engines.reference.prefix_cache import PrefixCache, block_keys
from services.engines.requests import SamplingParams
from services.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from services.kv_transfer.allocator import BlockAllocator
from tests.unit.engines.test_reference_scheduler import ListSink, make, run_to_end

SIZE = 4


def cache(blocks: int = 8) -> PrefixCache:
    return PrefixCache(BlockAllocator(blocks), SIZE, record_events=True)


def test_full_blocks_entering_are_one_block_stored_with_chained_keys() -> None:
    prefix = cache()
    prompt = list(range(10))  # two full blocks and 2 tokens
    blocks = prefix.allocate(3)
    prefix.insert(prompt, blocks)
    keys = block_keys(prompt, SIZE, len(prompt))
    assert prefix.take_events() == [BlockStored(tuple(keys), None, tuple(range(8)), SIZE)]
    assert prefix.take_events() == []  # taken once
    # A longer prompt over the same prefix stores only its new block, child of the last one.
    longer = [*prompt, 10, 11, 12]
    more = prefix.match(longer) + prefix.allocate(2)
    prefix.insert(longer, more)
    new_keys = block_keys(longer, SIZE, len(longer))
    assert new_keys[:2] == keys
    assert prefix.take_events() == [BlockStored((new_keys[2],), keys[1], (8, 9, 10, 11), SIZE)]
    assert set(prefix.recent_keys(10)) == set(new_keys)  # the keys heartbeats report


def test_evicted_blocks_are_block_removed_by_their_keys() -> None:
    prefix = cache(blocks=3)
    prompt = list(range(8))
    blocks = prefix.allocate(2)
    prefix.insert(prompt, blocks)
    prefix._allocator.free(blocks)  # the request ended: only the cache holds them
    keys = block_keys(prompt, SIZE, len(prompt))
    prefix.take_events()
    prefix.allocate(3)  # one free block: the two least recently used cached ones go
    assert prefix.take_events() == [BlockRemoved(tuple(reversed(keys)))]  # the tail first
    assert prefix.num_cached == 0


def test_pressure_shortens_a_cached_prefix_from_its_end() -> None:
    """As vLLM evicts a request's tail blocks first: what is left of a prefix under pressure
    is still a hit. Evicting its first block instead would leave every other block cached
    and unreachable (a hit needs each block before it)."""
    prefix = cache(blocks=6)
    prompt = list(range(17))  # four full blocks
    blocks = prefix.allocate(4)
    prefix.insert(prompt, blocks)
    prefix._allocator.free(blocks)
    keys = block_keys(prompt, SIZE, len(prompt))
    prefix.take_events()
    other = prefix.allocate(3)  # two free blocks: one cached block goes, the last
    assert prefix.take_events() == [BlockRemoved((keys[3],))]
    hit = prefix.match(prompt)
    assert hit == blocks[:3]
    prefix._allocator.free([*hit, *other])
    # A hit refreshes the prefix head first as well: the next eviction again takes its tail.
    prefix.allocate(6)
    assert prefix.take_events() == [BlockRemoved((keys[2], keys[1], keys[0]))]


def test_reset_clears_everything_only_when_no_request_uses_a_cached_block() -> None:
    prefix = cache()
    blocks = prefix.allocate(1)
    prefix.insert(list(range(5)), blocks)
    prefix.take_events()
    assert not prefix.reset()  # the request still holds its block
    assert prefix.take_events() == [] and prefix.num_cached == 1
    prefix._allocator.free(blocks)
    assert prefix.reset()
    assert prefix.take_events() == [AllBlocksCleared()] and prefix.num_cached == 0


def test_without_record_events_nothing_is_recorded() -> None:
    prefix = PrefixCache(BlockAllocator(4), SIZE)
    prefix.insert(list(range(5)), prefix.allocate(1))
    assert prefix.take_events() == []


def test_the_scheduler_records_a_requests_prompt_blocks_once_they_are_computed() -> None:
    scheduler = make(prefix_caching=True, record_kv_events=True, max_batch_tokens=64)
    prompt = list(range(20, 30))
    sink = ListSink()
    scheduler.submit("a", "generate", prompt, SamplingParams(max_tokens=2), sink)
    run_to_end(scheduler, sink)
    assert scheduler.blocks.prefix_cache is not None
    events = scheduler.blocks.prefix_cache.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].token_ids == tuple(prompt[:8])  # type: ignore[union-attr]
