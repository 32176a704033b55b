"""The router's calls to the engines, with the router's own bounds, prefill failover and the
backstop Abort.

:class:`EngineCalls` (one per router process, :attr:`Executor.calls
<services.router.execution.Executor.calls>`) is used by the executor
(:mod:`services.router.execution.executor`) and the forked ``n > 1`` run
(:mod:`services.router.execution.fork`), so a timeout is counted, aborted on the engine and worded
in one place, and a Prefill fails over the same way for both.

Prefill failover (:meth:`EngineCalls.prefill`): a Prefill that failed through the engine (a
retryable error: overloaded, draining, unreachable, failed, timed out) is retried on the
scheduler's next compatible prefill engine, at most ``max_prefill_attempts`` in all, each retry
counted in ``pdserve_router_prefill_retries_total{phase, reason}``; with none left the decode
engine runs the request itself (``pdserve_router_fallbacks_total{reason="prefill_failed"}``), or
with ``local_fallback`` off the error is the answer. Bad input is never retried.

Bounds: the router times every engine call itself, so it can say which bound tripped. A Prefill
call has ``prefill_timeout_s``; a Decode stream has ``decode_timeout_s`` as a whole and
``decode_idle_timeout_s`` between two deltas (the first included), so a decode engine that
stalls without dying ends its streams within the idle bound (both by one timer per stream,
:class:`~services.router.execution.deadline.StreamBounds`, not one per message). A non-streamed
request decodes with one unary call (``DecodeOnce``, :meth:`EngineConnector.decode_once
<services.serving.client.connector.EngineConnector.decode_once>`: one answer costs the router
less than a stream): the router bounds it by ``decode_timeout_s`` and hands the engine the idle
bound, which the engine enforces between its own steps (it aborts the request and answers
``EngineStalled``, counted here as an idle timeout); an engine that answers nothing at all is
ended by the whole-call bound, or sooner by the channel's keepalive (unreachable). A tripped
bound ends the call with ``engine_timeout`` (a retryable prefill failure; a decode error,
answered 504 before the first byte or as an SSE error event after), sends the engine an Abort
(:meth:`EngineCalls.abort_later`), and is counted in
``pdserve_router_engine_timeouts_total{call, bound}``. The gRPC deadline of each call is the
router's bound plus ``BACKSTOP_GRACE_S``: a backstop, so the engine gives up even if the
router's cancellation never reaches it.

Every call feeds the engine's circuit breaker (started, then succeeded or, on an engine fault,
failed through :meth:`EnginePool.call_failed
<services.router.scheduling.pool.EnginePool.call_failed>`): a Prefill through its reservation
(:meth:`EnginePool.call <services.router.scheduling.pool.EnginePool.call>`: started on entering,
succeeded on leaving without an error), a Decode through the leg that streams it (the
executor's, the fork's: started right before the call, succeeded on its first delta; its engine's
reservation spans the whole leg, the prefill included). Every call adds the time it waited to
``RunInfo.engine_wait_s``, and every call of a request, its Aborts included, carries the
request's W3C trace context (``GenerationRequest.trace``) to the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from services.engines.errors import EngineStalled
from services.engines.requests import DecodeRequest, FinishReason, PrefillResult, TokenDelta
from services.router.config import RouterSettings
from services.router.errors import EngineRequestFailed, RouterError, engine_error
from services.router.execution.deadline import StreamBounds
from services.router.execution.generation import GenerationRequest, RunInfo
from services.router.execution.migration import Step, is_engine_fault, prefill_phase
from services.router.metrics import RouterMetrics
from services.router.scheduling.policies import PromptInfo
from services.router.scheduling.pool import EnginePool, EngineSlot
from services.router.scheduling.scheduler import Plan, Scheduler

logger = logging.getLogger(__name__)

BACKSTOP_GRACE_S = 5.0
"""The gRPC deadline of an engine call is the router's own bound plus this, so the router's
timer trips first (and names the bound) while the engine still learns its deadline."""

ABORT_ON = frozenset({"engine_timeout", "engine_unreachable"})
"""Prefill failures after which the engine may still run the request: it is sent an Abort."""


class EngineCalls:
    """Bounded engine calls and best-effort aborts; see the module docstring."""

    def __init__(
        self,
        pool: EnginePool,
        scheduler: Scheduler,
        settings: RouterSettings,
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._scheduler = scheduler
        self._settings = settings
        self._metrics = metrics
        self._background: set[asyncio.Task[bool]] = set()

    async def prefill(
        self, request: GenerationRequest, plan: Plan, prompt: PromptInfo, info: RunInfo
    ) -> tuple[PrefillResult | None, EngineSlot]:
        """The first successful Prefill of ``request`` and its engine, from ``plan``'s prefill
        engine on (a retryable failure retried on the scheduler's next compatible engine, at
        most ``max_prefill_attempts`` in all, each retry counted), or ``(None, last engine)``
        for a local fallback after every attempt failed (counted). Raises when retrying cannot
        help."""
        assert plan.prefill is not None
        slot = plan.prefill
        tried = {slot.engine_id}
        attempt = 1
        while True:
            info.prefill_engine = slot.engine_id
            try:
                result, elapsed = await self._prefill_on(slot, request, info)
            except RouterError as error:
                if not (isinstance(error, EngineRequestFailed) and error.retryable):
                    raise
                following = (
                    self._scheduler.next_prefill(plan.decode, prompt, tried)
                    if attempt < self._settings.max_prefill_attempts
                    else None
                )
                if following is None:
                    if not self._settings.local_fallback:
                        raise
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
            if info.path is None:
                info.path = "retried" if attempt > 1 else "disaggregated"
                self._metrics.ttft_phase_by("prefill").observe(elapsed)
            return result, slot

    async def _prefill_on(
        self, slot: EngineSlot, request: GenerationRequest, info: RunInfo
    ) -> tuple[PrefillResult, float]:
        """One Prefill of ``request`` on ``slot`` within ``prefill_timeout_s``, a reserved call
        that feeds the engine's breaker (:meth:`EnginePool.call
        <services.router.scheduling.pool.EnginePool.call>`): the result and the seconds it took.
        Raises the call's :class:`RouterError` (a timeout counted; after a timeout or an
        unreachable engine, the request is aborted there)."""
        started = time.perf_counter()
        bound_s = self._settings.prefill_timeout_s
        try:
            with self._pool.call(slot):
                async with asyncio.timeout(bound_s):
                    result = await slot.connector.prefill(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling,
                        timeout_s=bound_s + BACKSTOP_GRACE_S,
                        trace=request.trace,
                        lora=request.lora,
                    )
        except Exception as exc:
            info.engine_wait_s += time.perf_counter() - started
            error = (
                self._prefill_timed_out(slot)
                if isinstance(exc, TimeoutError)
                else engine_error(exc, stage="prefill")
            )
            if is_engine_fault(error):
                self._pool.call_failed(slot)
            if error.code in ABORT_ON:
                self.abort_later(slot, request)
            raise error from exc
        elapsed = time.perf_counter() - started
        info.engine_wait_s += elapsed
        return result, elapsed

    def _prefill_timed_out(self, slot: EngineSlot) -> RouterError:
        self._metrics.engine_timeouts.labels(call="prefill", bound="deadline").inc()
        return engine_error(
            TimeoutError(
                f"engine {slot.engine_id} did not answer within "
                f"prefill_timeout_s={self._settings.prefill_timeout_s:g} s"
            ),
            stage="prefill",
        )

    async def decode(
        self,
        request: GenerationRequest,
        slot: EngineSlot,
        prefilled: PrefillResult | None,
        info: RunInfo,
        continuing: bool = False,
    ) -> AsyncIterator[Step]:
        """Stream from the decode engine within its bounds; the first step of a local run is its
        first token. Raises the call's :class:`RouterError` (the caller feeds the breaker)."""
        decode_request = DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            kv_handle=prefilled.kv_handle if prefilled else None,
            first_token_id=prefilled.first_token_id if prefilled else None,
            trace=request.trace,
            lora=request.lora,
        )
        if not request.stream:
            delta = await self._decode_once(request, decode_request, slot, prefilled, info)
            if not continuing:
                self._observe_first_delta(request, prefilled, delta, 0.0, info, whole=True)
            if delta.finish_reason is FinishReason.ERROR and delta.token_ids:
                # The tokens before the failure count as made (as a stream's would): a
                # migration continues after them.
                yield Step(delta.token_ids, delta.text, None, delta.logprobs, delta.prompt_logprobs)
            yield self._step(delta, slot, prefilled is None and not continuing, info)
            return
        started = time.perf_counter()
        whole_s = self._settings.decode_timeout_s
        idle_s = self._settings.decode_idle_timeout_s
        stream = slot.connector.decode(decode_request, timeout_s=whole_s + BACKSTOP_GRACE_S)
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
                    raise self.decode_timed_out(request, slot, bounds.expired, first) from exc
                except TimeoutError as exc:
                    info.engine_wait_s += time.perf_counter() - waited
                    # A TimeoutError the connector raised itself is its (whole-call) deadline.
                    raise self.decode_timed_out(request, slot, "deadline", first) from exc
                except Exception as exc:
                    info.engine_wait_s += time.perf_counter() - waited
                    raise engine_error(exc, stage="decode") from exc
                finally:
                    bounds.done_waiting()
                now = time.perf_counter()
                info.engine_wait_s += now - waited
                if first:
                    if not continuing:
                        self._observe_first_delta(request, prefilled, delta, now - started, info)
                    first = False
                else:
                    self._metrics.itl.observe(now - previous)
                previous = now
                yield self._step(delta, slot, prefilled is None and not continuing, info)
                if delta.finish_reason is not None:
                    return
        finally:
            bounds.close()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _decode_once(
        self,
        request: GenerationRequest,
        decode_request: DecodeRequest,
        slot: EngineSlot,
        prefilled: PrefillResult | None,
        info: RunInfo,
    ) -> TokenDelta:
        """The whole decode in one unary call (see the module docstring): its one delta, with a
        finish reason. Raises the call's :class:`RouterError`."""
        started = time.perf_counter()
        whole_s = self._settings.decode_timeout_s
        try:
            async with asyncio.timeout(whole_s):
                delta = await slot.connector.decode_once(
                    decode_request,
                    idle_timeout_s=self._settings.decode_idle_timeout_s,
                    timeout_s=whole_s + BACKSTOP_GRACE_S,
                )
        except TimeoutError as exc:  # ours, or the connector's own (whole-call) deadline
            info.engine_wait_s += time.perf_counter() - started
            raise self.decode_timed_out(request, slot, "deadline", None) from exc
        except EngineStalled as exc:
            info.engine_wait_s += time.perf_counter() - started
            raise self.decode_timed_out(request, slot, "idle", None) from exc
        except Exception as exc:
            info.engine_wait_s += time.perf_counter() - started
            raise engine_error(exc, stage="decode") from exc
        info.engine_wait_s += time.perf_counter() - started
        if delta.finish_reason is None:
            raise EngineRequestFailed(
                f"decode engine {slot.engine_id} ended the request without a finish reason",
                code="decode_truncated",
            )
        return delta

    def _step(
        self, delta: TokenDelta, slot: EngineSlot, local_first_leg: bool, info: RunInfo
    ) -> Step:
        """A decode delta as the leg's step; an ERROR finish raises ``decode_failed``."""
        if delta.finish_reason is FinishReason.ERROR:
            raise EngineRequestFailed(
                f"decode engine {slot.engine_id} failed the request: "
                f"{delta.error or 'no reason given'}",
                code="decode_failed",
            )
        if local_first_leg and delta.cached_tokens is not None:
            info.cached_tokens = delta.cached_tokens  # before the first chunk is answered
        if local_first_leg and delta.usage is not None:
            info.cached_tokens = delta.usage.cached_tokens
            info.cache_write_tokens = delta.usage.cache_write_tokens
        return Step(
            delta.token_ids, delta.text, delta.finish_reason, delta.logprobs, delta.prompt_logprobs
        )

    def decode_timed_out(
        self, request: GenerationRequest, slot: EngineSlot, bound: str, first: bool | None
    ) -> EngineRequestFailed:
        """Count a decode timeout, abort the request on the engine, and say which bound
        tripped (``first``: whether no token had come, ``None`` when the caller cannot tell, a
        unary call). Closing the stream (the caller's ``finally``) cancels the call as well;
        the Abort also reaches an engine whose cancellation got lost."""
        self._metrics.engine_timeouts.labels(call="decode", bound=bound).inc()
        self.abort_later(slot, request)
        if bound == "idle":
            what = "token" if first is None else "first token" if first else "next token"
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
        whole: bool = False,
    ) -> None:
        """``whole``: the delta is the whole answer (a unary decode), so its wait times no
        first token and no inter-token gap."""
        if prefilled is None:  # a local run's first token
            self._metrics.ttft_by(str(info.path)).observe(time.perf_counter() - request.arrival_s)
            return
        handoff_s = self.observe_handoff(delta)
        if not whole:
            self.observe_first_decode_token(waited_s, handoff_s)

    def observe_handoff(self, delta: TokenDelta) -> float:
        """The KV handoff a decode's first delta reports (``kv_transfer_s``, 0 when absent):
        observed as the ``handoff`` TTFT phase, once per transfer (a forked prompt's choices
        share one). Returns it."""
        handoff_s = delta.kv_transfer_s if delta.kv_transfer_s is not None else 0.0
        self._metrics.ttft_phase_by("handoff").observe(handoff_s)
        return handoff_s

    def observe_first_decode_token(self, waited_s: float, handoff_s: float) -> None:
        """A streamed decode's first token after the prefill's, ``waited_s`` after its Decode
        call began: the wait less the handoff is the ``first_decode_token`` TTFT phase, and the
        whole wait an ITL (the prefill's token went out first). Once per sequence: a single
        run's, each forked choice's (its first delta on the shared Decode)."""
        self._metrics.ttft_phase_by("first_decode_token").observe(max(waited_s - handoff_s, 0.0))
        self._metrics.itl.observe(waited_s)

    def abort_later(self, slot: EngineSlot, request: GenerationRequest) -> None:
        """Best-effort abort of ``request`` (timed out or orphaned), without delaying the
        caller."""
        request_id = request.request_id

        async def abort() -> bool:
            try:
                found = await slot.connector.abort(request_id, trace=request.trace)
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
        """Wait for the aborts still under way."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
