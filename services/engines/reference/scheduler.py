"""The reference engine's scheduler: admission, continuous batching, sampling, KV hand-off.

Pure bookkeeping with no processes: the engine loop (:mod:`~services.engines.reference.engine`)
feeds it requests and rank events and runs the steps it plans. It owns the engine-wide block
allocator, so block ids are the same on every rank (as in vLLM); the commands for the ranks
(hold, release, pull, cancel) go to :attr:`Scheduler.outbox`, which the loop sends to every rank.

Per step (:meth:`Scheduler.schedule`): waiting requests are admitted in arrival order while
``max_running`` allows and their worst-case blocks are free (no preemption: a request, once
admitted, always has the blocks it may need; one that does not fit waits, head of line); then
every running request gets its next tokens, decode tokens first, then prefill chunks up to
``max_batch_tokens`` (chunked prefill). New requests therefore join the running batch at the
next step. :meth:`Scheduler.complete_step` samples a token for each sequence whose chunk reached
its last token and decides whether it finished.

Request kinds:

- ``generate``: colocated; prefill here, then decode (``decode`` without a KV handle);
- ``prefill``: prefill only; the first token is returned with a :class:`KVHandle` and the prompt
  blocks are held by every rank's producer until its consumers notify or the lease expires;
- ``remote``: decode from a producer's KV: blocks are allocated, every rank pulls its share, and
  decoding continues after the producer's first token.

``n > 1`` from one prefill and one KV transfer (forks): a ``prefill`` with ``sampling.n > 1``
samples the first token of each choice from the prompt's last logits (choice ``i`` with
``sampling.for_choice(i)``: a seeded choice draws what a request seeded with ``seed + i``
would); a ``remote`` request with ``forks`` pulls the prompt's KV once, then forks one sequence
per further fork: each shares the prompt's full blocks (one more reference each, never written:
new tokens go after the prompt) and recomputes the prompt's last partial block, at most
``block_size - 1`` tokens, into a block of its own instead of copying it (no rank command; the
prefix cache serves hits the same way). Every fork's blocks are reserved when the request is
admitted (no preemption), and the forks' deltas carry their choice.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

import torch

from services.engines.backend import (
    FinishReason,
    FirstToken,
    Fork,
    KVHandle,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    KVTransferFailed,
    ProducerUnavailable,
    RequestAborted,
)
from services.engines.reference.batch import SequenceChunk
from services.engines.reference.messages import (
    CancelPull,
    HoldKV,
    HostCommand,
    LeaseEnded,
    PullDone,
    PullKV,
    ReleaseKV,
)
from services.engines.reference.metrics import ReferenceEngineMetrics
from services.engines.reference.prefix_cache import PrefixCache
from services.engines.reference.sampling import (
    OutputText,
    make_generator,
    process_logits,
    sample_token,
    token_generator,
    token_logprobs,
)
from services.kv_transfer.allocator import BlockAllocator
from services.tokenization.tokenizer import Tokenizer
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)

RequestKind = Literal["generate", "prefill", "remote"]
SinkItem = PrefillResult | TokenDelta | BaseException

# Pull failures that mean "the producer is not there (at that generation)"; anything else is a
# failed transfer.
_UNAVAILABLE_REASONS = frozenset(
    {"producer_unavailable", "stale_generation", "unknown_peer", "peer_removed", "peer_replaced"}
)


class RequestSink(Protocol):
    """Where a request's results go (the backend bridges it to the caller's event loop)."""

    def put(self, item: SinkItem) -> None: ...


class Phase(Enum):
    WAITING = "waiting"
    PULLING = "pulling"
    RUNNING = "running"
    HELD = "held"
    DONE = "done"


@dataclass(frozen=True)
class SchedulerLimits:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_batch_tokens: int
    max_running: int
    max_queue: int
    kv_lease_s: float
    kv_pull_timeout_s: float
    producer_connect_wait_s: float
    prefix_caching: bool = False


@dataclass(eq=False)
class EngineRequest:
    """One request's state in the scheduler."""

    request_id: str
    kind: RequestKind
    prompt: tuple[int, ...]
    sampling: SamplingParams
    sink: RequestSink
    text: OutputText
    generator: torch.Generator
    handle: KVHandle | None = None
    first_token_id: int | None = None
    phase: Phase = Phase.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    arrived_at: float = 0.0
    admitted_at: float = 0.0
    pull_started_at: float = 0.0
    kv_transfer_s: float | None = None
    pull_reports: dict[RankKey, PullDone] = field(default_factory=dict)
    lease_reports: dict[RankKey, str] = field(default_factory=dict)
    cancelled: bool = False
    """Aborted while ranks still work on its blocks (pull or lease): freed when they report."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With ``sampling.prompt_logprobs``: prompt tokens 1.. as their chunks are computed."""
    prompt_logprobs_sent: bool = False
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    choice: int = 0
    """The choice this sequence is (a fork's; tags its deltas)."""
    forks: tuple[Fork, ...] = ()
    """A remote request's further forks (``DecodeRequest.forks[1:]``), started once the pull
    succeeded; their blocks are :attr:`reserved` until then."""
    reserved: list[int] = field(default_factory=list)
    parent: str | None = None
    """A fork's: the id of the request it was forked from."""

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the next step must return every new token's logits (prompt logprobs)."""
        return (
            self.sampling.prompt_logprobs is not None
            and self.kind != "remote"
            and self.num_computed < len(self.prompt)
        )

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def pending_tokens(self) -> int:
        return len(self.prompt) + len(self.output) - self.num_computed


