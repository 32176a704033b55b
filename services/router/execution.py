"""Running one request on the engines a :class:`~services.router.scheduler.Plan` names.

:meth:`Executor.generate` is an async generator of :class:`Chunk`. The HTTP layer awaits the
first chunk before it answers, so every failure up to the first token (no engine, every
prefill attempt failed, a decode engine refusing the request) is an ordinary OpenAI error;
a failure after it raises :class:`~services.router.errors.EngineRequestFailed` from the
generator, which the streaming layer turns into an error event (never a silent truncation).

Disaggregated: Prefill on the prefill engine (retried on another compatible engine when the
failure is the engine's, at most ``max_prefill_attempts`` in all, each retry counted), the first
token goes out, then Decode with the KV handle on the decode engine. Local: Decode without a
handle. A decode stream that ends without a finish reason is an error (``decode_truncated``).
A request whose decode engine, or the producer of its KV, fails continues on other engines
(:mod:`services.router.migration`: legs, prefill failover, migration); every engine call feeds
the engine's circuit breaker (:mod:`services.router.health`).

Bounds: the router times every engine call itself, so it can say which bound tripped. A Prefill
call has ``prefill_timeout_s``; a Decode stream has ``decode_timeout_s`` as a whole and
``decode_idle_timeout_s`` between two deltas (the first included), so a decode engine that
stalls without dying ends its streams within the idle bound (both by one timer per stream,
:class:`~services.router.deadline.StreamBounds`, not one per message). Either ends the call with
``engine_timeout`` (a retryable prefill failure; a decode error, answered 504 before the first
byte or as an SSE error event after), sends the engine an Abort, and is counted in
``pdserve_router_engine_timeouts_total{call, bound}``. The gRPC deadline of each call is the
router's bound plus ``BACKSTOP_GRACE_S``: a backstop, so the engine gives up even if the
router's cancellation never reaches it.

Time accounting (``RunInfo``): ``engine_wait_s`` sums the time spent awaiting engine calls, so
router overhead = end-to-end minus it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace

from services.control_plane.wire import EngineId
from services.engines.backend import (
    DecodeRequest,
    FinishReason,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
)
from services.router.config import RouterSettings
from services.router.deadline import StreamBounds
from services.router.errors import EngineRequestFailed, RouterError, engine_error
from services.router.metrics import RouterMetrics
from services.router.migration import (
    PRODUCER_GONE,
    LegFailed,
    NoContinuation,
    Progress,
    Step,
    chain,
    is_engine_fault,
    is_migratable,
    prefill_phase,
)
from services.router.policies import PromptInfo
from services.router.pool import EnginePool, EngineSlot
from services.router.scheduler import Plan, Scheduler
from services.tokenization.tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)


COALESCE_FRACTION = 0.25
"""A non-streamed request's decode engine holds steps, the first included, for at most this
fraction of the idle bound (``DecodeRequest.coalesce_s`` and ``coalesce_first`` in
decode.proto), so a live engine still answers well
within it and a stalled one still trips it. Fewer messages per request: each costs the router
a gRPC read."""

BACKSTOP_GRACE_S = 5.0
"""The gRPC deadline of an engine call is the router's own bound plus this, so the router's
timer trips first (and names the bound) while the engine still learns its deadline."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_s: float
    """``time.perf_counter()`` when the HTTP request arrived."""
    stream: bool = True
    """Whether the client receives tokens as they come. A request that is not streamed asks
    the decode engine to coalesce the steps after its first (see :data:`COALESCE_FRACTION`)."""


