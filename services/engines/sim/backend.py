"""``SimBackend``: a GPU engine's timing from a profile, with no compute (engine name "sim").

For fleets on a small machine: the planner and ``bench goodput`` put dozens of these behind the
real router and control plane. It registers, publishes a synthetic grid and turns READY, hands
out KV handles, streams, aborts, fails and drains as the stub does (both are
:class:`~services.engines.synthetic.SyntheticEngine`: same grid, handles, tokens and text), but
every token comes when a real engine's would: one asyncio task per engine runs the step loop of
:class:`~.scheduler.SimScheduler` (vLLM's admission, token budget, KV blocks, chunked prefill),
sleeping for each step's duration from the :class:`~.profile.SimProfile`, then handing one
token to every sequence the step sampled. It never spins: an idle engine waits on an event.

Roles follow the calls, as for every backend: :meth:`SimBackend.prefill` computes the prompt
and samples one token (a prefill engine; its blocks are freed once the token is out, see the
scheduler's docstring), :meth:`SimBackend.decode` with a handle starts from the prompt's KV
pulled from the producer and without one prefills the prompt itself,
sharing steps with the other sequences' decode tokens (colocated: the interference). With a
profile's ``kv_transfer``, a decode with a handle first waits for its prompt's KV to move
(reported as the first delta's ``kv_transfer_s``); without one the KV is there at once.

Prefix cache (``prefix_caching``, on by default as in vLLM; :mod:`.prefix_cache`): a prompt's
cached prefix is not computed (nor charged), its tokens are reported as ``cached_tokens`` in
the usage; a decode with a handle moves only the prompt tokens its own cache lacks (the
transfer time and ``pdserve_kv_transfer_bytes_total`` count those) and caches the prompt it
then holds, so decode-side reuse and local runs work on a fleet as on real engines. The cache's
changes are published as KV events on vLLM's wire protocol (``kv_events``;
:class:`~services.kv_events.publisher.KVEventPublisher`, one batch per step with changes,
bound on the first :meth:`describe` so the registered spec carries its ports), and the load
record reports the most recently used block keys, as the reference engine's.

Time: the scheduler's clock is simulated (the sum of step durations); ``prefill_s`` and
``queue_s`` of a prefill are read from it, so they follow the profile whatever the machine's
load. Wall time between tokens is at least the simulated time (a loaded event loop only adds).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.control_plane.wire import MAX_REPORTED_BLOCKS, EngineLoad, compute_compat_hash
from services.engines.backend import BackendDescription
from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineFailed,
    EngineOverloaded,
    RequestAborted,
)
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    Usage,
)
from services.engines.sim.prefix_cache import SimPrefixCache
from services.engines.sim.profile import SimProfile, load_profile
from services.engines.sim.scheduler import SimScheduler, SimSequence
from services.engines.synthetic import SyntheticClaim, SyntheticEngine
from services.kv_events.publisher import KVEventPublisher, PublisherMetrics
from services.kv_transfer.metrics import KVTransferMetrics, RankPair

logger = logging.getLogger(__name__)

SIM_KIND = "sim"

MAX_CATCH_UP_S = 0.02
"""How far behind its simulated time an engine's steps may run and still be made up."""


@dataclass(frozen=True)
class SimOptions:
    """The simulated engine: its profile and what the command line may override."""

    profile: SimProfile = field(default_factory=load_profile)
    pp_size: int = 1
    tp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    num_kv_blocks: int | None = None
    """Default: the profile's."""
    block_size: int | None = None
    """Default: the profile's."""
    kv_lease_s: float = 30.0
    max_waiting: int = 4096
    """Requests queued at most; beyond, admission is refused (``EngineOverloaded``)."""
    time_scale: float = 1.0
    """Wall seconds slept per simulated second (1: real time; < 1 runs a simulation faster,
    every figure it reports still in simulated time)."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (:mod:`.prefix_cache`)."""
    kv_events: bool = True
    """Publish the prefix cache's KV events (with ``prefix_caching``)."""


class _Aborted:
    """Put in a stream's queue when its request is aborted or drained."""


