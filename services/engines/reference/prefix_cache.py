"""The reference engine's prefix cache: full prompt blocks reused across requests.

A block is keyed by the chained hash of the tokens up to its end (block ``i``'s key covers
tokens ``0 .. (i + 1) * block_size``: :mod:`services.kv_events.keys`, the router's keys), so a
hit on block ``i`` implies the whole prefix matches.
Only full blocks of a prompt are cached, once the prompt's KV has been computed (or pulled): a
cached block is never written again (a request writes its new tokens after its prompt, into
its own blocks). The cache holds one reference on every cached block (in the scheduler's
:class:`~services.kv_transfer.allocator.BlockAllocator`); a cached block no request uses is
*evictable*: it counts as free and is evicted least recently used first when blocks run out.
Within one prompt the tail is older than the head (as vLLM frees a request's blocks in reverse
order, so that its tail blocks are evicted first): every use of a prompt's blocks (a match, an
insert) refreshes them last block first, so a cache under pressure shortens a cached prefix
from its end instead of breaking it at its first block, which would leave the rest unreachable
(a hit needs every block before it).

At most ``len(prompt) - 1`` tokens are served from the cache: the last prompt token is always
computed, because its logits give the first token. Requests that want prompt logprobs bypass
the cache (as in vLLM): their logits are needed at every prompt position.

With ``record_events`` the cache records what changed as KV events
(:mod:`services.kv_events`, vLLM's shapes), which the engine loop takes after every step
(:meth:`PrefixCache.take_events`) and publishes as one batch: :class:`BlockStored` when full
blocks enter (one event per run of consecutive blocks: their chained keys, the key of the block
before the run as parent, their token ids), :class:`BlockRemoved` when blocks are evicted,
:class:`AllBlocksCleared` on :meth:`PrefixCache.reset`. The block hashes are the cache's own
keys, the values ``EngineLoad.cached_block_hashes`` reports.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from services.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.kv_events.keys import block_keys as prefix_keys
from services.kv_transfer.allocator import BlockAllocator


def block_keys(tokens: Sequence[int], block_size: int, limit: int) -> list[int]:
    """Chained keys of the full blocks among ``tokens[:limit]``: pdserve's block keys
    (:func:`services.kv_events.keys.block_keys`, rooted at 0, one model)."""
    return prefix_keys(tokens[:limit], block_size, 0)


class PrefixCache:
    """See the module docstring. Not thread-safe (the scheduler's thread owns it)."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, *, record_events: bool = False
    ) -> None:
        self._allocator = allocator
        self._block_size = block_size
        self._blocks: dict[int, int] = {}
        """Key -> block."""
        self._keys: OrderedDict[int, int] = OrderedDict()
        """Block -> key, least recently used first."""
        self.hits = 0
        self.queries = 0
        self.version = 0
        """Changes whenever the cached set or its recency order changes."""
        self._record = record_events
        self._events: list[KVEvent] = []

    @property
    def num_cached(self) -> int:
        return len(self._keys)

    def evictable(self) -> int:
        """Cached blocks that only the cache holds (they count as free)."""
        return sum(1 for block in self._keys if self._allocator.refcount(block) == 1)

    def free_count(self) -> int:
        """Blocks an allocation may use: free ones plus evictable cached ones."""
        return self._allocator.free_count + self.evictable()

    def match(self, prompt: Sequence[int]) -> list[int]:
        """The cached blocks of ``prompt``'s longest cached prefix (at most ``len - 1``
        tokens), each with one more reference for the caller (who frees them like its own)."""
        self.queries += 1
        found = self._leading_blocks(block_keys(prompt, self._block_size, len(prompt) - 1))
        if found:
            self.hits += 1
            self._allocator.incref(found)
            self._refresh(found)
        return found

    def _leading_blocks(self, keys: Sequence[int]) -> list[int]:
        """The cached blocks of ``keys`` up to the first one not cached."""
        found: list[int] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def _refresh(self, blocks: Sequence[int]) -> None:
        """Most recently used now, the first block most of all (see the module docstring)."""
        for block in reversed(blocks):
            self._keys.move_to_end(block)
        self.version += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with one owner each, evicting least recently used cached blocks
        that nobody uses when the free list is short. Raises ``PoolExhaustedError``."""
        short = count - self._allocator.free_count
        if short > 0:
            victims = [b for b in self._keys if self._allocator.refcount(b) == 1][:short]
            evicted = [self._keys.pop(block) for block in victims]
            for key in evicted:
                del self._blocks[key]
            if victims:
                self.version += 1
                self._allocator.free(victims)
                if self._record:
                    self._events.append(BlockRemoved(tuple(evicted)))
        return list(self._allocator.allocate(count))

    def insert(self, prompt: Sequence[int], block_ids: Sequence[int]) -> None:
        """Cache ``prompt``'s full blocks (their KV is computed), unless already cached."""
        keys = block_keys(prompt, self._block_size, len(prompt))
        added: list[int] = []
        run: list[int] = []  # indexes of the blocks added since the last skipped one
        for index, (key, block) in enumerate(zip(keys, block_ids, strict=False)):
            if key in self._blocks or block in self._keys:
                self._stored(prompt, keys, run)
                run = []
                continue
            self._blocks[key] = block
            self._keys[block] = key
            added.append(block)
            run.append(index)
        self._stored(prompt, keys, run)
        if added:
            self._allocator.incref(added)
        cached = self._leading_blocks(keys)
        if cached:
            self._refresh(cached)

    def reset(self) -> bool:
        """Drop every cached block (vLLM's ``reset_prefix_cache``); ``False``, and nothing
        dropped, while a request still uses one of them."""
        if any(self._allocator.refcount(block) > 1 for block in self._keys):
            return False
        blocks = list(self._keys)
        self._keys.clear()
        self._blocks.clear()
        if blocks:
            self._allocator.free(blocks)
        self.version += 1
        if self._record:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (empty without
        ``record_events``)."""
        events, self._events = self._events, []
        return events

    def _stored(self, prompt: Sequence[int], keys: Sequence[int], run: Sequence[int]) -> None:
        if not run or not self._record:
            return
        size = self._block_size
        first, end = run[0], run[-1] + 1
        self._events.append(
            BlockStored(
                block_hashes=tuple(keys[first:end]),
                parent_block_hash=keys[first - 1] if first > 0 else None,
                token_ids=tuple(prompt[first * size : end * size]),
                block_size=size,
            )
        )

    def recent_keys(self, limit: int) -> tuple[int, ...]:
        """The keys of at most ``limit`` cached blocks, most recently used first (what the
        engine reports to routers: ``EngineLoad.cached_block_hashes``)."""
        return tuple(itertools.islice(reversed(self._keys.values()), limit))
