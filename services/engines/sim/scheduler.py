"""The simulated engine's scheduler: vLLM V1's admission and step planning, with no clock.

Sans-IO: :meth:`SimScheduler.schedule` plans one step and says how long it takes (from the
profile); :meth:`SimScheduler.commit` applies it and says which sequences got a token and which
finished. The backend (:mod:`.backend`) sleeps for the step's duration between the two; a test
drives them directly and reads the durations, with no clock at all.

What it does as vLLM's scheduler does (``vllm/v1/core/sched/scheduler.py``):

- every sequence has ``num_tokens`` (prompt + output so far) and ``computed`` (tokens whose KV
  exists); a step computes ``num_tokens - computed`` of a sequence, at most what is left of the
  step's token budget (``max_num_batched_tokens``): a long prompt is prefilled in chunks, and a
  sequence whose KV is complete after the step samples one token;
- running sequences are planned first, in admission order, then waiting ones (first come,
  first served) while budget, ``max_num_seqs`` and free KV blocks allow; a waiting sequence whose
  blocks do not fit stays at the head of the queue, and nothing behind it is admitted;
- KV blocks are allocated as a sequence's tokens need them and freed when it finishes or is
  removed; a running sequence that needs a block when none is free preempts the most recently
  admitted running one (its blocks freed, it goes back to the head of the queue and computes its
  tokens again: vLLM's recompute preemption);
- prefill chunks and decode tokens share a step (chunked prefill), and the step pays for both
  (:meth:`~services.engines.sim.profile.SimProfile.step_ms`).

- with a :class:`~.prefix_cache.SimPrefixCache` (and a sequence's token ids), vLLM's prefix
  caching: a sequence admitted holds the longest cached prefix of its prompt and does not
  compute it (the step's time charges only the rest, with the cached prefix as attention
  context); full prompt blocks are cached as the step computing them ends (a sequence whose
  prompt's KV arrived from a producer caches them at admission); cached blocks nobody holds
  count as free and are evicted least recently freed first when blocks run short.

What it leaves out: speculative decoding, priorities, a prefill engine holding KV until its
consumer pulled it (its blocks are freed once its first token is out).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.engines.sim.prefix_cache import SimPrefixCache
from services.engines.sim.profile import SimProfile
from services.kv_events.keys import BlockKey, block_keys


@dataclass(eq=False)
class SimSequence:
    """One request in the scheduler."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    """Tokens to sample here in all (a prefill engine: 1), ``generated`` included."""
    generated: int = 0
    """Output tokens so far (a decode from remote KV starts at 1: the producer's)."""
    computed: int = 0
    """Tokens whose KV exists here (a decode from remote KV starts with the prompt's)."""
    blocks: int = 0
    """Blocks held, :attr:`held` (through the prefix cache) included."""
    prompt: tuple[int, ...] = ()
    """The prompt's token ids (empty: the sequence neither finds nor fills the cache)."""
    keys: list[BlockKey] = field(default_factory=list)
    """The chained keys of the prompt's full blocks (set when queued with a cache)."""
    held: list[BlockKey] = field(default_factory=list)
    """Keys of the cached blocks it holds, in prompt order."""
    stored: int = 0
    """Leading full prompt blocks already found or offered to the cache."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache at its first admission (``None`` before)."""
    arrived_ms: float = 0.0
    first_scheduled_ms: float | None = None
    first_token_ms: float | None = None
    done: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.num_tokens - self.computed


@dataclass(frozen=True)
class ScheduledChunk:
    sequence: SimSequence
    num_tokens: int
    computed_before: int

    @property
    def is_decode(self) -> bool:
        """One token of a sequence whose prompt is computed: a decode token; anything else
        (a prompt chunk, a preempted sequence's recompute) is prefill work."""
        return self.num_tokens == 1 and self.computed_before >= self.sequence.prompt_len


@dataclass(frozen=True)
class StepPlan:
    """One step: what it computes and how long it takes."""

    chunks: tuple[ScheduledChunk, ...]
    duration_ms: float
    preempted: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.chunks

    @property
    def prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def decode_batch(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)


@dataclass
class StepOutcome:
    """What a committed step produced."""

    sampled: list[SimSequence] = field(default_factory=list)
    """Sequences that got one token this step (in plan order)."""
    finished: list[SimSequence] = field(default_factory=list)
    """Sequences that reached ``max_new_tokens`` (their blocks are free again)."""


@dataclass
class SchedulerStats:
    """Committed steps so far (what a benchmark reads to show the interference)."""

    steps: int = 0
    mixed_steps: int = 0
    """Steps that carried prefill work and decode tokens together (chunked prefill)."""
    longest_decode_step_ms: float = 0.0
    """The longest step that carried a decode token: every running stream waited for it."""


class SimScheduler:
    """See the module docstring. Not thread-safe; one per engine, on the engine's loop."""

    def __init__(
        self,
        profile: SimProfile,
        *,
        num_blocks: int,
        block_size: int,
        prefix_cache: SimPrefixCache | None = None,
    ) -> None:
        self.profile = profile
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.free_blocks = num_blocks
        """Blocks neither held nor cached (:attr:`available_blocks` adds evictable ones)."""
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.clock_ms = 0.0
        """Simulated time: the sum of committed steps' durations."""
        self.stats = SchedulerStats()
        self._by_id: dict[str, SimSequence] = {}

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        cache = self.prefix_cache
        return self.free_blocks + (cache.evictable if cache is not None else 0)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def fits_ever(self, prompt_len: int) -> bool:
        """Whether a prompt and one sampled token fit in the whole KV pool."""
        return self.blocks_for(prompt_len + 1) <= self.num_blocks

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, sequence: SimSequence) -> None:
        """Queue a sequence (the caller checked that its id is new and that it fits ever)."""
        sequence.arrived_ms = self.clock_ms
        if self.prefix_cache is not None and sequence.prompt and not sequence.keys:
            sequence.keys = block_keys(sequence.prompt, self.block_size, 0)
        self._by_id[sequence.request_id] = sequence
        self.waiting.append(sequence)

    def remove(self, request_id: str) -> SimSequence | None:
        """Take a sequence out (finished by its consumer, aborted) and free its blocks."""
        sequence = self._by_id.pop(request_id, None)
        if sequence is None:
            return None
        sequence.done = True
        if sequence in self.running:
            self.running.remove(sequence)
        else:
            self.waiting.remove(sequence)
        self._free(sequence)
        return sequence

    def schedule(self) -> StepPlan:
        """Plan the next step (allocating its blocks); an empty plan when nothing can run."""
        budget = self.profile.scheduler.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            take = min(sequence.remaining, budget)
            need = self.blocks_for(sequence.computed + take) - sequence.blocks
            # Victims are the most recently admitted: always after this one, never planned.
            while need > self.available_blocks and self.running[-1] is not sequence:
                preempted.append(self._preempt(self.running[-1]))
            if need > self.available_blocks:
                preempted.append(self._preempt(sequence))
                break
            self._allocate(sequence, need)
            chunks.append(ScheduledChunk(sequence, take, sequence.computed))
            budget -= take
            index += 1
        if not preempted:
            max_seqs = self.profile.scheduler.max_num_seqs
            while self.waiting and budget > 0 and len(self.running) < max_seqs:
                sequence = self.waiting[0]
                has_kv = sequence.computed >= sequence.prompt_len
                hits, idle = self._cached_prefix(sequence, has_kv)
                computed = sequence.computed if has_kv else hits * self.block_size
                take = min(sequence.num_tokens - computed, budget)
                need = self.blocks_for(computed + take) - hits
                if need > self.available_blocks - idle:
                    break  # the head waits for blocks; first come, first served
                self.waiting.popleft()
                self.running.append(sequence)
                self._hold_cached(sequence, hits)
                sequence.computed = computed
                self._allocate(sequence, need)
                if has_kv:  # its prompt's KV arrived: cached as computed here
                    self._store(sequence)
                chunks.append(ScheduledChunk(sequence, take, sequence.computed))
                budget -= take
        for chunk in chunks:
            if chunk.sequence.first_scheduled_ms is None:
                chunk.sequence.first_scheduled_ms = self.clock_ms
        return StepPlan(tuple(chunks), self.duration_ms(chunks), tuple(preempted))

    def duration_ms(self, chunks: Iterable[ScheduledChunk]) -> float:
        """The profile's time for a step computing ``chunks``."""
        prefill: list[tuple[int, int]] = []
        batch = context = 0
        for chunk in chunks:
            if chunk.is_decode:
                batch += 1
                context += chunk.computed_before + 1
            else:
                prefill.append((chunk.computed_before, chunk.num_tokens))
        return self.profile.step_ms(
            prefill_chunks=prefill, decode_batch=batch, decode_context_tokens=context
        )

    def commit(self, plan: StepPlan) -> StepOutcome:
        """The step ran: advance the clock and the planned sequences (those removed since
        the plan are skipped); sequences done sampling finish and free their blocks."""
        self.clock_ms += plan.duration_ms
        self.stats.steps += 1
        if plan.decode_batch:
            self.stats.mixed_steps += plan.prefill_tokens > 0
            self.stats.longest_decode_step_ms = max(
                self.stats.longest_decode_step_ms, plan.duration_ms
            )
        outcome = StepOutcome()
        for chunk in plan.chunks:
            sequence = chunk.sequence
            if sequence.done:
                continue  # removed since the plan (aborted, its consumer gone)
            sequence.computed += chunk.num_tokens
            self._store(sequence)
            if sequence.remaining == 0:
                sequence.generated += 1
                if sequence.first_token_ms is None:
                    sequence.first_token_ms = self.clock_ms
                outcome.sampled.append(sequence)
                if sequence.generated >= sequence.max_new_tokens:
                    self.remove(sequence.request_id)
                    outcome.finished.append(sequence)
        return outcome

    def cached_prefix_tokens(self, sequence: SimSequence) -> int:
        """The prompt tokens of a sequence whose KV arrives from a producer that this engine's
        cache holds now (they need not move). Changes nothing."""
        if self.prefix_cache is not None and sequence.prompt and not sequence.keys:
            sequence.keys = block_keys(sequence.prompt, self.block_size, 0)
        return self._cached_prefix(sequence, True)[0] * self.block_size

    def _cached_prefix(self, sequence: SimSequence, has_kv: bool) -> tuple[int, int]:
        """:meth:`SimPrefixCache.peek` over the prompt blocks a sequence may find: every full
        one when its KV arrived from a producer, else those before its last token."""
        if self.prefix_cache is None or not sequence.keys:
            return 0, 0
        limit = sequence.prompt_len if has_kv else sequence.prompt_len - 1
        return self.prefix_cache.peek(sequence.keys[: limit // self.block_size])

    def _hold_cached(self, sequence: SimSequence, hits: int) -> None:
        if hits and self.prefix_cache is not None:
            sequence.held = sequence.keys[:hits]
            self.prefix_cache.acquire(sequence.held)
        sequence.blocks += hits
        sequence.stored = hits
        if sequence.cached_tokens is None:
            sequence.cached_tokens = hits * self.block_size

    def _store(self, sequence: SimSequence) -> None:
        """Offer the prompt's newly computed full blocks to the cache."""
        cache = self.prefix_cache
        if cache is None or not sequence.keys:
            return
        end = min(sequence.computed, sequence.prompt_len) // self.block_size
        if end > sequence.stored:
            sequence.held += cache.store(sequence.prompt, sequence.keys, sequence.stored, end)
            sequence.stored = end

    def _allocate(self, sequence: SimSequence, blocks: int) -> None:
        if blocks > 0:
            short = blocks - self.free_blocks
            if short > 0 and self.prefix_cache is not None:
                self.free_blocks += self.prefix_cache.evict(short)
            self.free_blocks -= blocks
            sequence.blocks += blocks

    def _free(self, sequence: SimSequence) -> None:
        if self.prefix_cache is not None and sequence.held:
            self.prefix_cache.release(sequence.held)
        self.free_blocks += sequence.blocks - len(sequence.held)
        sequence.blocks = 0
        sequence.held = []
        sequence.stored = 0

    def _preempt(self, sequence: SimSequence) -> str:
        self.running.remove(sequence)
        self._free(sequence)
        sequence.computed = 0
        self.waiting.appendleft(sequence)
        return sequence.request_id
