"""Routing policies: which READY engine gets a request (the seam: :class:`RoutingPolicy`).

The :class:`~services.router.scheduling.scheduler.Scheduler` filters candidates (READY, the
request's model, compatible with the chosen partner) and asks the policy to pick one per stage.
Policies run on the request path, synchronously: no I/O, a few microseconds.

- :class:`RoundRobinPolicy`: a rotating index per stage.
- :class:`LeastLoadedPolicy`: the fewest of (this router's in-flight reservations + the queue
  the engine last reported). Reservations are taken before the first ``await`` of a request, so
  a burst of requests spreads over engines instead of herding on the one that looked idle at
  the last heartbeat; ties rotate.
- :class:`PrefixAwarePolicy`: least-loaded, except that the engine that holds the longest
  prefix of this prompt's blocks wins while its load is within ``load_slack`` of the least
  loaded one. What an engine holds: an engine that reports its prefix cache (the reference
  engine: ``EngineLoad.cached_block_hashes`` on every heartbeat, its most recently used blocks,
  bounded) is scored by that report, plus the prompts this router sent it since the report
  arrived (the next heartbeat lists them if the engine kept them; evicted blocks drop out).
  An engine that reports nothing (vLLM) is scored by what this router sent it, an
  approximation (an LRU per engine). Both are kept per :class:`EngineSlot`, weakly: an engine
  that restarts (new generation, so a new slot) starts empty, and one that leaves the pool is
  forgotten with its slot.

  Engines that publish KV events (``EngineRecord.kv_events_endpoint``; the router's
  :class:`~services.router.scheduling.kv_index.KVIndex`) are scored by what their events say
  they hold, on both pools: each candidate's score is ``weight * cached_share - load``
  (``cached_share``: the leading full blocks of the prompt it holds over the prompt's full
  blocks; ``load``: :func:`load_score`; ``weight``: ``prefill_cache_weight`` where the
  engine computes the prompt, prefill and local placement, or ``decode_cache_weight`` for a
  decode engine), the highest wins, ties rotate. The weights say what a cached block saves:
  its compute on a prefill engine (4 by default: a fully cached prompt is worth four queued
  requests), only its transfer on a decode engine, whose default of 1 makes the cache decide
  among engines of equal load and never outweigh a request in flight: a decode engine that
  held shared system prompts drew every new conversation and then kept each one's turns
  (57 of 118 requests on one decode engine of four, the first token waiting behind them).
  A stale engine (its event stream incomplete) holds nothing as far as the score goes: load
  only. A candidate list with no
  event-publishing engine keeps the approximate behaviour above.

Every ``choose`` leaves its reason in :attr:`RoutingPolicy.reason` (read by the scheduler
right after, for ``pdserve_router_placement_decisions_total``).
"""

from __future__ import annotations

import abc
import enum
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.control_plane.wire import EngineLoad
from services.router.scheduling.kv_index import BlockKey, KVIndex, block_keys, chain_root
from services.router.scheduling.pool import EngineSlot


