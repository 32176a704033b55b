"""Routing policies: which READY engine gets a request (the seam: :class:`RoutingPolicy`).

The :class:`~services.router.scheduler.Scheduler` filters candidates (READY, the request's
model, compatible with the chosen partner) and asks the policy to pick one per stage. Policies
run on the request path, synchronously: no I/O, a few microseconds.

- :class:`RoundRobinPolicy`: a rotating index per stage.
- :class:`LeastLoadedPolicy`: the fewest of (this router's in-flight reservations + the queue
  the engine last reported). Reservations are taken before the first ``await`` of a request, so
  a burst of requests spreads over engines instead of herding on the one that looked idle at
  the last heartbeat; ties rotate.
- :class:`PrefixAwarePolicy`: least-loaded, except that the engine that was sent the longest
  prefix of this prompt's blocks wins while its load is within ``load_slack`` of the least
  loaded one. The index is approximate (what this router sent, not what the engine kept); the
  engine's ``usage.cached_tokens`` reports the truth. It is kept per :class:`EngineSlot`, weakly:
  an engine that restarts (new generation, so a new slot) starts empty, and one that leaves the
  pool is forgotten with its slot.
"""

from __future__ import annotations

import abc
import enum
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.router.pool import EngineSlot


class Stage(enum.StrEnum):
    """What the chosen engine will do for the request."""

    PREFILL = "prefill"
    DECODE = "decode"
    LOCAL = "local"
    """Prefill and decode on one engine (no KV transfer)."""


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash ``i`` covers tokens
    ``[0, (i + 1) * block_size)``, so equal hashes mean equal prefixes (as engines' prefix
    caches key blocks). Python's hash of int tuples is deterministic across processes."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


@dataclass
class PromptInfo:
    """The request's prompt as policies see it; block hashes computed once per block size."""

    token_ids: tuple[int, ...]
    _hashes: dict[int, list[int]] = field(default_factory=dict)
    context_tokens: int = 0
    """Prompt + ``max_tokens``: the scheduler skips engines whose ``max_model_len`` (when
    published) is smaller."""

    def fits(self, max_model_len: int) -> bool:
        """Whether an engine with this context (0 = unknown) can hold the request."""
        return not max_model_len or self.context_tokens <= max_model_len

    def block_hashes(self, block_size: int) -> list[int]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = prompt_block_hashes(self.token_ids, block_size)
            self._hashes[block_size] = hashes
        return hashes


class RoutingPolicy(abc.ABC):
    """Chooses one engine among candidates; see the module docstring.

    Called by the scheduler only, on the event loop, with a non-empty candidate list sorted by
    engine id.
    """

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


class PrefixAwarePolicy(LeastLoadedPolicy):
    """Longest cached prefix within ``load_slack`` of the least load; else least-loaded."""

    def __init__(self, capacity_blocks: int, load_slack: int) -> None:
        super().__init__()
        self._index = PrefixIndex(capacity_blocks)
        self._slack = load_slack

    def choose(
        self, candidates: Sequence[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> EngineSlot:
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
        return best_slot if best_slot is not None else self._least_loaded(candidates, stage)

    def routed(self, slot: EngineSlot, prompt: PromptInfo) -> None:
        self._index.add(slot, prompt.block_hashes(slot.record.block_size))

    def cached_blocks(self, slot: EngineSlot, prompt: PromptInfo) -> int:
        return self._index.matched(slot, prompt.block_hashes(slot.record.block_size))


def make_policy(name: str, *, prefix_cache_blocks: int, prefix_load_slack: int) -> RoutingPolicy:
    """The policy named in the settings."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(prefix_cache_blocks, prefix_load_slack)
    raise ValueError(f"unknown routing policy {name!r}")