@dataclass(frozen=True)
class Chunk:
    """New output text and how many tokens produced it; the last one has ``finish_reason``."""

    text: str
    num_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token, when the request asked for logprobs."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """On the first chunk, when the request asked for prompt logprobs (tokens 1..)."""


@dataclass
class RunInfo:
    """What a run decided and measured, filled as it goes (headers, usage, metrics)."""

    path: str | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    engine_wait_s: float = 0.0
    migrations: int = 0
    """Times the request moved to another engine pair mid-stream (services.router.migration)."""


class Executor:
    """Plans and runs requests; one per router process."""

    def __init__(
        self,
        pool: EnginePool,
        scheduler: Scheduler,
        settings: RouterSettings,
        metrics: RouterMetrics,
        *,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self._pool = pool
        self._scheduler = scheduler
        self._settings = settings
        self._metrics = metrics
        self._tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self._background: set[asyncio.Task[bool]] = set()

    async def generate(
        self, request: GenerationRequest, info: RunInfo
    ) -> AsyncGenerator[Chunk, None]:
        """Run ``request``; see the module docstring. ``info`` is filled as it goes."""
        info.prompt_tokens = len(request.prompt_token_ids)
        progress = Progress(request.prompt_token_ids, request.sampling)
        avoid_prefill: set[EngineId] = set()
        avoid_decode: set[EngineId] = set()
        kv_failovers = migrations = 0
        last_error: RouterError | None = None
        moving: str | None = None  # a migration's reason, counted once its leg has engines

        def planned() -> None:
            nonlocal moving
            if moving is not None:
                info.migrations += 1
                self._metrics.migrations.labels(reason=moving).inc()
                moving = None

        while True:
            if progress.left() <= 0:  # the broken leg had sent every token already
                yield Chunk(progress.finish_text(), 0, FinishReason.LENGTH)
                return
            leg = self._leg(request, progress, info, avoid_prefill, avoid_decode, planned)
            try:
                try:
                    first_step = await anext(leg)
                except NoContinuation as nowhere:
                    assert last_error is not None
                    # One replica of the role: the client gets the failure itself, at once.
                    raise EngineRequestFailed(
                        f"{last_error.message} (and it could not continue elsewhere: "
                        f"{nowhere.error.message})",
                        code=last_error.code,
                        status_code=last_error.status_code,
                    ) from last_error
                leg = chain(first_step, leg)
                async for step in leg:
                    text, finish = progress.add(step)
                    info.completion_tokens = len(progress.generated)
                    yield Chunk(
                        text, len(step.token_ids), finish, step.logprobs, step.prompt_logprobs
                    )
                    if finish is not None:  # (a stop string found across a join ends the leg)
                        return
                return
            except LegFailed as failure:
                error, slot = failure.error, failure.slot
                last_error = error
                if failure.phase is not None:
                    kv_failovers += 1
                    if kv_failovers >= self._settings.max_prefill_attempts:
                        raise error from failure
                    avoid_prefill.add(slot.engine_id)
                    self._metrics.prefill_retries.labels(
                        phase=failure.phase, reason=error.code
                    ).inc()
                    what = "re-prefilling elsewhere"
                else:
                    if not is_migratable(error) or migrations >= self._settings.max_migrations:
                        raise error from failure
                    migrations += 1
                    avoid_decode.add(slot.engine_id)
                    moving = error.code
                    what = "migrating"
                logger.warning(
                    "request %s: %s on %s after %d token(s) (%s); %s",
                    request.request_id,
                    error.code,
                    slot.engine_id,
                    len(progress.generated),
                    error.message,
                    what,
                )
                progress.next_leg(self._tokenizer)
            finally:
                await leg.aclose()

    async def _leg(
        self,
        request: GenerationRequest,
        progress: Progress,
        info: RunInfo,
        avoid_prefill: set[EngineId],
        avoid_decode: set[EngineId],
        planned: Callable[[], None],
    ) -> AsyncGenerator[Step, None]:
        """One leg of ``request`` (see services.router.migration): plan (then ``planned()``),
        prefill, decode. Raises :class:`LegFailed` when another leg may succeed,
        :class:`NoContinuation` when a continuation finds no engines, the error itself
        otherwise."""
        continuing = progress.continuing
        leg_request = request
        if continuing:
            leg_request = replace(
                request,
                request_id=f"{request.request_id}.m{progress.legs - 1}",
                prompt_token_ids=progress.prompt(),
                sampling=progress.sampling(),
            )
        prompt = PromptInfo(
            leg_request.prompt_token_ids,
            context_tokens=len(leg_request.prompt_token_ids) + leg_request.sampling.max_tokens,
        )
        try:
            plan = self._scheduler.plan(
                request.model, prompt, avoid_prefill=avoid_prefill, avoid_decode=avoid_decode
            )
        except RouterError as exc:
            if not continuing:
                raise
            raise NoContinuation(exc) from exc
        planned()
        if not continuing:
            self._metrics.queue_time.observe(time.perf_counter() - request.arrival_s)
        info.decode_engine = plan.decode.engine_id
        with self._pool.reserve(plan.decode):
            prefill_slot: EngineSlot | None = None
            result: PrefillResult | None = None
            if plan.prefill is not None:
                result, prefill_slot = await self._prefill(leg_request, plan, prompt, info)
            if result is None:
                info.prefill_engine = None
                if not continuing:
                    info.path = "local"
                    self._metrics.execution_path_by("local").inc()
                async for step in self._decode_leg(leg_request, plan.decode, None, info, progress):
                    yield step
                return
            assert prefill_slot is not None
            if not continuing:
                self._metrics.execution_path_by(str(info.path)).inc()
                info.cached_tokens = result.usage.cached_tokens
                self._observe_ttft(request, info)
            first = Step(
                (result.first_token_id,),
                result.text,
                result.finish_reason,
                (result.logprobs,) if result.logprobs is not None else (),
                result.prompt_logprobs,
            )
            if result.finish_reason is not None or result.kv_handle is None:
                yield replace(first, finish_reason=result.finish_reason or FinishReason.STOP)
                return
            handed_off = False
            try:
                yield first
                async for step in self._decode_leg(
                    leg_request, plan.decode, result, info, progress
                ):
                    handed_off = True
                    yield step
            except LegFailed as failure:
                if not handed_off and failure.error.code in PRODUCER_GONE:
                    # The decode engine could not get the KV: the producer is to blame.
                    raise LegFailed(
                        failure.error, prefill_slot, PRODUCER_GONE[failure.error.code]
                    ) from failure.error
                if not handed_off and failure.error.code == "engine_timeout":
                    # No first delta in time: the decode engine stalled, or its pull waits on
                    # a stalled producer. The next leg avoids both (only the decode engine's
                    # circuit opened: the producer's own next call decides on it).
                    avoid_prefill.add(prefill_slot.engine_id)
                raise
            finally:
                if not handed_off:
                    # The decode engine never started: release the KV the producer holds.
                    self._abort_later(prefill_slot, leg_request.request_id)

    async def _decode_leg(
        self,
        request: GenerationRequest,
        slot: EngineSlot,
        prefilled: PrefillResult | None,
        info: RunInfo,
        progress: Progress,
    ) -> AsyncIterator[Step]:
        """:meth:`_decode` with the breaker fed; a failure another leg may get past is raised
        as :class:`LegFailed`."""
        self._pool.call_started(slot)
        got_delta = False
        try:
            async for step in self._decode(request, slot, prefilled, info, progress.continuing):
                if not got_delta:
                    got_delta = True
                    self._pool.call_succeeded(slot)
                yield step
        except RouterError as exc:
            producer_blamed = not got_delta and prefilled is not None and exc.code in PRODUCER_GONE
            if is_engine_fault(exc) and not producer_blamed:
                self._pool.call_failed(slot)
            if producer_blamed or is_migratable(exc):
                raise LegFailed(exc, slot, None) from exc
            raise

    async def _prefill(
        self, request: GenerationRequest, plan: Plan, prompt: PromptInfo, info: RunInfo
    ) -> tuple[PrefillResult | None, EngineSlot]:
        """The first successful prefill and its engine, or ``(None, last engine)`` for a local
        fallback after every attempt failed (counted). Raises when retrying cannot help."""
        assert plan.prefill is not None
        slot = plan.prefill
        tried = {slot.engine_id}
        attempt = 1
        while True:
            info.prefill_engine = slot.engine_id
            started = time.perf_counter()
            bound_s = self._settings.prefill_timeout_s
            self._pool.call_started(slot)
            try:
                with self._pool.reserve(slot):
                    async with asyncio.timeout(bound_s):
                        result = await slot.connector.prefill(
                            request.request_id,
                            request.prompt_token_ids,
                            request.sampling,
                            timeout_s=bound_s + BACKSTOP_GRACE_S,
                        )
            except Exception as exc:
                info.engine_wait_s += time.perf_counter() - started
                cause = exc
                if isinstance(exc, TimeoutError):
                    self._metrics.engine_timeouts.labels(call="prefill", bound="deadline").inc()
                    cause = TimeoutError(
                        f"engine {slot.engine_id} did not answer within "
                        f"prefill_timeout_s={bound_s:g} s"
                    )
                error = engine_error(cause, stage="prefill")
                if is_engine_fault(error):
                    self._pool.call_failed(slot)
                if not (isinstance(error, EngineRequestFailed) and error.retryable):
                    raise error from exc
                if error.code in {"engine_timeout", "engine_unreachable"}:
                    self._abort_later(slot, request.request_id)
                following = (
                    self._scheduler.next_prefill(plan.decode, prompt, tried)
                    if attempt < self._settings.max_prefill_attempts
                    else None
                )
                if following is None:
                    if not self._settings.local_fallback:
                        raise error from exc
                    logger.warning(
                        "request %s: prefill failed on %s (%s) with no engine left to retry; "
                        "running it locally on %s",
                        request.request_id,
                        slot.engine_id,
                        error.code,
                        plan.decode.engine_id,
                    )
                    self._metrics.fallbacks.labels(reason="prefill_failed").inc()
                    return None, slot
                logger.warning(
                    "request %s: prefill failed on %s (%s); retrying on %s",
                    request.request_id,
                    slot.engine_id,
                    error.code,
                    following.engine_id,
                )
                self._metrics.prefill_retries.labels(
                    phase=prefill_phase(error), reason=error.code
                ).inc()
                slot = following
                tried.add(slot.engine_id)
                attempt += 1
                continue
            self._pool.call_succeeded(slot)
            elapsed = time.perf_counter() - started
            info.engine_wait_s += elapsed
            if info.path is None:
                info.path = "retried" if attempt > 1 else "disaggregated"
                self._metrics.ttft_phase_by("prefill").observe(elapsed)
            return result, slot

    async def _decode(
        self,
        request: GenerationRequest,
        slot: EngineSlot,
        prefilled: PrefillResult | None,
        info: RunInfo,
        continuing: bool = False,
    ) -> AsyncIterator[Step]:
        """Stream from the decode engine; the first step of a local run is its first token."""
        decode_request = DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            kv_handle=prefilled.kv_handle if prefilled else None,
            first_token_id=prefilled.first_token_id if prefilled else None,
        )
        started = time.perf_counter()
        whole_s = self._settings.decode_timeout_s
        idle_s = self._settings.decode_idle_timeout_s
        coalescing = not request.stream
        stream = slot.connector.decode(
            decode_request,
            timeout_s=whole_s + BACKSTOP_GRACE_S,
            coalesce_s=idle_s * COALESCE_FRACTION if coalescing else None,
        )
        bounds = StreamBounds(idle_s, whole_s)
        first = True
        previous = started
        try:
            while True:
                waited = time.perf_counter()
                bounds.waiting()
                try:
                    delta = await anext(stream)
                except StopAsyncIteration:
                    info.engine_wait_s += time.perf_counter() - waited
                    raise EngineRequestFailed(
                        f"decode engine {slot.engine_id} ended the stream without a finish reason",
                        code="decode_truncated",
                    ) from None
                except asyncio.CancelledError as exc:
                    if not bounds.expired_here():
                        raise
                    info.engine_wait_s += time.perf_counter() - waited
                    assert bounds.expired is not None
                    raise self._decode_timed_out(request, slot, bounds.expired, first) from exc
                except TimeoutError as exc:
                    info.engine_wait_s += time.perf_counter() - waited
                    # A TimeoutError the connector raised itself is its (whole-call) deadline.
                    raise self._decode_timed_out(request, slot, "deadline", first) from exc
                except Exception as exc:
                    info.engine_wait_s += time.perf_counter() - waited
                    raise engine_error(exc, stage="decode") from exc
                finally:
                    bounds.done_waiting()
                now = time.perf_counter()
                info.engine_wait_s += now - waited
                if first:
                    if not continuing:
                        self._observe_first_delta(
                            request, prefilled, delta, now - started, info, coalesced=coalescing
                        )
                    first = False
                elif not coalescing:  # a coalesced message's gap is not one token's
                    self._metrics.itl.observe(now - previous)
                previous = now
                if delta.finish_reason is FinishReason.ERROR:
                    raise EngineRequestFailed(
                        f"decode engine {slot.engine_id} failed the request: "
                        f"{delta.error or 'no reason given'}",
                        code="decode_failed",
                    )
                if prefilled is None and delta.usage is not None and not continuing:
                    info.cached_tokens = delta.usage.cached_tokens
                yield Step(
                    delta.token_ids,
                    delta.text,
                    delta.finish_reason,
                    delta.logprobs,
                    delta.prompt_logprobs,
                )
                if delta.finish_reason is not None:
                    return
        finally:
            bounds.close()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _decode_timed_out(
        self, request: GenerationRequest, slot: EngineSlot, bound: str, first: bool
    ) -> EngineRequestFailed:
        """Count a decode timeout, abort the request on the engine, and say which bound
        tripped. Closing the stream (the caller's ``finally``) cancels the call as well; the
        Abort also reaches an engine whose cancellation got lost."""
        self._metrics.engine_timeouts.labels(call="decode", bound=bound).inc()
        self._abort_later(slot, request.request_id)
        if bound == "idle":
            what = "first token" if first else "next token"
            limit = f"decode_idle_timeout_s={self._settings.decode_idle_timeout_s:g} s"
            message = f"decode engine {slot.engine_id} sent no {what} within {limit}"
        else:
            limit = f"decode_timeout_s={self._settings.decode_timeout_s:g} s"
            message = f"decode engine {slot.engine_id} did not finish within {limit}"
        logger.warning("request %s: %s; aborting it there", request.request_id, message)
        return EngineRequestFailed(message, code="engine_timeout", status_code=504)

    def _observe_first_delta(
        self,
        request: GenerationRequest,
        prefilled: PrefillResult | None,
        delta: TokenDelta,
        waited_s: float,
        info: RunInfo,
        *,
        coalesced: bool = False,
    ) -> None:
        """``coalesced``: the first message may hold the whole answer (``coalesce_first``),
        so its wait times no first token and no inter-token gap."""
        if prefilled is None:
            self._observe_ttft(request, info)
            return
        handoff = delta.kv_transfer_s if delta.kv_transfer_s is not None else 0.0
        self._metrics.ttft_phase_by("handoff").observe(handoff)
        if coalesced:
            return
        self._metrics.ttft_phase_by("first_decode_token").observe(max(waited_s - handoff, 0.0))
        # The prefill's token went out first; the gap to the decode's first is an ITL.
        self._metrics.itl.observe(waited_s)

    def _observe_ttft(self, request: GenerationRequest, info: RunInfo) -> None:
        self._metrics.ttft_by(str(info.path)).observe(time.perf_counter() - request.arrival_s)

    def observe_end(
        self, request_arrival_s: float, endpoint: str, outcome: str, info: RunInfo | None
    ) -> None:
        """Count the answered request and its end-to-end latency and router overhead."""
        self._metrics.requests_by(endpoint, outcome).inc()
        self.observe_latency(request_arrival_s, endpoint, info)

    def observe_latency(
        self, request_arrival_s: float, endpoint: str, info: RunInfo | None
    ) -> None:
        """The request's end-to-end latency and router overhead, without counting it (an
        error raised to the HTTP layer is counted by its handler)."""
        elapsed = time.perf_counter() - request_arrival_s
        self._metrics.e2e_by(endpoint).observe(elapsed)
        if info is not None and info.path is not None:
            self._metrics.overhead.observe(max(elapsed - info.engine_wait_s, 0.0))

    def _abort_later(self, slot: EngineSlot, request_id: str) -> None:
        """Best-effort abort (a timed-out or orphaned request), without delaying the caller."""

        async def abort() -> bool:
            try:
                found = await slot.connector.abort(request_id)
            except Exception as exc:
                logger.info("abort of %s on %s failed: %s", request_id, slot.engine_id, exc)
                self._metrics.aborts.labels(role=slot.role.value, outcome="failed").inc()
                return False
            outcome = "found" if found else "unknown"
            self._metrics.aborts.labels(role=slot.role.value, outcome=outcome).inc()
            return found

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
