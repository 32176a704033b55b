"""The two oracles of ``pdserve bench routing``: what a request could have found cached.

Both count a prompt's *leading full blocks* (a block is found only if every block before it is,
as an engine's prefix cache matches) and never the prompt's last token (an engine computes it
whatever it holds, so ``cached_tokens`` never covers it): at most ``(len - 1) // block_size``
blocks.

- :class:`NeverEvictOracle`: the blocks of every prompt that had *finished* before the request
  was sent, on any engine, kept for ever. With engines that evict it is an upper bound no
  scheduler reaches.
- :class:`LiveOracle`: what the engines' caches hold *when the request is sent*, from every
  engine's own KV-cache events (``services.kv_events``: the bench follows each engine's
  publisher with an :class:`~services.kv_events.subscriber.EventSubscriber` itself, whatever
  the router does). Per request it records the longest prefix that any engine of the prefill
  pool holds (role ``prefill`` or ``both``) and the longest that any engine at all holds
  (decode engines too: a request the router runs on a decode engine alone finds that one's
  cache). Evictions are seen as they happen (``BlockRemoved``), so this is a bound a
  scheduler can reach: send each request to the engine that holds most of it.

The live oracle lags the engines by the events' delivery (an engine publishes after its step;
the bench reads on its event loop), as the router's own index does: a block stored between the
request's send and its scheduling on the engine is not in the oracle, so a request can find
more cached than the oracle said (counted; the share caps each request at its oracle).

The live oracle keys blocks by the chained hash of their whole prefix's token ids (root 0 for
the base model; a root of the adapter's name for a LoRA adapter's, :func:`adapter_root`, as vLLM
keys its cache by adapter and names it in ``BlockStored.lora_name``), computed the same way for
a prompt and for an engine's ``BlockStored`` (which chains on the key of its parent's engine
hash): an index of its own, not the router's
(the bench is not to measure the router with the router's code), unbounded (a run is short).
An engine's stream that loses events (``stale(lost=True)``) has its entries dropped and is
counted in :meth:`LiveOracle.health`: a run with losses under-states the oracle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import zmq.asyncio

from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.wire import EngineRecord, EngineRole
from services.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
)
from services.kv_events.keys import BlockKey, block_keys, chain, chain_root
from services.kv_events.subscriber import EventSubscriber

logger = logging.getLogger(__name__)

ROOT: BlockKey = 0
"""The key a base-model prompt's first block chains on (one model: no model to tell apart)."""


def adapter_root(lora: str | None) -> BlockKey:
    """The key the first block of a prompt run with LoRA adapter ``lora`` chains on (:data:`ROOT`
    without one): an adapter's blocks are never another's or the base model's."""
    return ROOT if lora is None else chain_root("", lora)


def prompt_keys(prompt: Sequence[int], block_size: int, lora: str | None = None) -> list[BlockKey]:
    """Keys of the full blocks of ``prompt`` (run with adapter ``lora``): key ``i`` covers
    ``[0, (i + 1) * block_size)``."""
    return block_keys(prompt, block_size, adapter_root(lora))


