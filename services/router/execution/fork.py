"""``n > 1`` from one prefill and one KV transfer: the first leg of a prompt's choices, forked.

:meth:`Executor.runs <services.router.execution.executor.Executor.runs>` plans a prompt of
several choices once (:func:`forked_leg`); when the plan is disaggregated and both engines fork
(:func:`can_fork`: the reference engine), every choice runs as its own request whose *first
leg* is one :class:`ForkedLeg` shared by all of them: one Prefill with ``sampling.n = n`` (the
engine samples every choice's first token, choice ``i`` as a request seeded with ``seed + i``
would, vLLM's rule), with every request's prefill failover (:meth:`EngineCalls.prefill
<services.router.execution.engine_calls.EngineCalls.prefill>`: another prefill engine, then the
local fallback, where each choice decodes locally), then one Decode whose ``forks`` name the choices
the first token did not end: the decode engine pulls the KV once and forks one sequence per
choice. Otherwise every choice runs as its own request from the start (its own prefill and
transfer). vLLM engines take that path: vLLM's ``n > 1`` fans a request out into ``n`` engine
requests that would each pull the prompt's KV (docs/vllm.md). Which path ran is counted in
``pdserve_router_choices_total{path}``.

When the forked Decode breaks (the decode engine failed, stalled or went away, or could not
get the KV), each unfinished choice gets the error as its own leg's failure: the executor
continues it as a single request does (:mod:`services.router.execution.migration`: prefill
failover when the producer is to blame, else migration; each choice counted), from the tokens
that choice already sent. The continuations are per choice: their prompts differ (each ends
with its choice's output). Bounds are the executor's: ``prefill_timeout_s`` for the Prefill
call, ``decode_timeout_s`` for the whole Decode and ``decode_idle_timeout_s`` between two of its
messages (a timeout is ``engine_timeout``, counted in ``pdserve_router_engine_timeouts_total``
and answered with an Abort of the request on that engine); the engine's breaker is fed once per
call, and a Decode that never sent a delta releases the KV the prefill engine holds (one Abort
there), as the executor's does.

Metrics: each choice records what a single run of it would: its TTFT and path (the executor),
and on a streamed request its ``first_decode_token`` TTFT phase (its first delta on the shared
Decode, less the handoff) and an ITL for every gap, the first from the Decode call's start, as
:meth:`EngineCalls.decode <services.router.execution.engine_calls.EngineCalls.decode>` times a
single stream. The shared calls' phases, ``prefill`` and ``handoff``, are observed once per
prompt: one Prefill call, one KV transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from services.engines.requests import DecodeRequest, FinishReason, Fork, PrefillResult
from services.router.config import RouterSettings
from services.router.errors import EngineRequestFailed, RouterError, engine_error
from services.router.execution.engine_calls import BACKSTOP_GRACE_S, EngineCalls
from services.router.execution.generation import Chunk, GenerationRequest, RunInfo
from services.router.execution.migration import (
    PRODUCER_GONE,
    LegFailed,
    Step,
    is_engine_fault,
    is_migratable,
)
from services.router.metrics import RouterMetrics
from services.router.scheduling.policies import PromptInfo
from services.router.scheduling.pool import EnginePool, EngineSlot
from services.router.scheduling.scheduler import Plan, Scheduler

FORKING_KINDS = frozenset({"reference"})
"""Engine kinds whose prefill samples ``n`` first tokens and whose decode forks."""

Prefilled = tuple[PrefillResult | None, EngineSlot]
"""A prefill's result and engine; ``None`` for the local fallback (the last engine tried)."""


def can_fork(plan: Plan) -> bool:
    """Whether the choices planned on ``plan`` fork from one prefill and one transfer."""
    return (
        plan.prefill is not None
        and plan.prefill.record.engine_kind in FORKING_KINDS
        and plan.decode.record.engine_kind in FORKING_KINDS
    )


