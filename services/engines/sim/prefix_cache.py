"""The simulated engine's prefix cache: vLLM's automatic prefix caching, by block counts.

The sim has no KV, so a block here is a key and a reference count, and the scheduler
(:mod:`.scheduler`) keeps counts of the blocks it holds; what is vLLM's
(``vllm/v1/core/kv_cache_manager.py``, ``block_pool.py``):

- a full block of computed tokens is cached under the chained hash of its whole prefix
  (:func:`services.kv_events.keys.block_keys` rooted at 0: the keys the reference engine and the
  router's heartbeat scoring use), as soon as the step that completed it ran;
- a request starting finds the longest cached prefix of its prompt (at most ``len - 1`` tokens:
  the last token is computed for its logits) and holds those blocks, which it does not compute;
- a cached block nobody holds stays cached and counts as free; blocks run short, the least
  recently freed go first (evicted); a request frees its blocks last block first, so a prefix
  under pressure shortens from its tail instead of losing its first block, which would leave the
  rest unreachable;
- a block a second request computed while the first was caching the same prefix stays that
  request's own (not cached twice).

With ``record_events`` it records what changed as KV events (vLLM's shapes,
:mod:`services.kv_events.events`): ``BlockStored`` per run of consecutive blocks cached
(their keys as the engine's hashes, the key before the run as parent, their token ids),
``BlockRemoved`` per eviction; the backend publishes them once per step
(:meth:`SimPrefixCache.take_events`).

Not kept: output tokens' blocks (vLLM caches them too; the sim's tokens are no model's, so
no later prompt holds them), LoRA adapters, multimodal extra keys.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from services.kv_events.events import BlockRemoved, BlockStored, KVEvent
from services.kv_events.keys import BlockKey


class SimPrefixCache:
    """See the module docstring. Sans-IO; not thread-safe (the engine's loop owns it)."""

    def __init__(self, block_size: int, *, record_events: bool = False) -> None:
        self.block_size = block_size
        self._refs: OrderedDict[BlockKey, int] = OrderedDict()
        """Cached key -> holders, least recently used first."""
        self._evictable: OrderedDict[BlockKey, None] = OrderedDict()
        """Cached keys nobody holds, least recently freed first."""
        self._record = record_events
        self._events: list[KVEvent] = []
        self.queries = 0
        self.hit_blocks = 0
        self.evicted = 0

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def evictable(self) -> int:
        """Cached blocks nobody holds: they count as free."""
        return len(self._evictable)

    def peek(self, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """How many leading ``keys`` are cached, and how many of those nobody holds (taking
        them makes them no longer free). Changes nothing."""
        hits = idle = 0
        for key in keys:
            refs = self._refs.get(key)
            if refs is None:
                break
            hits += 1
            idle += refs == 0
        return hits, idle

    def acquire(self, keys: Sequence[BlockKey]) -> None:
        """Hold every one of ``keys`` (a prefix :meth:`peek` found cached)."""
        self.queries += 1
        self.hit_blocks += len(keys)
        for key in keys:
            if self._refs[key] == 0:
                del self._evictable[key]
            self._refs[key] += 1
            self._refs.move_to_end(key)

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop one hold on each of ``keys``, last first (the tail becomes evictable first)."""
        for key in reversed(keys):
            refs = self._refs[key] - 1
            self._refs[key] = refs
            if refs == 0:
                self._evictable[key] = None

    def evict(self, count: int) -> int:
        """Evict up to ``count`` blocks nobody holds, least recently freed first; how many."""
        victims = list(itertools.islice(self._evictable, count))
        for key in victims:
            del self._evictable[key]
            del self._refs[key]
        if victims:
            self.evicted += len(victims)
            if self._record:
                self._events.append(BlockRemoved(tuple(victims)))
        return len(victims)

    def store(
        self, tokens: Sequence[int], keys: Sequence[BlockKey], first: int, end: int
    ) -> list[BlockKey]:
        """Blocks ``first .. end - 1`` of ``tokens`` (keyed ``keys``) were computed by their
        holder: cache each one not cached yet, held once by it. Returns the keys it now holds
        through the cache (a block already cached stays the holder's own)."""
        held: list[BlockKey] = []
        run_start = None
        for index in range(first, end):
            key = keys[index]
            if key in self._refs:
                self._stored(tokens, keys, run_start, index)
                run_start = None
                continue
            self._refs[key] = 1
            held.append(key)
            if run_start is None:
                run_start = index
        self._stored(tokens, keys, run_start, end)
        return held

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order."""
        events, self._events = self._events, []
        return events

    def recent_keys(self, limit: int) -> tuple[BlockKey, ...]:
        """At most ``limit`` cached keys, most recently used first (``EngineLoad``'s report)."""
        return tuple(itertools.islice(reversed(self._refs), limit))

    def _stored(
        self, tokens: Sequence[int], keys: Sequence[BlockKey], first: int | None, end: int
    ) -> None:
        if first is None or not self._record:
            return
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(keys[first:end]),
                parent_block_hash=keys[first - 1] if first > 0 else None,
                token_ids=tuple(tokens[first * size : end * size]),
                block_size=size,
            )
        )
