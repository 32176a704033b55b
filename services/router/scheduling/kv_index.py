"""What each engine's KV cache holds, from the engine's own KV events (``services.kv_events``).

Keys are pdserve's, not the engine's: a block's key chains the key of the block before it with
its token ids (:func:`block_keys`, the chaining of
:func:`~services.router.scheduling.policies.prompt_block_hashes`), rooted in the model and LoRA
adapter (:func:`chain_root`), so the router computes a prompt's keys from its token ids alone
and two engines' blocks of one prefix have one key (vLLM's own hashes depend on its seed and
hash algorithm). Each engine's ``BlockStored`` carries the engine's hashes: the index maps them
to keys, to apply ``BlockRemoved`` and to chain a stored block to its parent.

Per :class:`EngineSlot` (one engine generation: a restarted engine starts empty). Bounded: at
most ``max_blocks_per_engine`` blocks per engine and ``max_blocks_total`` in all; past a bound
the engine's oldest entries are forgotten (the engine with the most entries, for the total),
counted. Forgetting only under-reports a cache, so a hostile engine can cost its own placement
quality, never the router's memory or another engine's entries below the fair share.

An engine is *stale* while its event stream is incomplete (``services.kv_events.subscriber``):
:meth:`KVIndex.matched` answers 0 for it (placement by load only) until the stream resumes.
Synchronous, on the event loop; no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
)
from services.router.scheduling.pool import EngineSlot

BlockKey = int
"""pdserve's key of a block: its whole prefix's token ids, chained (:func:`block_keys`)."""


def chain_root(model: str, lora_name: str | None = None) -> BlockKey:
    """The key the first block chains on: the model and the LoRA adapter (a stable digest,
    not Python's ``hash`` of a string, which differs per process)."""
    digest = hashlib.blake2b(f"{model}\0{lora_name or ''}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def chain(previous: BlockKey, block: Sequence[int]) -> BlockKey:
    """The key of ``block`` after the block keyed ``previous``. Python's hash of a tuple of
    ints is the same in every process."""
    return hash((previous, tuple(block)))


def block_keys(token_ids: Sequence[int], block_size: int, root: BlockKey) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids``: key ``i`` covers ``[0, (i + 1) * block_size)``."""
    keys: list[BlockKey] = []
    previous = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = chain(previous, token_ids[start : start + block_size])
        keys.append(previous)
    return keys


@dataclass
class _EngineBlocks:
    """One engine's blocks: its hashes (oldest first) to keys, and how many hashes hold each
    key (an engine may hold one prefix under two hashes, e.g. with a cache salt)."""

    model: str
    block_size: int
    by_hash: OrderedDict[EngineBlockHash, BlockKey] = field(default_factory=OrderedDict)
    keys: dict[BlockKey, int] = field(default_factory=dict)
    stale: bool = False

    def remove(self, engine_hash: EngineBlockHash) -> None:
        key = self.by_hash.pop(engine_hash, None)
        if key is not None:
            self._unref(key)

    def pop_oldest(self) -> None:
        _, key = self.by_hash.popitem(last=False)
        self._unref(key)

    def _unref(self, key: BlockKey) -> None:
        count = self.keys[key] - 1
        if count:
            self.keys[key] = count
        else:
            del self.keys[key]

    def clear(self) -> None:
        self.by_hash.clear()
        self.keys.clear()


IndexCounter = Callable[[str], None]
"""Counts one thing by reason (a metric's ``labels(reason).inc``)."""


class KVIndex:
    """Per engine slot, the blocks its events say it holds; see the module docstring."""

    def __init__(
        self,
        *,
        max_blocks_per_engine: int,
        max_blocks_total: int,
        on_evicted: IndexCounter | None = None,
        on_dropped: IndexCounter | None = None,
    ) -> None:
        self._per_engine = max_blocks_per_engine
        self._total_bound = max_blocks_total
        self._engines: dict[EngineSlot, _EngineBlocks] = {}
        self._total = 0
        self._on_evicted = on_evicted or (lambda bound: None)
        self._on_dropped = on_dropped or (lambda reason: None)

    # -- engines --------------------------------------------------------------------------------

    def track(self, slot: EngineSlot) -> None:
        """Start an empty entry for ``slot`` (its events are followed from now on)."""
        if slot not in self._engines:
            self._engines[slot] = _EngineBlocks(slot.record.model, slot.record.block_size)

    def forget(self, slot: EngineSlot) -> None:
        """Drop ``slot`` and its entries (it left the pool or was replaced by a new
        generation)."""
        blocks = self._engines.pop(slot, None)
        if blocks is not None:
            self._total -= len(blocks.by_hash)

    def tracks(self, slot: EngineSlot) -> bool:
        """Whether ``slot``'s events are followed (and it is not stale): its answers count."""
        blocks = self._engines.get(slot)
        return blocks is not None and not blocks.stale

    def set_stale(self, slot: EngineSlot, *, stale: bool, lost: bool = False) -> None:
        """Mark the engine stale or fresh; ``lost`` also drops its entries (missed events may
        have removed any of them)."""
        blocks = self._engines.get(slot)
        if blocks is None:
            return
        blocks.stale = stale
        if lost:
            self._total -= len(blocks.by_hash)
            blocks.clear()

    def stale_count(self) -> int:
        return sum(1 for blocks in self._engines.values() if blocks.stale)

    def __len__(self) -> int:
        """Blocks indexed, all engines together."""
        return self._total

    def blocks_of(self, slot: EngineSlot) -> int:
        blocks = self._engines.get(slot)
        return 0 if blocks is None else len(blocks.by_hash)

    # -- events ---------------------------------------------------------------------------------

    def apply(self, slot: EngineSlot, batch: EventBatch) -> None:
        """Apply one batch of ``slot``'s events, in order. Events that cannot be applied
        (a parent the index does not hold, another block size) are counted and skipped."""
        blocks = self._engines.get(slot)
        if blocks is None:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(blocks, event)
            elif isinstance(event, BlockRemoved):
                before = len(blocks.by_hash)
                for engine_hash in event.block_hashes:
                    blocks.remove(engine_hash)
                self._total -= before - len(blocks.by_hash)
            elif isinstance(event, AllBlocksCleared):
                self._total -= len(blocks.by_hash)
                blocks.clear()

    def _stored(self, blocks: _EngineBlocks, event: BlockStored) -> None:
        if event.block_size != blocks.block_size:
            self._on_dropped("block_size")
            return
        if event.parent_block_hash is None:
            previous = chain_root(blocks.model, event.lora_name)
        else:
            parent = blocks.by_hash.get(event.parent_block_hash)
            if parent is None:
                self._on_dropped("unknown_parent")
                return
            previous = parent
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            previous = chain(previous, event.token_ids[i * size : (i + 1) * size])
            old = blocks.by_hash.get(engine_hash)
            if old is not None:  # stored again: refresh its age (and key, if it changed)
                blocks.by_hash.move_to_end(engine_hash)
                if old == previous:
                    continue
                blocks.remove(engine_hash)
                self._total -= 1
            blocks.by_hash[engine_hash] = previous
            blocks.keys[previous] = blocks.keys.get(previous, 0) + 1
            self._total += 1
            if len(blocks.by_hash) > self._per_engine:
                blocks.pop_oldest()
                self._total -= 1
                self._on_evicted("engine")
            if self._total > self._total_bound:
                self._evict_largest()

    def _evict_largest(self) -> None:
        largest = max(self._engines.values(), key=lambda b: len(b.by_hash))
        largest.pop_oldest()
        self._total -= 1
        self._on_evicted("total")

    # -- lookups --------------------------------------------------------------------------------

    def matched(self, slot: EngineSlot, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the engine holds: the longest cached prefix in blocks
        (an earlier block it no longer holds ends the prefix, though later ones may remain).
        0 for an engine not tracked or stale."""
        blocks = self._engines.get(slot)
        if blocks is None or blocks.stale:
            return 0
        held = blocks.keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count