_ABORTED = _Aborted()
_Event = int | _Aborted | EngineFailed
"""A stream's events: the count of tokens sampled so far, an abort, or the engine's failure."""


@dataclass
class _Stream:
    sequence: SimSequence
    events: asyncio.Queue[_Event] = field(default_factory=asyncio.Queue)
    aborted: bool = False


class SimBackend(SyntheticEngine):
    """See the module docstring."""

    def __init__(
        self, options: SimOptions | None = None, *, registry: CollectorRegistry | None = None
    ) -> None:
        self.options = options or SimOptions()
        profile = self.options.profile
        block_size = self.options.block_size or profile.kv_cache.block_size
        num_blocks = self.options.num_kv_blocks or profile.kv_cache.num_blocks
        shape = dataclasses.replace(
            profile.model.shape,
            block_size=block_size,
            pp_size=self.options.pp_size,
            tp_size=self.options.tp_size,
            layer_partition=self.options.layer_partition,
        )
        super().__init__(
            SyntheticClaim(
                engine_kind=SIM_KIND,
                model=profile.served_model,
                compat_hash=compute_compat_hash(
                    shape, model=profile.served_model, kv_layout="HND", engine_kind=SIM_KIND
                ),
                shape=shape,
                num_kv_blocks=num_blocks,
                kv_lease_s=self.options.kv_lease_s,
                kv_block_bytes=profile.kv_bytes_per_token * block_size,
            )
        )
        self._registry = registry if registry is not None else CollectorRegistry()
        self.prefix_cache = (
            SimPrefixCache(block_size, record_events=self.options.kv_events)
            if self.options.prefix_caching
            else None
        )
        self.scheduler = SimScheduler(
            profile, num_blocks=num_blocks, block_size=block_size, prefix_cache=self.prefix_cache
        )
        self.transfer_metrics = KVTransferMetrics(self._registry)
        self._kv_events: KVEventPublisher | None = None
        self._stopped = False
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._failure: EngineFailed | None = None
        self._loop_task: asyncio.Task[None] | None = None

    def describe(self) -> BackendDescription:
        publisher = self._kv_event_publisher()
        if publisher is None:
            return super().describe()
        return dataclasses.replace(
            super().describe(),
            kv_events_endpoint=publisher.endpoints.events,
            kv_events_replay_endpoint=publisher.endpoints.replay,
        )

    def _kv_event_publisher(self) -> KVEventPublisher | None:
        """The engine's publisher, bound on first use (``None`` when events are off)."""
        if self._kv_events is None and self.prefix_cache is not None and self.options.kv_events:
            if self._stopped:
                return None
            self._kv_events = KVEventPublisher(
                metrics=PublisherMetrics(self._registry), name="pdserve-sim-kv-events"
            )
        return self._kv_events

    def _publish_events(self) -> None:
        """One batch of the cache's changes since the last (none when nothing changed)."""
        if self.prefix_cache is None:
            return
        events = self.prefix_cache.take_events()
        if events and self._kv_events is not None:
            self._kv_events.publish(events)

    @property
    def failure(self) -> EngineFailed | None:
        """Set once the step loop died or :meth:`fail` was called (the host exits)."""
        return self._failure

    def fail(self, reason: str) -> None:
        """Fail the engine as a dead rank would: every request in flight ends with
        ``EngineFailed``, new ones are refused, the host sees :attr:`failure` and exits."""
        if self._failure is not None:
            return
        self._failure = EngineFailed(f"sim engine failed: {reason}")
        logger.error("%s", self._failure)
        for request_id, stream in list(self._streams.items()):
            self.scheduler.remove(request_id)
            stream.events.put_nowait(self._failure)
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()

    # --- the step loop -------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run_steps(), name="sim-steps")
        self._wake.set()

    async def _run_steps(self) -> None:
        """Steps end on deadlines (the start of busy time plus the simulated time since), not
        after a sleep each: a sleep that overran (a busy loop wakes late) is made up by the
        next steps, so wall time tracks simulated time instead of drifting a little later
        every step. A step never ends before its deadline (wall time >= simulated time), and
        a lag beyond :data:`MAX_CATCH_UP_S` is dropped rather than made up in a burst."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while True:
                plan = self.scheduler.schedule()
                if plan.empty:
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                    continue
                deadline = max(deadline, loop.time() - MAX_CATCH_UP_S)
                deadline += plan.duration_ms / 1000 * self.options.time_scale
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                outcome = self.scheduler.commit(plan)
                self._publish_events()
                for sequence in outcome.sampled:
                    stream = self._streams.get(sequence.request_id)
                    if stream is not None:
                        stream.events.put_nowait(sequence.generated)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the simulation: fail loudly, as a dead rank
            logger.exception("the sim engine's step loop died")
            self.fail(f"the step loop died: {exc!r}")

    # --- admission -----------------------------------------------------------------------

    def _admit(self, sequence: SimSequence, *, queue: bool = True) -> _Stream:
        """Register a request; ``queue``: hand it to the scheduler now (else :meth:`_queue`
        does, once its KV arrived)."""
        if self._failure is not None:
            raise self._failure
        if self._draining:
            raise EngineDraining("the engine is draining and admits no new request")
        if sequence.request_id in self._streams:
            raise DuplicateRequest(f"request {sequence.request_id} is already running")
        if not self.scheduler.fits_ever(sequence.prompt_len):
            raise EngineOverloaded(
                f"a prompt of {sequence.prompt_len} tokens needs more KV blocks than the "
                f"engine's {self.scheduler.num_blocks}"
            )
        if len(self.scheduler.waiting) >= self.options.max_waiting:
            raise EngineOverloaded(f"queue full: {self.options.max_waiting} requests waiting")
        stream = _Stream(sequence)
        self._streams[sequence.request_id] = stream
        self._idle.clear()
        if queue:
            self._queue(stream)
        return stream

    def _queue(self, stream: _Stream) -> None:
        self.scheduler.add(stream.sequence)
        self._ensure_loop()

    def _release(self, request_id: str) -> None:
        self.scheduler.remove(request_id)
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    async def _next(self, stream: _Stream) -> int | None:
        """Tokens sampled so far after the next step that sampled one; ``None`` when the
        request was aborted. Raises the engine's failure."""
        event = await stream.events.get()
        if isinstance(event, EngineFailed):
            raise event
        if isinstance(event, _Aborted):
            return None
        return event

    # --- the seam ------------------------------------------------------------------------

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        prompt, sampling = request.prompt_token_ids, request.sampling
        sequence = SimSequence(
            request.request_id, len(prompt), max_new_tokens=1, prompt=tuple(prompt)
        )
        stream = self._admit(sequence)
        try:
            if await self._next(stream) is None:
                raise RequestAborted(f"request {request.request_id} aborted before its first token")
            token = self._first_token(prompt)
            finish = FinishReason.LENGTH if sampling.max_tokens == 1 else None
            if token in sampling.stop_token_ids:
                finish = FinishReason.STOP
            handle = None
            if finish is None:
                handle = self._hold(
                    request.request_id, self.scheduler.blocks_for(len(prompt)), len(prompt)
                )
            first_token_ms = sequence.first_token_ms or 0.0
            scheduled_ms = sequence.first_scheduled_ms or 0.0
            return PrefillResult(
                request_id=request.request_id,
                first_token_id=token,
                text=self.detokenize([token]),
                kv_handle=handle,
                finish_reason=finish,
                usage=self._usage(sequence, 1),
                prefill_s=(first_token_ms - scheduled_ms) / 1000,
                queue_s=(scheduled_ms - sequence.arrived_ms) / 1000,
            )
        finally:
            self._release(request.request_id)

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        sampling = request.sampling
        prompt_len = len(request.prompt_token_ids)
        remote = request.kv_handle is not None and request.first_token_id is not None
        sequence = SimSequence(
            request.request_id,
            prompt_len,
            max_new_tokens=sampling.max_tokens,
            generated=1 if remote else 0,
            computed=prompt_len if remote else 0,
            prompt=tuple(request.prompt_token_ids),
        )
        if sequence.generated >= sequence.max_new_tokens:
            yield self._last(request, sequence.generated, FinishReason.LENGTH)
            return
        transfer_ms = 0.0
        if remote:
            assert request.kv_handle is not None
            # Only what this engine's cache lacks moves (it may evict meanwhile: a miss then
            # costs nothing here, a simplification).
            moved = prompt_len - self.scheduler.cached_prefix_tokens(sequence)
            transfer_ms = self.options.profile.transfer_ms(moved)
            self._count_moved(request.kv_handle.producer_engine_id, moved)
        stream = self._admit(sequence, queue=not transfer_ms)
        try:
            if remote:
                assert request.first_token_id is not None
                token = request.first_token_id
                transfer_s: float | None = transfer_ms / 1000
                if transfer_ms:
                    # The prompt's KV moves before the request is scheduled (its blocks are
                    # taken at admission after it, not during the transfer: a simplification).
                    await asyncio.sleep(transfer_ms / 1000 * self.options.time_scale)
                    if self._failure is not None:
                        raise self._failure
                    if stream.aborted:
                        yield self._last(request, sequence.generated, FinishReason.ABORT)
                        return
                    self._queue(stream)
            else:
                token = self._first_token(request.prompt_token_ids) - 1
                transfer_s = None
            generated = sequence.generated
            while generated < sampling.max_tokens:
                if await self._next(stream) is None:
                    yield self._last(request, generated, FinishReason.ABORT)
                    return
                token = self._next_token(token)
                if token in sampling.stop_token_ids:
                    yield self._end(request, sequence, generated, FinishReason.STOP, remote)
                    return
                cached = None
                if not remote and generated == 0:  # a local run says so from its first chunk
                    cached = sequence.cached_tokens or 0
                generated += 1
                yield TokenDelta(
                    (token,),
                    self.detokenize([token]),
                    kv_transfer_s=transfer_s,
                    cached_tokens=cached,
                )
                transfer_s = None
            yield self._end(request, sequence, generated, FinishReason.LENGTH, remote)
        finally:
            self._release(request.request_id)

    def _usage(self, sequence: SimSequence, generated: int) -> Usage:
        """vLLM's counts: the prompt tokens found cached, and the full prompt blocks beyond
        them that this request computed and cached."""
        cached = sequence.cached_tokens or 0
        block = self.scheduler.block_size
        full = sequence.prompt_len // block * block if self.prefix_cache is not None else 0
        return Usage(
            prompt_tokens=sequence.prompt_len,
            completion_tokens=generated,
            cached_tokens=cached,
            cache_write_tokens=max(0, full - cached),
        )

    def _end(
        self,
        request: DecodeRequest,
        sequence: SimSequence,
        generated: int,
        reason: FinishReason,
        remote: bool,
    ) -> TokenDelta:
        """A decode stream's last delta; a local run's usage counts its cache."""
        if remote:
            return self._last(request, generated, reason)
        return TokenDelta((), "", reason, self._usage(sequence, generated))

    def _count_moved(self, producer: str, tokens: int) -> None:
        # (an engine driven in process without start() has no id of its own)
        consumer = self._registration.engine_id if self._registration else "unregistered"
        pair = RankPair(producer, consumer, (0, 0), (0, 0))
        moved = tokens * self.options.profile.kv_bytes_per_token
        self.transfer_metrics.transferred_bytes.labels(**pair.labels()).inc(moved)

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.scheduler.remove(request_id)
            stream.aborted = True
            stream.events.put_nowait(_ABORTED)
            return True
        return self._drop_held(request_id)

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_depth=len(self.scheduler.waiting),
            running_requests=len(self.scheduler.running),
            kv_blocks_free=self.scheduler.available_blocks,
            kv_blocks_total=self.scheduler.num_blocks,
            prefix_cache_reported=self.prefix_cache is not None,
            cached_block_hashes=(
                self.prefix_cache.recent_keys(MAX_REPORTED_BLOCKS)
                if self.prefix_cache is not None
                else ()
            ),
            kv_events_seq=-1 if self._kv_events is None else self._kv_events.next_seq - 1,
        )

    def _in_flight(self) -> list[str]:
        return list(self._streams)

    async def stop(self) -> None:
        self._stopped = True
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._kv_events is not None:  # after the loop: its last batch is sent first
            await asyncio.to_thread(self._kv_events.close)
        await super().stop()