@dataclass(frozen=True)
class StepEntry:
    request: EngineRequest
    chunk: SequenceChunk


@dataclass(frozen=True)
class PlannedStep:
    entries: tuple[StepEntry, ...]

    @property
    def chunks(self) -> tuple[SequenceChunk, ...]:
        return tuple(entry.chunk for entry in self.entries)

    @property
    def all_tokens(self) -> bool:
        """Whether the ranks return logits for every new token (``[T, vocab]``) instead of
        each sequence's last: some request wants its prompt's logprobs."""
        return any(entry.request.wants_prompt_logprobs for entry in self.entries)


class Scheduler:
    """See the module docstring. Not thread-safe: the engine loop's thread owns it."""

    def __init__(
        self,
        *,
        engine_id: str,
        generation: int,
        world_ranks: Sequence[RankKey],
        limits: SchedulerLimits,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        metrics: ReferenceEngineMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine_id = engine_id
        self.generation = generation
        self.limits = limits
        self.allocator = BlockAllocator(limits.num_blocks)
        self.prefix_cache = (
            PrefixCache(self.allocator, limits.block_size) if limits.prefix_caching else None
        )
        self.outbox: list[HostCommand] = []
        """Commands for every rank, in order; the engine loop sends and clears them."""
        self.deliveries: list[tuple[RequestSink, SinkItem]] = []
        """Results for callers; the loop hands them over (:meth:`deliver_all`) once its load
        snapshot reflects the state that produced them."""
        self.draining = False
        self._ranks = tuple(world_ranks)
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._requests: dict[str, EngineRequest] = {}
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._families: dict[str, tuple[str, ...]] = {}
        """A forked request's id -> its further forks' ids (aborted with it)."""

    def _deliver(self, sink: RequestSink, item: SinkItem) -> None:
        self.deliveries.append((sink, item))

    def deliver_all(self) -> None:
        """Hand every pending result to its sink."""
        deliveries, self.deliveries = self.deliveries, []
        for sink, item in deliveries:
            sink.put(item)

    # -- counts ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        """Requests admitted and computing or pulling (held prefills excluded)."""
        return sum(1 for r in self._requests.values() if r.phase in (Phase.RUNNING, Phase.PULLING))

    @property
    def in_flight(self) -> int:
        """Every request not finished, held KV included."""
        return len(self._requests)

    # -- intake ------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        kind: RequestKind,
        prompt: Sequence[int],
        sampling: SamplingParams,
        sink: RequestSink,
        *,
        handle: KVHandle | None = None,
        first_token_id: int | None = None,
        forks: tuple[Fork, ...] = (),
    ) -> None:
        """Queue a request. Raises :class:`InvalidRequest`, :class:`DuplicateRequest`,
        :class:`EngineDraining` or :class:`EngineOverloaded` (nothing is queued then)."""
        if self.draining:
            raise EngineDraining(f"engine {self.engine_id} is draining")
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already in flight")
        limits = self.limits
        if not prompt:
            raise InvalidRequest("prompt_token_ids must not be empty")
        if len(prompt) >= limits.max_model_len:
            raise InvalidRequest(
                f"prompt of {len(prompt)} tokens leaves no room in the context of "
                f"{limits.max_model_len}"
            )
        if kind == "remote" and (handle is None or first_token_id is None):
            raise InvalidRequest("a remote decode needs a kv_handle and a first_token_id")
        if forks and (kind != "remote" or forks[0].first_token_id != first_token_id):
            raise InvalidRequest("forks need a remote decode whose first_token_id is the first's")
        if sampling.n > 1 and kind != "prefill":
            raise InvalidRequest("n > 1 is for a prefill; a decode forks with forks")
        choice = forks[0].choice if forks else 0
        if self._blocks_total(kind, prompt, sampling, len(forks)) > limits.num_blocks:
            raise InvalidRequest(
                f"request needs more KV blocks than the engine has ({limits.num_blocks}); "
                "lower max_tokens"
            )
        if len(self._waiting) >= limits.max_queue:
            raise EngineOverloaded(f"queue full ({limits.max_queue} waiting)")
        released = (first_token_id,) if first_token_id is not None else ()
        request = EngineRequest(
            request_id=request_id,
            kind=kind,
            prompt=tuple(prompt),
            sampling=sampling.for_choice(choice) if forks else sampling,
            sink=sink,
            text=self._output_text(sampling, released),
            generator=make_generator(sampling.for_choice(choice).seed),
            handle=handle,
            first_token_id=first_token_id,
            arrived_at=self._clock(),
            choice=choice,
            forks=forks[1:],
        )
        self._requests[request_id] = request
        self._waiting.append(request)

    def _output_text(self, sampling: SamplingParams, released: tuple[int, ...]) -> OutputText:
        return OutputText(
            self._tokenizer,
            sampling.stop,
            already_released=released,
            include_stop=sampling.include_stop_str_in_output,
            min_tokens=sampling.min_tokens,
        )

    def _blocks_total(
        self, kind: RequestKind, prompt: Sequence[int], sampling: SamplingParams, forks: int
    ) -> int:
        """Worst-case blocks of a request and its further forks (each fork shares the
        prompt's full blocks)."""
        needed = self._blocks_needed(kind, len(prompt), sampling)
        if forks <= 1:
            return needed
        return needed + (forks - 1) * (needed - len(prompt) // self.limits.block_size)

    def _blocks_needed(self, kind: RequestKind, prompt_len: int, sampling: SamplingParams) -> int:
        """Worst-case blocks: the prompt, plus every generated token but the last (whose KV is
        never computed), capped by the context."""
        if kind == "prefill":
            tokens = prompt_len
        else:
            tokens = min(prompt_len + sampling.max_tokens - 1, self.limits.max_model_len)
        return -(-max(tokens, 1) // self.limits.block_size)

    # -- stepping ----------------------------------------------------------------------------

    def schedule(self) -> PlannedStep | None:
        """Admit what fits and plan the next forward step (``None`` when nothing to compute)."""
        self._admit()
        budget = self.limits.max_batch_tokens
        entries: list[StepEntry] = []
        # Decode tokens first (one each), then prefill chunks, both in admission order.
        for request in sorted(self._running, key=lambda r: r.pending_tokens > 1):
            if budget == 0:
                break
            pending = request.pending_tokens
            if pending <= 0:
                continue
            take = min(pending, budget)
            start = request.num_computed
            chunk = SequenceChunk(
                tuple(request.tokens[start : start + take]), start, tuple(request.block_ids)
            )
            entries.append(StepEntry(request, chunk))
            budget -= take
        return PlannedStep(tuple(entries)) if entries else None

    def free_blocks(self) -> int:
        """Blocks an admission may use (evictable prefix-cache blocks included)."""
        cache = self.prefix_cache
        return self.allocator.free_count if cache is None else cache.free_count()

    def _admit(self) -> None:
        cache = self.prefix_cache
        while self._waiting and self.running_count < self.limits.max_running:
            request = self._waiting[0]
            single = self._blocks_needed(request.kind, len(request.prompt), request.sampling)
            needed = self._blocks_total(
                request.kind, request.prompt, request.sampling, len(request.forks) + 1
            )
            cached: list[int] = []
            if (
                cache is not None
                and request.kind != "remote"
                and request.sampling.prompt_logprobs is None
            ):
                cached = cache.match(request.prompt)
            if needed - len(cached) > self.free_blocks():
                if cached:
                    self.allocator.free(cached)
                return  # head of line waits for blocks
            self._waiting.popleft()
            fresh = (
                cache.allocate(needed - len(cached))
                if cache is not None
                else list(self.allocator.allocate(needed))
            )
            request.block_ids = [*cached, *fresh]
            request.block_ids, request.reserved = (
                request.block_ids[:single],
                request.block_ids[single:],
            )
            request.num_computed = request.cached_tokens = len(cached) * self.limits.block_size
            request.admitted_at = self._clock()
            if request.kind == "remote":
                self._start_pull(request)
            else:
                request.phase = Phase.RUNNING
                self._running.append(request)

    def complete_step(self, step: PlannedStep, logits: torch.Tensor) -> None:
        """Apply a step's logits (``[S, vocab]``, or ``[T, vocab]`` when
        :attr:`PlannedStep.all_tokens`): advance each sequence, sample where due."""
        all_tokens = step.all_tokens
        row = 0
        for index, entry in enumerate(step.entries):
            request = entry.request
            length = len(entry.chunk.token_ids)
            rows = logits[row : row + length] if all_tokens else logits[index : index + 1]
            row += length
            if request.phase is not Phase.RUNNING:
                continue  # aborted while the step ran
            if all_tokens and request.wants_prompt_logprobs:
                self._add_prompt_logprobs(request, entry.chunk.num_cached, rows)
            request.num_computed += length
            if request.pending_tokens == 0:
                if not request.output and self.prefix_cache is not None:
                    self.prefix_cache.insert(request.prompt, request.block_ids)
                sampling = request.sampling
                seed = sampling.seed
                generator = (
                    request.generator
                    if seed is None
                    else token_generator(seed, len(request.output))
                )
                last = rows[-1]
                stop_ids = (
                    sampling.stop_token_ids
                    if sampling.ignore_eos
                    else (*sampling.stop_token_ids, *self._eos)
                )
                processed = process_logits(last, sampling, request.prompt, request.output, stop_ids)
                token = sample_token(processed, sampling, generator)
                logprobs = (
                    token_logprobs(last, token, sampling.logprobs)
                    if sampling.logprobs is not None
                    else None
                )
                more: tuple[FirstToken, ...] = ()
                if request.kind == "prefill" and sampling.n > 1:
                    more = self._more_choices(request, last, processed)
                self._on_token(request, token, logprobs, more)

    def _more_choices(
        self, request: EngineRequest, last: torch.Tensor, processed: torch.Tensor
    ) -> tuple[FirstToken, ...]:
        """The first tokens of choices ``1 .. n-1`` of a prefill (see the module docstring)."""
        firsts: list[FirstToken] = []
        for choice in range(1, request.sampling.n):
            sampling = request.sampling.for_choice(choice)
            seed = sampling.seed
            generator = make_generator(None) if seed is None else token_generator(seed, 0)
            token = sample_token(processed, sampling, generator)
            logprobs = (
                token_logprobs(last, token, sampling.logprobs)
                if sampling.logprobs is not None
                else None
            )
            _, text, finish = self._judge(
                sampling, len(request.prompt), 1, token, self._output_text(sampling, ())
            )
            firsts.append(FirstToken(token, text, finish, logprobs))
        return tuple(firsts)

    def _add_prompt_logprobs(self, request: EngineRequest, start: int, rows: torch.Tensor) -> None:
        """Row ``j`` of a prompt chunk starting at ``start`` predicts prompt token
        ``start + j + 1``."""
        top = request.sampling.prompt_logprobs or 0
        prompt = request.prompt
        for j in range(rows.shape[0]):
            position = start + j + 1
            if position < len(prompt):
                request.prompt_logprobs.append(token_logprobs(rows[j], prompt[position], top))

    def _take_prompt_logprobs(self, request: EngineRequest) -> tuple[TokenLogprobs, ...]:
        """The prompt logprobs, once (on the request's first result)."""
        if request.prompt_logprobs_sent or request.sampling.prompt_logprobs is None:
            return ()
        request.prompt_logprobs_sent = True
        return tuple(request.prompt_logprobs)

    # -- tokens and finishing ----------------------------------------------------------------

    def _judge(
        self,
        sampling: SamplingParams,
        prompt_len: int,
        output_len: int,
        token: int,
        text: OutputText,
    ) -> tuple[tuple[int, ...], str, FinishReason | None]:
        """What output token ``output_len`` (1-based) returns: its ids, its text and the
        finish it causes (EOS or a stop id past ``min_tokens``, a stop string, the length)."""
        stops = token in sampling.stop_token_ids or (token in self._eos and not sampling.ignore_eos)
        if stops and output_len > sampling.min_tokens:
            return (), text.flush(), FinishReason.STOP
        released = text.add(token)
        if text.stopped:
            return (token,), released, FinishReason.STOP
        if (
            output_len >= sampling.max_tokens
            or prompt_len + output_len >= self.limits.max_model_len
        ):
            return (token,), released + text.flush(), FinishReason.LENGTH
        return (token,), released, None

    def _on_token(
        self,
        request: EngineRequest,
        token: int,
        logprobs: TokenLogprobs | None = None,
        more: tuple[FirstToken, ...] = (),
    ) -> None:
        request.output.append(token)
        returned, text, finish = self._judge(
            request.sampling, len(request.prompt), len(request.output), token, request.text
        )
        if request.kind == "prefill":
            self._finish_prefill(request, token, text, finish, logprobs, more)
            return
        self._emit(request, returned, text, finish, (logprobs,) if logprobs and returned else ())

    def _usage(self, request: EngineRequest) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt),
            completion_tokens=len(request.output),
            cached_tokens=request.cached_tokens,
        )

    def _emit(
        self,
        request: EngineRequest,
        token_ids: tuple[int, ...],
        text: str,
        finish: FinishReason | None,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        kv_s, request.kv_transfer_s = request.kv_transfer_s, None
        delta = TokenDelta(
            token_ids,
            text,
            finish,
            self._usage(request) if finish is not None else None,
            kv_transfer_s=kv_s,
            logprobs=logprobs,
            prompt_logprobs=self._take_prompt_logprobs(request),
            choice=request.choice,
        )
        self._deliver(request.sink, delta)
        if finish is not None:
            self._retire(request, finish)

    def _finish_prefill(
        self,
        request: EngineRequest,
        token: int,
        text: str,
        finish: FinishReason | None,
        logprobs: TokenLogprobs | None,
        more: tuple[FirstToken, ...] = (),
    ) -> None:
        now = self._clock()
        handle = None
        if finish is None or any(first.finish_reason is None for first in more):
            lease_s = self.limits.kv_lease_s
            handle = KVHandle(
                producer_engine_id=self.engine_id,
                generation=self.generation,
                request_id=request.request_id,
                block_ids=tuple(request.block_ids),
                num_tokens=len(request.prompt),
                lease_expires_at_s=self._wall_clock() + lease_s,
            )
            request.phase = Phase.HELD
            self._running.remove(request)
            self.outbox.append(HoldKV(request.request_id, tuple(request.block_ids), lease_s))
        self._deliver(
            request.sink,
            PrefillResult(
                request_id=request.request_id,
                first_token_id=token,
                # Held-back text stays held: the decode engine replays this token through its
                # own OutputText and releases it exactly where a colocated engine would.
                text=text,
                kv_handle=handle,
                finish_reason=finish,
                usage=self._usage(request),
                prefill_s=now - request.admitted_at,
                queue_s=request.admitted_at - request.arrived_at,
                logprobs=logprobs,
                prompt_logprobs=self._take_prompt_logprobs(request),
                more_choices=more,
            ),
        )
        if handle is None:
            assert finish is not None  # a handle is held unless every choice finished
            self._retire(request, finish)

    def _retire(self, request: EngineRequest, finish: FinishReason) -> None:
        """Finish a request whose blocks no rank is using any more."""
        self._metrics.finished(request.kind, finish.value)
        if request.phase is Phase.RUNNING:
            self._running.remove(request)
        elif request.phase is Phase.WAITING:
            self._waiting.remove(request)
        request.phase = Phase.DONE
        self._release_blocks(request)

    def _release_blocks(self, request: EngineRequest) -> None:
        if request.block_ids:
            self.allocator.free(request.block_ids)
            request.block_ids = []
        if request.reserved:
            self.allocator.free(request.reserved)
            request.reserved = []
        self._requests.pop(request.request_id, None)
        root = request.parent or request.request_id
        family = self._families.get(root)
        if family is not None and not any(i in self._requests for i in (root, *family)):
            del self._families[root]

    # -- remote KV -----------------------------------------------------------------------------

    def _start_pull(self, request: EngineRequest) -> None:
        handle = request.handle
        assert handle is not None  # submit checks
        request.phase = Phase.PULLING
        request.pull_started_at = self._clock()
        local = tuple(request.block_ids[: len(handle.block_ids)])
        self.outbox.append(
            PullKV(
                request_id=request.request_id,
                producer_engine=handle.producer_engine_id,
                producer_generation=handle.generation,
                remote_block_ids=handle.block_ids,
                local_block_ids=local,
                timeout_s=self.limits.kv_pull_timeout_s,
                connect_wait_s=self.limits.producer_connect_wait_s,
            )
        )

    def on_pull_done(self, event: PullDone) -> None:
        """One rank's pull ended; once every rank has reported, decode or fail the request."""
        request = self._requests.get(event.request_id)
        if request is None or request.phase is not Phase.PULLING:
            logger.warning("pull report for unknown request %s", event.request_id)
            return
        request.pull_reports[event.rank] = event
        if not event.ok and not request.cancelled and len(request.pull_reports) == 1:
            # The others cannot succeed as a whole any more: stop them early.
            assert request.handle is not None
            request.cancelled = True
            self.outbox.append(CancelPull(request.request_id, request.handle.producer_engine_id))
        if len(request.pull_reports) < len(self._ranks):
            return
        failures = [r for r in request.pull_reports.values() if not r.ok]
        aborted = request.sink is _ABORTED
        if failures or aborted:
            request.phase = Phase.DONE
            self._release_blocks(request)
            if aborted:
                return
            first = next((f for f in failures if f.reason != "cancelled"), failures[0])
            assert request.handle is not None  # a pulling request has one
            error: EngineError
            if first.reason in _UNAVAILABLE_REASONS:
                error = ProducerUnavailable(
                    f"producer {request.handle.producer_engine_id} "
                    f"unavailable for {request.request_id}: {first.reason} {first.message}"
                )
                self._metrics.kv_error("ProducerUnavailable", first.reason)
            else:
                error = KVTransferFailed(
                    f"KV pull of {request.request_id} failed on rank {first.rank}: "
                    f"{first.reason} {first.message}",
                    first.reason,
                )
                self._metrics.kv_error("KVTransferFailed", first.reason)
            self._metrics.finished("remote", FinishReason.ERROR.value)
            self._deliver(request.sink, error)
            return
        assert request.first_token_id is not None
        request.kv_transfer_s = self._clock() - request.pull_started_at
        request.num_computed = len(request.prompt)
        request.output = [request.first_token_id]
        if self.prefix_cache is not None:  # the pulled blocks hold the prompt's KV
            self.prefix_cache.insert(request.prompt, request.block_ids)
        request.phase = Phase.RUNNING
        self._running.append(request)
        forks = [self._fork(request, fork) for fork in request.forks]
        if forks:
            self._families[request.request_id] = tuple(fork.request_id for fork in forks)
        for sequence in (request, *forks):
            if len(sequence.output) >= sequence.sampling.max_tokens:
                self._emit(sequence, (), sequence.text.flush(), FinishReason.LENGTH)

    def _fork(self, request: EngineRequest, fork: Fork) -> EngineRequest:
        """Start fork ``fork`` of a pulled request: the prompt's full blocks shared, the rest
        of its blocks from the request's reservation (see the module docstring)."""
        full = len(request.prompt) // self.limits.block_size
        own = self._blocks_needed("remote", len(request.prompt), request.sampling) - full
        shared = request.block_ids[:full]
        self.allocator.incref(shared)
        blocks, request.reserved = request.reserved[:own], request.reserved[own:]
        sampling = request.sampling.for_choice(fork.choice - request.choice)
        child = EngineRequest(
            request_id=f"{request.request_id}#{fork.choice}",
            kind="remote",
            prompt=request.prompt,
            sampling=sampling,
            sink=request.sink,
            text=self._output_text(sampling, (fork.first_token_id,)),
            generator=make_generator(sampling.seed),
            first_token_id=fork.first_token_id,
            phase=Phase.RUNNING,
            block_ids=[*shared, *blocks],
            num_computed=full * self.limits.block_size,
            output=[fork.first_token_id],
            arrived_at=request.arrived_at,
            admitted_at=request.admitted_at,
            choice=fork.choice,
            parent=request.request_id,
        )
        self._requests[child.request_id] = child
        self._running.append(child)
        return child

    def on_lease_ended(self, event: LeaseEnded) -> None:
        """One producer rank let a held request go; free its blocks once every rank has."""
        request = self._requests.get(event.request_id)
        if request is None or request.phase is not Phase.HELD:
            logger.warning("lease report for unknown request %s", event.request_id)
            return
        request.lease_reports[event.rank] = event.outcome
        if len(request.lease_reports) < len(self._ranks):
            return
        outcomes = set(request.lease_reports.values())
        outcome = next(o for o in ("aborted", "expired", "released") if o in outcomes)
        self._metrics.held_ended(outcome)
        request.phase = Phase.DONE
        self._release_blocks(request)

    # -- abort and failure ---------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """Abort a request in any phase; ``False`` when unknown (or already finishing)."""
        request = self._requests.get(request_id)
        family = self._families.pop(request_id, ())
        found = any([self.abort(fork) for fork in family])
        if request is None or request.phase is Phase.DONE or request.cancelled:
            return found
        if request.phase is Phase.HELD:
            request.cancelled = True
            self.outbox.append(ReleaseKV(request_id))
            return True
        if request.phase is Phase.PULLING:
            assert request.handle is not None
            request.cancelled = True
            self._deliver(request.sink, self._abort_delta(request))
            self._metrics.finished(request.kind, FinishReason.ABORT.value)
            request.sink = _ABORTED
            self.outbox.append(CancelPull(request_id, request.handle.producer_engine_id))
            return True
        if request.kind == "prefill":
            self._deliver(
                request.sink, RequestAborted(f"request {request_id} aborted before its first token")
            )
        else:
            self._deliver(request.sink, self._abort_delta(request))
        self._retire(request, FinishReason.ABORT)
        return True

    def _abort_delta(self, request: EngineRequest) -> TokenDelta:
        return TokenDelta((), "", FinishReason.ABORT, self._usage(request), choice=request.choice)

    def abort_all(self) -> int:
        """Abort every request (drain's end); returns how many there were."""
        ids = [r.request_id for r in self._requests.values() if not r.cancelled]
        return sum(1 for request_id in ids if self.abort(request_id))

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every request gets ``error``; nothing is freed (no rank is left)."""
        for request in self._requests.values():
            if request.phase is not Phase.HELD and request.sink is not _ABORTED:
                self._deliver(request.sink, error)
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()


class _DiscardSink:
    def put(self, item: SinkItem) -> None:
        pass


_ABORTED = _DiscardSink()
