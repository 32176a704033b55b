"""``ReferenceBackend``: the CPU reference engine behind the :class:`EngineBackend` seam.

Process shape (like vLLM's multiprocess executor): the host process (the service that owns the
backend) runs the scheduler on one thread (:mod:`~services.engines.reference.engine`) and one
process per ``(pp_rank, tp_rank)`` (:mod:`~services.engines.reference.rank`) runs the model
shard, owns its KV pool and NIXL agent, and publishes its handshake record. The backend's
coroutines only hand work to the engine thread and await results, so the host's event
loop is never blocked.

Roles: every engine can run a request start to finish (``decode`` without a KV handle);
``prefill`` needs the role ``prefill`` or ``both`` (the KV is held for a consumer), ``decode``
with a KV handle needs ``decode`` or ``both`` (the ranks pull it from the producer, pre-warmed
by PeerSync when the producer turned READY).

KV-cache events (``options.kv_events`` with prefix caching): the host process owns the
scheduler and its prefix cache, so it alone publishes, whatever the PP x TP grid
(:class:`~services.kv_events.publisher.KVEventPublisher`, one batch per engine step with cache
changes). The publisher binds on the first :meth:`describe` so the spec the host registers
carries its ports; :meth:`stop` closes it.

Requests arrive valid (the contracts of :class:`PrefillRequest` and :class:`DecodeRequest`) and
a handle's producer was checked by the Decode RPC (READY at the handle's generation, a
compatible KV producer of the same block size: :meth:`EngineBackend.decode`). Before a pull the
backend refuses only what it alone can tell: a lease already past is :class:`KVLeaseExpired`. A
producer that simply no longer holds the handle cannot be told from one that does without asking
it (there is no side channel besides NIXL); :class:`UnknownKVHandle` is therefore raised only for
handles that cannot be right (naming this very engine, or with a block count that does not match
their tokens). Every refusal and pull failure is counted in
``pdserve_reference_engine_kv_errors_total{error, reason}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from services.control_plane.wire import EngineLoad, compute_compat_hash
from services.engines.backend import (
    BackendDescription,
    EngineBackend,
    EngineRegistration,
    kv_block_bytes,
)
from services.engines.errors import (
    CheckpointError,
    EngineFailed,
    InvalidRequest,
    KVLeaseExpired,
    UnknownKVHandle,
)
from services.engines.reference.config import ModelConfig
from services.engines.reference.engine import EngineLoop, LoadSnapshot
from services.engines.reference.executor import RankGroup
from services.engines.reference.metrics import RankMetricsRelay, ReferenceEngineMetrics
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.request_state import RequestKind, SchedulerLimits, SinkItem
from services.engines.reference.scheduler import Scheduler
from services.engines.reference.sharding import ShardGeometry, ShardSpec
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    Fork,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    SamplingParams,
    TokenDelta,
)
from services.engines.trace_context import TraceContext
from services.kv_events.publisher import KVEventPublisher, PublisherMetrics
from services.kv_transfer.block_pool import KV_LAYOUT
from services.tokenization.errors import TokenizerFilesError
from services.tokenization.tokenizer import Tokenizer, load_tokenizer
from services.topology import ModelShape

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _AsyncSink:
    """A request's results, carried from the engine thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.items: asyncio.Queue[SinkItem] = asyncio.Queue()

    def put(self, item: SinkItem) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self.items.put_nowait, item)