class Stage(enum.StrEnum):
    """What the chosen engine will do for the request."""

    PREFILL = "prefill"
    DECODE = "decode"
    LOCAL = "local"
    """Prefill and decode on one engine (no KV transfer)."""


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash ``i`` covers tokens
    ``[0, (i + 1) * block_size)``, so equal hashes mean equal prefixes (as engines' prefix
    caches key blocks). Python's hash of int tuples is deterministic across processes. The
    KV-event index chains the same way from a root naming the model
    (:func:`~services.router.scheduling.kv_index.block_keys`)."""
    return block_keys(token_ids, block_size, 0)


@dataclass
class PromptInfo:
    """The request's prompt as policies see it; block hashes computed once per block size."""

    token_ids: tuple[int, ...]
    _hashes: dict[int, list[int]] = field(default_factory=dict)
    context_tokens: int = 0
    """Prompt + ``max_tokens``: the scheduler skips engines whose ``max_model_len`` (when
    published) is smaller."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with (part of the KV-event index's keys)."""
    _keys: dict[tuple[str, int], list[BlockKey]] = field(default_factory=dict)

    def fits(self, max_model_len: int) -> bool:
        """Whether an engine with this context (0 = unknown) can hold the request."""
        return not max_model_len or self.context_tokens <= max_model_len

    def block_hashes(self, block_size: int) -> list[int]:
        """The approximate view's keys of the prompt's full blocks: as engines report them
        (:func:`prompt_block_hashes`), and chained from the adapter for a LoRA request (an
        adapter's KV is not the base model's, nor another adapter's)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            if self.lora_name is None:
                hashes = prompt_block_hashes(self.token_ids, block_size)
            else:
                root = chain_root("", self.lora_name)
                hashes = block_keys(self.token_ids, block_size, root)
            self._hashes[block_size] = hashes
        return hashes

    def block_keys(self, model: str, block_size: int) -> list[BlockKey]:
        """The KV-event index's keys of the prompt's full blocks for ``model``."""
        keys = self._keys.get((model, block_size))
        if keys is None:
            root = chain_root(model, self.lora_name)
            keys = self._keys[(model, block_size)] = block_keys(self.token_ids, block_size, root)
        return keys

    def full_blocks(self, block_size: int) -> int:
        return len(self.token_ids) // block_size


class RoutingPolicy(abc.ABC):
    """Chooses one engine among candidates; see the module docstring.

    Called by the scheduler only, on the event loop, with a non-empty candidate list sorted by
    engine id.
    """

    reason: str = "load"
    """Why the last :meth:`choose` chose as it did (a metric label): ``load``, ``round_robin``,
    ``cached`` (KV events: the cached prefix outweighed load), ``cached_approx`` (the
    approximate view's prefix)."""

    @abc.abstractmethod
    def choose(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
        """The engine that gets this stage of the request; never raises for a non-empty list."""

    def routed(self, slot: EngineSlot, prompt: PromptInfo) -> None:  # noqa: B027 - optional hook
        """The request's prompt was sent to ``slot`` (its KV is now likely cached there)."""

    def cached_blocks(self, slot: EngineSlot, prompt: PromptInfo) -> int:
        """How many leading full blocks of the prompt ``slot`` likely holds (0 if unknown)."""
        return 0


class RoundRobinPolicy(RoutingPolicy):
    """Each stage rotates over its candidates."""

    reason = "round_robin"

    def __init__(self) -> None:
        self._counters = {stage: itertools.count() for stage in Stage}

    def choose(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
        return candidates[next(self._counters[stage]) % len(candidates)]


def load_score(slot: EngineSlot) -> int:
    """This router's reservations plus the queue the engine reported (other routers' work)."""
    return slot.inflight + slot.load.queue_depth


class LeastLoadedPolicy(RoutingPolicy):
    """The lowest :func:`load_score`; ties rotate, per stage, so equal engines share a burst
    (one rotation for every stage put a request's prefill and decode on alternate turns: with
    two engines of each role, prefills went to the first and decodes to the second)."""

    def __init__(self) -> None:
        self._tie_breakers = {stage: itertools.count() for stage in Stage}

    def choose(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
        return self._least_loaded(candidates, stage)

    def _least_loaded(self, candidates: Sequence[EngineSlot], stage: Stage) -> EngineSlot:
        best = min(load_score(slot) for slot in candidates)
        tied = [slot for slot in candidates if load_score(slot) == best]
        return tied[next(self._tie_breakers[stage]) % len(tied)]


class PrefixIndex:
    """Per engine slot, an LRU set of the block hashes this router sent it (dropped with the
    slot: the pool replaces a slot when its engine restarts and drops it when it leaves)."""

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._blocks: weakref.WeakKeyDictionary[EngineSlot, OrderedDict[int, None]] = (
            weakref.WeakKeyDictionary()
        )

    def add(self, slot: EngineSlot, hashes: Sequence[int]) -> None:
        blocks = self._blocks.get(slot)
        if blocks is None:
            blocks = self._blocks[slot] = OrderedDict()
        for block_hash in hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)

    def matched(self, slot: EngineSlot, hashes: Sequence[int]) -> int:
        """Leading hashes present (a chained hash present implies its whole prefix matched,
        but an evicted earlier block still counts as a miss, conservatively)."""
        blocks = self._blocks.get(slot)
        if not blocks:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            count += 1
        return count


class ReportedCaches:
    """Per engine slot that reports its prefix cache: the reported hashes as a set (rebuilt
    when a new load arrives) and the hashes this router sent it since that load."""

    def __init__(self) -> None:
        self._reported: weakref.WeakKeyDictionary[
            EngineSlot, tuple[EngineLoad, frozenset[int], set[int]]
        ] = weakref.WeakKeyDictionary()

    def _entry(self, slot: EngineSlot) -> tuple[EngineLoad, frozenset[int], set[int]]:
        entry = self._reported.get(slot)
        if entry is None or entry[0] is not slot.load:
            entry = (slot.load, frozenset(slot.load.cached_block_hashes), set())
            self._reported[slot] = entry
        return entry

    def add(self, slot: EngineSlot, hashes: Sequence[int]) -> None:
        self._entry(slot)[2].update(hashes)

    def matched(self, slot: EngineSlot, hashes: Sequence[int]) -> int:
        _, reported, sent = self._entry(slot)
        count = 0
        for block_hash in hashes:
            if block_hash not in reported and block_hash not in sent:
                break
            count += 1
        return count


class PrefixAwarePolicy(LeastLoadedPolicy):
    """Longest cached prefix within ``load_slack`` of the least load; else least-loaded. With
    ``events``, engines that publish KV events are scored by them (see the module docstring)."""

    def __init__(
        self,
        capacity_blocks: int,
        load_slack: int,
        *,
        events: KVIndex | None = None,
        prefill_cache_weight: float = 4.0,
        decode_cache_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self._index = PrefixIndex(capacity_blocks)
        self._reported = ReportedCaches()
        self._slack = load_slack
        self._events = events
        self._weights = {
            Stage.PREFILL: prefill_cache_weight,
            Stage.DECODE: decode_cache_weight,
            Stage.LOCAL: prefill_cache_weight,
        }

    def choose(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
        if self._events is not None and any(self._publishes(slot) for slot in candidates):
            return self._by_events(candidates, prompt, stage)
        self.reason = "load"
        if stage is Stage.DECODE:
            return self._least_loaded(candidates, stage)
        least = min(load_score(slot) for slot in candidates)
        best_slot: EngineSlot | None = None
        best_blocks = 0
        for slot in candidates:
            if load_score(slot) > least + self._slack:
                continue
            blocks = self.cached_blocks(slot, prompt)
            if blocks > best_blocks:
                best_slot, best_blocks = slot, blocks
        if best_slot is None:
            return self._least_loaded(candidates, stage)
        self.reason = "cached_approx"
        return best_slot

    def _by_events(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
        weight = self._weights[stage]
        best: list[tuple[EngineSlot, int]] = []
        best_score = 0.0
        for slot in candidates:
            full = prompt.full_blocks(slot.record.shape.block_size)
            cached = self.cached_blocks(slot, prompt) if full else 0
            score = (weight * cached / full if full else 0.0) - load_score(slot)
            if not best or score > best_score:
                best, best_score = [(slot, cached)], score
            elif score == best_score:
                best.append((slot, cached))
        # Only a tie turns the rotation: a clear winner must not shift whom the next tie goes
        # to (alternating cached and new prompts would otherwise send every new one to the
        # same engine).
        tied = len(best) > 1
        chosen, cached = best[next(self._tie_breakers[stage]) % len(best)] if tied else best[0]
        self.reason = "cached" if cached else "load"
        return chosen

    def _publishes(self, slot: EngineSlot) -> bool:
        return bool(slot.record.kv_events_endpoint)

    def routed(self, slot: EngineSlot, prompt: PromptInfo) -> None:
        if self._events is not None and self._publishes(slot):
            # Its events will say what it stored; the prompt names the parents they may name
            # that this router never saw stored (KVIndex.sent).
            keys = prompt.block_keys(slot.record.model, slot.record.shape.block_size)
            self._events.sent(slot, prompt.token_ids, keys)
            return
        hashes = prompt.block_hashes(slot.record.shape.block_size)
        if slot.load.prefix_cache_reported:
            self._reported.add(slot, hashes)
        else:
            self._index.add(slot, hashes)

    def cached_blocks(self, slot: EngineSlot, prompt: PromptInfo) -> int:
        if self._events is not None and self._publishes(slot):
            keys = prompt.block_keys(slot.record.model, slot.record.shape.block_size)
            return self._events.matched(slot, keys)
        hashes = prompt.block_hashes(slot.record.shape.block_size)
        if slot.load.prefix_cache_reported:
            return self._reported.matched(slot, hashes)
        return self._index.matched(slot, hashes)


def make_policy(
    name: str,
    *,
    prefix_cache_blocks: int,
    prefix_load_slack: int,
    events: KVIndex | None = None,
    prefill_cache_weight: float = 4.0,
    decode_cache_weight: float = 1.0,
) -> RoutingPolicy:
    """The policy named in the settings (``events``: the KV-event index, for
    ``prefix_aware``)."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(
            prefix_cache_blocks,
            prefix_load_slack,
            events=events,
            prefill_cache_weight=prefill_cache_weight,
            decode_cache_weight=decode_cache_weight,
        )
    raise ValueError(f"unknown routing policy {name!r}")
