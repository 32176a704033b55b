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

**Parents cached before the subscription.** An engine announces a block once, when it caches
it; a router that subscribes later (restarted, a new replica or worker, a stream lost past the
publisher's replay) never sees the blocks of prefixes cached before, so a new block that extends
one names a parent the index does not know. The prompt that made the engine store that block is
one this router just sent it: :meth:`KVIndex.sent` keeps each engine's recent prompts (token ids
and keys, bounded in tokens), and a stored block whose parent is unknown is looked up there by its
tokens. Found at block ``j`` of a prompt, the parent is that prompt's key ``j - 1`` (the engine's
hash is mapped to it, so later events chain and its removal applies) and the engine holds the
prompt's blocks before it, entered as *inferred* (no engine hash: an inferred block leaves only
when the engine stores it again under a hash, clears its cache, or a bound forgets it; an engine
that evicted it meanwhile is over-reported until then). Counted as adopted; a block found in no
recent prompt is dropped as ``unknown_parent``, as before.

An engine is *stale* while its event stream is incomplete (``services.kv_events.subscriber``):
:meth:`KVIndex.matched` answers 0 for it (placement by load only) until the stream resumes.
Synchronous, on the event loop; no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from services.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
)
from services.kv_events.keys import BlockKey, block_keys, chain, chain_root
from services.router.scheduling.pool import EngineSlot

__all__ = ["BlockKey", "KVIndex", "block_keys", "chain", "chain_root"]


class _Inferred(NamedTuple):
    """The stand-in hash of a block inferred held (an ancestor of an adopted parent): never
    equal to an engine's hash, which is an int or bytes."""

    key: BlockKey


_Hash = EngineBlockHash | _Inferred


@dataclass(frozen=True)
class _SentPrompt:
    """A prompt this router sent an engine: its token ids and its keys at the engine's block
    size (for the engine's model and the request's LoRA adapter)."""

    token_ids: Sequence[int]
    keys: Sequence[BlockKey]


@dataclass
class _EngineBlocks:
    """One engine's blocks: its hashes (oldest first) to keys, and how many hashes hold each
    key (an engine may hold one prefix under two hashes, e.g. with a cache salt); and the
    prompts recently sent to it (newest last, at most ``sent_token_bound`` tokens in all)."""

    model: str
    block_size: int
    by_hash: OrderedDict[_Hash, BlockKey] = field(default_factory=OrderedDict)
    keys: dict[BlockKey, int] = field(default_factory=dict)
    stale: bool = False
    sent: deque[_SentPrompt] = field(default_factory=deque)
    sent_tokens: int = 0

    def remove(self, engine_hash: _Hash) -> None:
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
        on_adopted: Callable[[], None] | None = None,
        sent_tokens_per_engine: int = 32_768,
    ) -> None:
        self._per_engine = max_blocks_per_engine
        self._total_bound = max_blocks_total
        self._sent_bound = sent_tokens_per_engine
        self._engines: dict[EngineSlot, _EngineBlocks] = {}
        self._total = 0
        self._on_evicted = on_evicted or (lambda bound: None)
        self._on_dropped = on_dropped or (lambda reason: None)
        self._on_adopted = on_adopted or (lambda: None)

    # -- engines --------------------------------------------------------------------------------

    def track(self, slot: EngineSlot) -> None:
        """Start an empty entry for ``slot`` (its events are followed from now on)."""
        if slot not in self._engines:
            self._engines[slot] = _EngineBlocks(slot.record.model, slot.record.shape.block_size)

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

    def sent(self, slot: EngineSlot, token_ids: Sequence[int], keys: Sequence[BlockKey]) -> None:
        """This router sent ``slot`` a prompt whose full blocks have ``keys`` (at the engine's
        block size): kept, newest last, to adopt the parents its events name (module
        docstring). O(1); the oldest prompts go past the bound in tokens."""
        blocks = self._engines.get(slot)
        if blocks is None or not keys:
            return
        blocks.sent.append(_SentPrompt(token_ids, keys))
        blocks.sent_tokens += len(token_ids)
        while blocks.sent_tokens > self._sent_bound and len(blocks.sent) > 1:
            blocks.sent_tokens -= len(blocks.sent.popleft().token_ids)

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
                parent = self._adopt(blocks, event.parent_block_hash, event)
            if parent is None:
                self._on_dropped("unknown_parent")
                return
            previous = parent
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            previous = chain(previous, event.token_ids[i * size : (i + 1) * size])
            self._insert(blocks, engine_hash, previous)

    def _insert(self, blocks: _EngineBlocks, engine_hash: _Hash, key: BlockKey) -> None:
        """``engine_hash`` holds ``key`` (newest); an inferred entry of the key gives way to a
        hash. Then the bounds."""
        old = blocks.by_hash.get(engine_hash)
        if old is not None:  # stored again: refresh its age (and key, if it changed)
            blocks.by_hash.move_to_end(engine_hash)
            if old == key:
                return
            blocks.remove(engine_hash)
            self._total -= 1
        if not isinstance(engine_hash, _Inferred) and _Inferred(key) in blocks.by_hash:
            blocks.remove(_Inferred(key))
            self._total -= 1
        blocks.by_hash[engine_hash] = key
        blocks.keys[key] = blocks.keys.get(key, 0) + 1
        self._total += 1
        if len(blocks.by_hash) > self._per_engine:
            blocks.pop_oldest()
            self._total -= 1
            self._on_evicted("engine")
        if self._total > self._total_bound:
            self._evict_largest()

    def _adopt(
        self, blocks: _EngineBlocks, parent_hash: EngineBlockHash, event: BlockStored
    ) -> BlockKey | None:
        """The key of ``parent_hash``, from the newest prompt sent to this engine that holds the
        event's first block after a full block (its tokens, then its chained key, which also
        checks model and LoRA); that prompt's earlier blocks are entered as inferred. ``None``
        when no recent prompt has it. At most ``sent_tokens_per_engine`` tokens compared."""
        size = event.block_size
        first = tuple(event.token_ids[:size])
        if len(first) < size:
            return None
        root = chain_root(blocks.model, event.lora_name)
        for prompt in reversed(blocks.sent):
            tokens, keys = prompt.token_ids, prompt.keys
            for j in range(1, len(keys)):
                if tuple(tokens[j * size : (j + 1) * size]) != first:
                    continue
                if chain(keys[j - 1], first) != keys[j]:
                    continue
                if chain(root, tuple(tokens[:size])) != keys[0]:
                    break  # keyed for another model or adapter
                for ancestor in keys[: j - 1]:
                    if ancestor not in blocks.keys:
                        self._insert(blocks, _Inferred(ancestor), ancestor)
                self._insert(blocks, parent_hash, keys[j - 1])
                self._on_adopted()
                return keys[j - 1]
        return None

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