def countable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most blocks an engine reports cached for a prompt: never its last token."""
    return max(0, prompt_tokens - 1) // block_size


def leading(keys: Sequence[BlockKey], held: set[BlockKey] | Counter[BlockKey]) -> int:
    """How many of ``keys`` from the first are in ``held``."""
    found = 0
    for key in keys:
        if key not in held:
            break
        found += 1
    return found


class NeverEvictOracle:
    """The keys of every prompt that has finished, kept for ever (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.known: set[BlockKey] = set()

    def reusable(self, prompt: Sequence[int], lora: str | None = None) -> int:
        """Tokens of ``prompt`` a finished prompt of the same adapter already had (leading full
        blocks)."""
        found = leading(prompt_keys(prompt, self.block_size, lora), self.known)
        return min(found, countable_blocks(len(prompt), self.block_size)) * self.block_size

    def finished(self, prompt: Sequence[int], lora: str | None = None) -> None:
        self.known.update(prompt_keys(prompt, self.block_size, lora))


class EngineCache:
    """One engine's blocks as its KV events say: an
    :class:`~services.kv_events.subscriber.EventSink` (called on the event loop)."""

    def __init__(self, name: str, role: EngineRole, block_size: int) -> None:
        self.name = name
        self.role = role
        self.block_size = block_size
        self.by_hash: dict[EngineBlockHash, BlockKey] = {}
        self.keys: Counter[BlockKey] = Counter()
        """How many of the engine's hashes hold each key."""
        self.batches = 0
        self.problems: Counter[str] = Counter()
        """Events or messages not applied, and stream losses, by reason."""

    @property
    def prefill(self) -> bool:
        return self.role in (EngineRole.PREFILL, EngineRole.BOTH)

    def matched(self, keys: Sequence[BlockKey]) -> int:
        """The leading ``keys`` this engine holds."""
        return leading(keys, self.keys)

    # -- EventSink ------------------------------------------------------------------------------

    def apply(self, seq: int, batch: EventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    self._remove(engine_hash)
            elif isinstance(event, AllBlocksCleared):
                self.by_hash.clear()
                self.keys.clear()

    def dropped(self, reason: str) -> None:
        self.problems[f"dropped:{reason}"] += 1

    def stale(self, reason: str, *, lost: bool) -> None:
        self.problems[f"{'lost' if lost else 'stale'}:{reason}"] += 1
        if lost:  # removals may be gone with the events: what is left is not to be trusted
            self.by_hash.clear()
            self.keys.clear()

    def resumed(self) -> None:
        pass

    # -- events ---------------------------------------------------------------------------------

    def _stored(self, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            self.problems["block_size"] += 1
            return
        if event.parent_block_hash is None:
            previous = adapter_root(event.lora_name)
        else:
            parent = self.by_hash.get(event.parent_block_hash)
            if parent is None:
                self.problems["unknown_parent"] += 1
                return
            previous = parent
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            previous = chain(previous, event.token_ids[i * size : (i + 1) * size])
            if engine_hash in self.by_hash:
                self._remove(engine_hash)
            self.by_hash[engine_hash] = previous
            self.keys[previous] += 1

    def _remove(self, engine_hash: EngineBlockHash) -> None:
        key = self.by_hash.pop(engine_hash, None)
        if key is None:
            return
        self.keys[key] -= 1
        if self.keys[key] <= 0:
            del self.keys[key]


@dataclass(frozen=True)
class LiveSample:
    """What the live oracle says of one prompt at its send: tokens (leading full blocks, never
    the last token) the best engine of the prefill pool holds, and the best engine at all."""

    prefill_tokens: int
    any_tokens: int
    by_engine: dict[str, int] = field(default_factory=dict, compare=False)
    """Each engine's tokens (its name in the control plane)."""


class LiveOracle:
    """The engines' caches as their events say (see the module docstring)."""

    def __init__(self, caches: Sequence[EngineCache]) -> None:
        self.caches = list(caches)

    def at_send(self, prompt: Sequence[int], lora: str | None = None) -> LiveSample:
        prefill = everywhere = 0
        by_engine: dict[str, int] = {}
        keys_by_size: dict[int, list[BlockKey]] = {}
        for cache in self.caches:
            size = cache.block_size
            if size not in keys_by_size:
                keys_by_size[size] = prompt_keys(prompt, size, lora)
            blocks = min(cache.matched(keys_by_size[size]), countable_blocks(len(prompt), size))
            tokens = by_engine[cache.name] = blocks * size
            everywhere = max(everywhere, tokens)
            if cache.prefill:
                prefill = max(prefill, tokens)
        return LiveSample(prefill, everywhere, by_engine)

    def health(self) -> dict[str, object]:
        """Per engine: batches applied, blocks held now, and what went wrong (by reason)."""
        return {
            cache.name: {
                "role": str(cache.role),
                "batches": cache.batches,
                "blocks_held": len(cache.by_hash),
                "problems": dict(cache.problems),
            }
            for cache in self.caches
        }


@contextlib.asynccontextmanager
async def follow_engines(
    settings: ControlPlaneSettings, *, settle_s: float = 1.0
) -> AsyncIterator[LiveOracle]:
    """A :class:`LiveOracle` over every READY engine of the control plane that publishes KV
    events, followed until the block exits. Waits for each subscription's first replay (the
    events published before it) and ``settle_s`` more, so the subscriptions are connected
    before the first request."""
    control_plane = RedisControlPlane(settings)
    try:
        views = [view for view in await control_plane.list_engines() if view.ready]
    finally:
        await control_plane.close()
    records: list[EngineRecord] = [
        view.record for view in views if view.record is not None and view.record.kv_events_endpoint
    ]
    if not records:
        raise RuntimeError("no READY engine publishes KV events: the live oracle has nothing")
    context = zmq.asyncio.Context()
    subscribers: list[EventSubscriber] = []
    caches: list[EngineCache] = []
    try:
        for record in sorted(records, key=lambda r: r.engine_id):
            cache = EngineCache(record.engine_id, record.role, record.shape.block_size)
            subscriber = EventSubscriber(
                record.kv_events_endpoint, record.kv_events_replay_endpoint, cache, context=context
            )
            subscriber.start()
            caches.append(cache)
            subscribers.append(subscriber)
        deadline = asyncio.get_running_loop().time() + 30.0
        while any(s.replays == 0 for s in subscribers):
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("the live oracle's subscriptions did not start in 30 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle_s)
        logger.info("live oracle: following %d engines' KV events", len(caches))
        yield LiveOracle(caches)
    finally:
        for subscriber in subscribers:
            await subscriber.close()
        context.destroy(linger=0)