class ReferenceBackend(EngineBackend):
    """The reference engine; see the module docstring. One instance serves one generation:
    after :meth:`stop`, build a new one to start again."""

    forks_decode = True

    def __init__(
        self, options: ReferenceEngineOptions, *, registry: CollectorRegistry | None = None
    ) -> None:
        """Reads the config and tokenizer and checks the layout (``ModelConfigError``,
        ``ShardingError``, ``CheckpointError``); starts nothing. With ``start_method="fork"``
        this process's torch work runs on one thread from here on (see the option)."""
        self.options = options
        if options.start_method == "fork":
            torch.set_num_threads(1)
        self.config = ModelConfig.from_directory(options.model_dir)
        self.layout = options.validate(self.config)
        for rank in self.layout.shards:
            ShardGeometry.resolve(self.config, ShardSpec.from_layout(self.layout, *rank))
        try:
            self.tokenizer: Tokenizer = load_tokenizer(options.model_dir)
        except TokenizerFilesError as exc:
            raise CheckpointError(str(exc)) from exc
        # The tokenizer's ids include config.json's and generation_config.json's eos_token_id.
        self.eos_token_ids = self.tokenizer.eos_token_ids
        config = self.config
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_size=config.head_dim,
            dtype=options.dtype,
            vocab_size=config.vocab_size,
            max_model_len=config.max_position_embeddings,
            block_size=options.block_size,
            pp_size=options.pp_size,
            tp_size=options.tp_size,
            layer_partition=options.layer_partition,
        )
        """The model's shape as this engine runs it (described; its compat hash's fields)."""
        self.compat_hash = compute_compat_hash(
            self.shape, model=options.served_model_name(), kv_layout=KV_LAYOUT
        )
        self.relay = RankMetricsRelay()
        self._registry = registry
        self.metrics: ReferenceEngineMetrics | None = None
        self.registration: EngineRegistration | None = None
        self._engine: EngineLoop | None = None
        self._stopped = False
        self._kv_events: KVEventPublisher | None = None

    # -- the seam ------------------------------------------------------------------------------

    def describe(self) -> BackendDescription:
        publisher = self._kv_event_publisher()
        return BackendDescription(
            model=self.options.served_model_name(),
            compat_hash=self.compat_hash,
            shape=self.shape,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            kv_events_endpoint=publisher.endpoints.events if publisher else "",
            kv_events_replay_endpoint=publisher.endpoints.replay if publisher else "",
            kv_block_bytes=kv_block_bytes(self.shape),
        )

    def _kv_event_publisher(self) -> KVEventPublisher | None:
        """The engine's publisher, bound on first use (``None`` when events are off)."""
        options = self.options
        if self._kv_events is None and options.kv_events and options.prefix_caching:
            if self._stopped:
                return None
            self._kv_events = KVEventPublisher(
                metrics=PublisherMetrics(self._registry),
                name="pdserve-kv-events",
            )
        return self._kv_events

    async def start(self, registration: EngineRegistration) -> None:
        if self._engine is not None or self._stopped:
            raise EngineFailed("a ReferenceBackend starts once; build a new one to restart")
        self.registration = registration
        self.metrics = ReferenceEngineMetrics(registration.engine_id, self._registry)
        group = RankGroup(self.options, registration, self.compat_hash)
        try:
            await asyncio.to_thread(self._start_ranks, group)
        except BaseException:
            await asyncio.to_thread(group.kill)
            raise
        options = self.options
        publisher = self._kv_event_publisher()
        scheduler = Scheduler(
            engine_id=registration.engine_id,
            generation=registration.generation,
            world_ranks=group.ranks,
            limits=SchedulerLimits(
                num_blocks=options.num_kv_blocks,
                block_size=options.block_size,
                max_model_len=self.config.max_position_embeddings,
                max_batch_tokens=options.max_batch_tokens,
                max_running=options.max_running,
                max_queue=options.max_queue,
                kv_lease_s=options.kv_lease_s,
                kv_pull_timeout_s=options.kv_pull_timeout_s,
                producer_connect_wait_s=options.producer_connect_wait_s,
                prefix_caching=options.prefix_caching,
            ),
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            metrics=self.metrics,
            record_kv_events=publisher is not None,
        )
        self._engine = EngineLoop(
            group,
            scheduler,
            self.relay,
            stop_timeout_s=options.stop_timeout_s,
            kv_events=publisher,
        )
        self._engine.start()
        logger.info(
            "reference engine %s@%d up: PP=%d TP=%d, %d KV blocks of %d tokens",
            registration.engine_id,
            registration.generation,
            options.pp_size,
            options.tp_size,
            options.num_kv_blocks,
            options.block_size,
        )

    async def republish(self, registration: EngineRegistration) -> None:
        """Every rank publishes its handshake again under the new generation (same agents,
        same memory); handles made from now on carry it. Consumers refuse handles of the old
        generation (the Decode RPC's producer gate); their blocks are freed
        when the lease runs out."""
        engine = self._running_engine()
        current = self._running_registration()
        if (registration.engine_id, registration.role) != (current.engine_id, current.role):
            raise EngineFailed("republish must keep the engine id and role of start()")
        await asyncio.wrap_future(engine.republish(registration))
        self.registration = registration
        logger.info(
            "reference engine %s republished its handshakes at generation %d",
            registration.engine_id,
            registration.generation,
        )

    def _start_ranks(self, group: RankGroup) -> None:
        group.start()
        group.wait_ready(self.options.start_timeout_s)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        registration = self._running_registration()
        if not registration.role.produces_kv:
            raise InvalidRequest(
                f"engine {registration.engine_id} has role {registration.role}: it does not "
                "prefill for other engines (decode without a kv_handle runs locally)"
            )
        request_id = request.request_id
        _log_trace("prefill", request_id, request.trace)
        sink = _AsyncSink(asyncio.get_running_loop())
        await self._submit(request_id, "prefill", request.prompt_token_ids, request.sampling, sink)
        try:
            item = await sink.items.get()
        except asyncio.CancelledError:
            await self._abort_quietly(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        if not isinstance(item, PrefillResult):  # pragma: no cover - scheduler contract
            raise EngineFailed(f"prefill of {request_id} got {type(item).__name__}")
        return item

    def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        return self._decode(request)

    async def _decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        registration = self._running_registration()
        kind: RequestKind = "generate"
        if request.kv_handle is not None:
            if not registration.role.consumes_kv:
                raise InvalidRequest(
                    f"engine {registration.engine_id} has role {registration.role}: it does "
                    "not decode from remote KV"
                )
            self._check_handle(request.kv_handle)
            kind = "remote"
        _log_trace(kind, request.request_id, request.trace)
        sink = _AsyncSink(asyncio.get_running_loop())
        await self._submit(
            request.request_id,
            kind,
            request.prompt_token_ids,
            request.sampling,
            sink,
            handle=request.kv_handle,
            first_token_id=request.first_token_id,
            forks=request.forks,
        )
        finished = False
        left = request.sequences  # each fork ends with its own finish
        try:
            while True:
                item = await sink.items.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if not isinstance(item, TokenDelta):  # pragma: no cover - scheduler contract
                    raise EngineFailed(f"decode of {request.request_id} got a prefill result")
                if item.finish_reason is not None:
                    left -= 1
                    finished = left == 0 or item.finish_reason is FinishReason.ERROR
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self._abort_quietly(request.request_id)

    async def abort(self, request_id: str) -> bool:
        engine = self._running_engine()
        scheduler = engine.scheduler
        return await asyncio.wrap_future(engine.call(lambda: scheduler.abort(request_id)))

    def load(self) -> EngineLoad:
        if self._engine is None:
            return EngineLoad(0, 0, self.options.num_kv_blocks, self.options.num_kv_blocks)
        snap = self._engine.snapshot
        return EngineLoad(
            queue_depth=snap.queue_depth,
            running_requests=snap.running,
            kv_blocks_free=snap.free_blocks,
            kv_blocks_total=snap.total_blocks,
            prefix_cache_reported=snap.cached_blocks is not None,
            cached_block_hashes=snap.cached_blocks or (),
            kv_events_seq=-1 if self._kv_events is None else self._kv_events.next_seq - 1,
        )

    async def drain(self, timeout_s: float) -> int:
        engine = self._running_engine()
        scheduler = engine.scheduler

        def start_draining() -> tuple[int, LoadSnapshot]:
            scheduler.draining = True
            return scheduler.in_flight, engine.snapshot

        # From here on nothing is admitted, so in_flight only falls. Snapshots the loop takes
        # after this call count it; the one current while it ran may predate it.
        in_flight, before = await asyncio.wrap_future(engine.call(start_draining))
        deadline = time.monotonic() + timeout_s
        while in_flight > 0:
            if time.monotonic() >= deadline:
                return await asyncio.wrap_future(engine.call(scheduler.abort_all))
            await asyncio.sleep(0.02)
            self._running_engine()  # the engine failed or was stopped meanwhile: raise
            snapshot = engine.snapshot
            if snapshot is not before:
                in_flight = snapshot.in_flight
        return 0

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._engine is not None:
            self._engine.stop()
            await asyncio.to_thread(self._engine.join)
        if self._kv_events is not None:  # after the loop: its last batch is sent first
            await asyncio.to_thread(self._kv_events.close)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    # -- for the service -----------------------------------------------------------------------

    def metrics_collector(self) -> Collector:
        """The ranks' ``pdserve_kv_transfer_*`` families, relayed (register it in the registry
        the service serves on ``/metrics``)."""
        return self.relay

    @property
    def failure(self) -> EngineFailed | None:
        """Why the engine failed (a rank died), once it has; the host must then exit."""
        return None if self._engine is None else self._engine.failure

    @property
    def kv_event_publisher(self) -> KVEventPublisher | None:
        """The bound publisher (``None``: events off or :meth:`describe` not called yet)."""
        return self._kv_events

    def rank_pids(self) -> dict[tuple[int, int], int]:
        """``(pp_rank, tp_rank) -> pid`` of the rank processes (tests, diagnostics)."""
        return {} if self._engine is None else self._engine.group.pids()

    # -- helpers -------------------------------------------------------------------------------

    def _running_engine(self) -> EngineLoop:
        if self._engine is None:
            raise EngineFailed("the engine is not started")
        if self._engine.failure is not None:
            raise self._engine.failure
        if self._stopped:
            raise EngineFailed("the engine is stopped")
        return self._engine

    def _running_registration(self) -> EngineRegistration:
        self._running_engine()
        assert self.registration is not None
        return self.registration

    async def _submit(
        self,
        request_id: str,
        kind: RequestKind,
        prompt: Sequence[int],
        sampling: SamplingParams,
        sink: _AsyncSink,
        *,
        handle: KVHandle | None = None,
        first_token_id: int | None = None,
        forks: tuple[Fork, ...] = (),
    ) -> None:
        engine = self._running_engine()
        scheduler = engine.scheduler
        prompt_ids = tuple(int(t) for t in prompt)

        def submit() -> None:
            scheduler.submit(
                request_id,
                kind,
                prompt_ids,
                sampling,
                sink,
                handle=handle,
                first_token_id=first_token_id,
                forks=forks,
            )

        await asyncio.wrap_future(engine.call(submit))

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(EngineFailed):
            await self.abort(request_id)

    def _check_handle(self, handle: KVHandle) -> None:
        """Refuse a handle this engine cannot pull (see the module docstring)."""
        assert self.metrics is not None and self.registration is not None
        metrics = self.metrics

        def refuse(error: Callable[[str], Exception], reason: str, message: str) -> Exception:
            metrics.kv_error(getattr(error, "__name__", "error"), reason)
            return error(message)

        expected_blocks = -(-handle.num_tokens // self.options.block_size)
        if len(handle.block_ids) != expected_blocks:
            raise refuse(
                UnknownKVHandle,
                "block_count",
                f"the kv_handle has {len(handle.block_ids)} blocks for {handle.num_tokens} "
                f"tokens; {expected_blocks} blocks of {self.options.block_size} expected",
            )
        if handle.producer_engine_id == self.registration.engine_id:
            raise refuse(
                UnknownKVHandle,
                "own_handle",
                "the kv_handle names this engine; decode without a handle to run locally",
            )
        if time.time() >= handle.lease_expires_at_s:
            raise refuse(
                KVLeaseExpired,
                "lease_expired",
                f"the lease of {handle.request_id} on {handle.producer_engine_id} ran out",
            )


def _log_trace(kind: str, request_id: str, trace: TraceContext | None) -> None:
    """The reference engine makes no spans: it names the caller's trace in its log (DEBUG), so
    its lines can be joined with the trace of the request (issue 33)."""
    if trace is not None and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s: trace %s", kind, request_id, trace.trace_id)


__all__ = ["FinishReason", "ReferenceBackend", "ReferenceEngineOptions"]
