"""The reference engine's scheduler: admission, continuous batching, finishing, KV hand-off.

Pure bookkeeping with no processes: the engine loop (:mod:`~services.engines.reference.engine`)
feeds it requests and rank events and runs the steps it plans. It owns the engine's
:class:`~services.engines.reference.kv_blocks.KVBlocks` (the block allocator, engine-wide so that
block ids are the same on every rank as in vLLM, and the prefix cache), which picks each
request's blocks; the commands for the ranks (hold, release, pull, cancel) go to
:attr:`Scheduler.outbox`, which the loop sends to every rank.

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

Its parts: the request state and block arithmetic in
:mod:`~services.engines.reference.request_state`, a request's blocks in
:mod:`~services.engines.reference.kv_blocks`, sampling and finishing a token in
:mod:`~services.engines.reference.outputs`, the KV hand-off messages in
:mod:`~services.engines.reference.kv_handoff`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineOverloaded,
    RequestAborted,
)
from services.engines.reference.batch import SequenceChunk
from services.engines.reference.kv_blocks import KVBlocks
from services.engines.reference.kv_handoff import (
    held_handle,
    lease_outcome,
    pull_command,
    pull_error,
)
from services.engines.reference.messages import (
    CancelPull,
    HoldKV,
    HostCommand,
    LeaseEnded,
    PullDone,
    ReleaseKV,
)
from services.engines.reference.metrics import ReferenceEngineMetrics
from services.engines.reference.outputs import (
    TokenRules,
    abort_delta,
    add_prompt_logprobs,
    prefill_result,
    token_delta,
)
from services.engines.reference.request_state import (
    ABORTED,
    EngineRequest,
    Phase,
    PlannedStep,
    RequestKind,
    RequestSink,
    SchedulerLimits,
    SinkItem,
    StepEntry,
    forked,
)
from services.engines.reference.sampling import make_generator
from services.engines.requests import (
    FinishReason,
    FirstToken,
    Fork,
    KVHandle,
    SamplingParams,
    TokenLogprobs,
)
from services.tokenization.tokenizer import Tokenizer
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)


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
        record_kv_events: bool = False,
    ) -> None:
        self.engine_id = engine_id
        self.generation = generation
        self.limits = limits
        self.blocks = KVBlocks(limits, record_events=record_kv_events)
        self.outbox: list[HostCommand] = []
        """Commands for every rank, in order; the engine loop sends and clears them."""
        self.deliveries: list[tuple[RequestSink, SinkItem]] = []
        """Results for callers; the loop hands them over (:meth:`deliver_all`) once its load
        snapshot reflects the state that produced them."""
        self.draining = False
        self._ranks = tuple(world_ranks)
        self._rules = TokenRules(tokenizer, eos_token_ids, limits.max_model_len)
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
        limits.check(
            kind, prompt, sampling, handle=handle, first_token_id=first_token_id, forks=forks
        )
        choice = forks[0].choice if forks else 0
        if len(self._waiting) >= limits.max_queue:
            raise EngineOverloaded(f"queue full ({limits.max_queue} waiting)")
        released = (first_token_id,) if first_token_id is not None else ()
        request = EngineRequest(
            request_id=request_id,
            kind=kind,
            prompt=tuple(prompt),
            sampling=sampling.for_choice(choice) if forks else sampling,
            sink=sink,
            text=self._rules.output_text(sampling, released),
            generator=make_generator(sampling.for_choice(choice).seed),
            handle=handle,
            first_token_id=first_token_id,
            arrived_at=self._clock(),
            choice=choice,
            forks=forks[1:],
        )
        self._requests[request_id] = request
        self._waiting.append(request)

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

    def _admit(self) -> None:
        while self._waiting and self.running_count < self.limits.max_running:
            request = self._waiting[0]
            if not self.blocks.reserve(request):
                return  # head of line waits for blocks
            self._waiting.popleft()
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
                add_prompt_logprobs(request, entry.chunk.num_cached, rows)
            request.num_computed += length
            if request.pending_tokens == 0:
                if not request.output:
                    self.blocks.prompt_computed(request)
                token, logprobs, more = self._rules.next_token(request, rows[-1])
                self._on_token(request, token, logprobs, more)

    # -- tokens and finishing ----------------------------------------------------------------

    def _on_token(
        self,
        request: EngineRequest,
        token: int,
        logprobs: TokenLogprobs | None = None,
        more: tuple[FirstToken, ...] = (),
    ) -> None:
        request.output.append(token)
        returned, text, finish = self._rules.judge(
            request.sampling, len(request.prompt), len(request.output), token, request.text
        )
        if request.kind == "prefill":
            self._finish_prefill(request, token, text, finish, logprobs, more)
            return
        self._emit(request, returned, text, finish, (logprobs,) if logprobs and returned else ())

    def _emit(
        self,
        request: EngineRequest,
        token_ids: tuple[int, ...],
        text: str,
        finish: FinishReason | None,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        delta = token_delta(request, token_ids, text, finish, logprobs)
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
            handle = held_handle(
                request, self.engine_id, self.generation, self._wall_clock() + lease_s
            )
            request.phase = Phase.HELD
            self._running.remove(request)
            self.outbox.append(HoldKV(request.request_id, tuple(request.block_ids), lease_s))
        self._deliver(
            request.sink,
            prefill_result(
                request, token, text, handle, finish, logprobs, more, now - request.admitted_at
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
        self.blocks.release(request)
        self._requests.pop(request.request_id, None)
        root = request.parent or request.request_id
        family = self._families.get(root)
        if family is not None and not any(i in self._requests for i in (root, *family)):
            del self._families[root]

    # -- remote KV -----------------------------------------------------------------------------

    def _start_pull(self, request: EngineRequest) -> None:
        request.phase = Phase.PULLING
        request.pull_started_at = self._clock()
        self.outbox.append(pull_command(request, self.limits))

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
        aborted = request.sink is ABORTED
        if failures or aborted:
            request.phase = Phase.DONE
            self._release_blocks(request)
            if aborted:
                return
            error = pull_error(request, failures, self._metrics)
            self._metrics.finished("remote", FinishReason.ERROR.value)
            self._deliver(request.sink, error)
            return
        assert request.first_token_id is not None
        request.kv_transfer_s = self._clock() - request.pull_started_at
        request.num_computed = len(request.prompt)
        request.output = [request.first_token_id]
        self.blocks.prompt_pulled(request)
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
        blocks, computed = self.blocks.fork(request)
        sampling = request.sampling.for_choice(fork.choice - request.choice)
        text = self._rules.output_text(sampling, (fork.first_token_id,))
        child = forked(request, fork, sampling, text, blocks, computed)
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
        outcome = lease_outcome(request.lease_reports.values())
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
            self._deliver(request.sink, abort_delta(request))
            self._metrics.finished(request.kind, FinishReason.ABORT.value)
            request.sink = ABORTED
            self.outbox.append(CancelPull(request_id, request.handle.producer_engine_id))
            return True
        if request.kind == "prefill":
            self._deliver(
                request.sink, RequestAborted(f"request {request_id} aborted before its first token")
            )
        else:
            self._deliver(request.sink, abort_delta(request))
        self._retire(request, FinishReason.ABORT)
        return True

    def abort_all(self) -> int:
        """Abort every request (drain's end); returns how many there were."""
        ids = [r.request_id for r in self._requests.values() if not r.cancelled]
        return sum(1 for request_id in ids if self.abort(request_id))

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every request gets ``error``; nothing is freed (no rank is left)."""
        for request in self._requests.values():
            if request.phase is not Phase.HELD and request.sink is not ABORTED:
                self._deliver(request.sink, error)
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()