def forked_leg(
    requests: list[GenerationRequest],
    infos: list[RunInfo],
    scheduler: Scheduler,
    calls: EngineCalls,
    *,
    pool: EnginePool,
    settings: RouterSettings,
    metrics: RouterMetrics,
) -> ForkedLeg | None:
    """The shared first leg of ``requests`` (one prompt's choices), or ``None`` when they
    cannot fork: each then runs alone (planning again: a planning error is answered there).
    Which path ran is counted."""
    base = requests[0]
    prompt = base.prompt_info()
    try:
        plan = scheduler.plan(base.model, prompt)
    except RouterError:
        plan = None
    if plan is None or not can_fork(plan):
        metrics.choices.labels(path="per_choice").inc()
        return None
    metrics.choices.labels(path="forked").inc()
    metrics.queue_time.observe(time.perf_counter() - base.arrival_s)
    return ForkedLeg(
        plan,
        base,
        len(requests),
        prompt,
        pool=pool,
        settings=settings,
        metrics=metrics,
        calls=calls,
        info=infos[0],
    )


class ForkedLeg:
    """The first leg of ``n`` choices (see the module docstring). The run starts with the first
    :meth:`prefilled` and is cancelled once every choice's stream is closed
    (:meth:`release`)."""

    def __init__(
        self,
        plan: Plan,
        request: GenerationRequest,
        n: int,
        prompt: PromptInfo,
        *,
        pool: EnginePool,
        settings: RouterSettings,
        metrics: RouterMetrics,
        calls: EngineCalls,
        info: RunInfo,
    ) -> None:
        """``request``: choice 0 (the Decode's; the forks offset its seed), prefilled with
        ``n`` choices (:meth:`EngineCalls.prefill`, with its failover); ``prompt``: as placed;
        ``info``: the run that counts the shared calls' engine time."""
        self.plan = plan
        self._request = request
        self._n = n
        self._prompt = prompt
        self._pool = pool
        self._settings = settings
        self._metrics = metrics
        self._calls = calls
        self._info = info
        self._prefilled: asyncio.Future[Prefilled] = asyncio.get_running_loop().create_future()
        self._queues: list[asyncio.Queue[Step | BaseException]] = [
            asyncio.Queue() for _ in range(n)
        ]
        self._unfinished: set[int] = set()
        self._open = n
        self._task: asyncio.Task[None] | None = None

    async def prefilled(self) -> Prefilled:
        """The shared Prefill's outcome (its error raised to every choice)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(self._prefilled)

    def first_step(self, result: PrefillResult, index: int) -> Step:
        """Choice ``index``'s first token."""
        if index == 0:
            token, text, finish = result.first_token_id, result.text, result.finish_reason
            logprobs = result.logprobs
        else:
            more = result.more_choices[index - 1]
            token, text, finish = more.token_id, more.text, more.finish_reason
            logprobs = more.logprobs
        return Step((token,), text, finish, (logprobs,) if logprobs else (), result.prompt_logprobs)

    async def decode(self, index: int) -> AsyncIterator[Step]:
        """Choice ``index``'s steps from the forked Decode; raises its failure (a
        :class:`LegFailed` where another leg may get past it)."""
        queue = self._queues[index]
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def release(self) -> None:
        """One choice's stream is closed; the last one cancels the run if it is going."""
        self._open -= 1
        if self._open > 0:
            return
        if not self._prefilled.done():
            self._prefilled.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        try:
            sampled = replace(self._request, sampling=replace(self._request.sampling, n=self._n))
            result, slot = await self._calls.prefill(sampled, self.plan, self._prompt, self._info)
            if result is not None:
                self._check(result, slot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._prefilled.done():
                self._prefilled.set_exception(exc)
                # Every choice awaiting it gets the error raised; when all of them closed just
                # before (each awaits through a shield), nobody will: not an unretrieved error.
                self._prefilled.exception()
            return
        if self._prefilled.done():  # every choice closed meanwhile
            return
        self._prefilled.set_result((result, slot))
        if result is None or result.kv_handle is None:
            return  # local fallback, or nothing to decode: each choice's leg goes on alone
        forks = [
            Fork(index, step.token_ids[0])
            for index in range(self._n)
            if (step := self.first_step(result, index)).finish_reason is None
        ]
        if forks:
            self._unfinished = {fork.choice for fork in forks}
            await self._decode(result, slot, forks)

    def _check(self, result: PrefillResult, slot: EngineSlot) -> None:
        if 1 + len(result.more_choices) != self._n:
            raise EngineRequestFailed(
                f"prefill engine {slot.engine_id} returned {1 + len(result.more_choices)} "
                f"first tokens for n={self._n}",
                code="protocol_mismatch",
            )

    def _fail(self, error: RouterError, got_delta: bool) -> None:
        """The forked Decode broke: feed the decode engine's breaker once and hand each
        unfinished choice the failure, as the executor's ``_decode_leg`` would."""
        slot = self.plan.decode
        producer_blamed = not got_delta and error.code in PRODUCER_GONE
        if is_engine_fault(error) and not producer_blamed:
            self._pool.call_failed(slot)
        for index in sorted(self._unfinished):
            item: BaseException = error
            if producer_blamed or is_migratable(error):
                item = LegFailed(error, slot, None)
            self._queues[index].put_nowait(item)
        self._unfinished.clear()

    async def _decode(self, result: PrefillResult, producer: EngineSlot, forks: list[Fork]) -> None:
        slot, request = self.plan.decode, self._request
        whole_s = self._settings.decode_timeout_s
        idle_s = self._settings.decode_idle_timeout_s
        decode_request = DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            kv_handle=result.kv_handle,
            first_token_id=forks[0].first_token_id,
            forks=tuple(forks),
            trace=request.trace,
            lora=request.lora,
        )
        started = time.perf_counter()
        slot.health.begin_call()
        stream = slot.connector.decode(decode_request, timeout_s=whole_s + BACKSTOP_GRACE_S)
        first = True
        handoff_s = 0.0
        # Each choice's last delta, timed as a single streamed run times its own: its first
        # decode token and every gap (a non-streamed request's answer has neither).
        last_delta: dict[int, float] | None = {} if request.stream else None
        try:
            while self._unfinished:
                left_s = started + whole_s - time.perf_counter()
                bound = "idle" if idle_s < left_s else "deadline"
                waited = time.perf_counter()
                try:
                    async with asyncio.timeout(min(idle_s, left_s)):
                        delta = await anext(stream)
                except StopAsyncIteration:
                    raise EngineRequestFailed(
                        f"decode engine {slot.engine_id} ended the stream before every "
                        "choice finished",
                        code="decode_truncated",
                    ) from None
                except TimeoutError as exc:
                    raise self._calls.decode_timed_out(request, slot, bound, first) from exc
                finally:
                    arrived = time.perf_counter()
                    self._info.engine_wait_s += arrived - waited
                if first:
                    first = False
                    slot.health.success()
                    handoff_s = self._calls.observe_handoff(delta)
                if delta.finish_reason is FinishReason.ERROR:
                    raise EngineRequestFailed(
                        f"decode engine {slot.engine_id} failed the request: "
                        f"{delta.error or 'no reason given'}",
                        code="decode_failed",
                    )
                if delta.choice not in self._unfinished:
                    raise EngineRequestFailed(
                        f"decode engine {slot.engine_id} sent tokens of choice {delta.choice}, "
                        "which is not running",
                        code="protocol_mismatch",
                    )
                if last_delta is not None:
                    self._observe_gap(last_delta, delta.choice, arrived, started, handoff_s)
                if delta.finish_reason is not None:
                    self._unfinished.discard(delta.choice)
                self._queues[delta.choice].put_nowait(
                    Step(tuple(delta.token_ids), delta.text, delta.finish_reason, delta.logprobs)
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(engine_error(exc, stage="decode"), not first)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            if first:
                # The decode engine never started: release the KV the producer holds.
                self._calls.abort_later(producer, request)

    def _observe_gap(
        self,
        last_delta: dict[int, float],
        choice: int,
        arrived: float,
        started: float,
        handoff_s: float,
    ) -> None:
        """A delta of ``choice`` came at ``arrived``: its first decode token (the Decode call
        began at ``started``) or an ITL since its previous delta, as a single run observes
        them."""
        previous = last_delta.get(choice)
        if previous is None:
            self._calls.observe_first_decode_token(arrived - started, handoff_s)
        else:
            self._metrics.itl.observe(arrived - previous)
        last_delta[choice] = arrived


class ForkedChoice:
    """Choice ``index``'s chunk stream (the executor's run of it, whose first leg is ``leg``):
    closing it, read or not, releases the shared leg."""

    def __init__(self, run: AsyncIterator[Chunk], leg: ForkedLeg) -> None:
        self._run = run
        self._leg = leg
        self._closed = False

    def __aiter__(self) -> ForkedChoice:
        return self

    async def __anext__(self) -> Chunk:
        return await anext(self._run)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            aclose = getattr(self._run, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self._leg.release()
