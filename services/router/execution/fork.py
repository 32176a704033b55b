"""``n > 1`` from one prefill and one KV transfer: the choices of one prompt forked on decode.

:func:`forked_runs` plans the prompt once; when the plan is disaggregated and both engines fork
(:data:`FORKING_KINDS`: the reference engine), it returns one chunk stream per choice, fed by
one run: one Prefill with ``sampling.n = n`` (the engine samples every choice's first token,
choice ``i`` as a request seeded with ``seed + i`` would, vLLM's rule), then one Decode whose
``forks`` name the choices the first token did not end: the decode engine pulls the KV once
and forks one sequence per choice. Otherwise it returns ``None`` and every choice runs as its
own request (its own prefill and transfer, with failover and migration). vLLM
engines take that path: vLLM's ``n > 1`` fans a request out into ``n`` engine requests that would
each pull the prompt's KV (docs/vllm.md). Which path ran is counted in
``pdserve_router_choices_total{path}``.

The forked run has no failover or migration (the per-choice path has both): a failure of
either engine ends every unfinished choice with the error, as an HTTP error before the
response starts or an SSE error event after. Bounds are the executor's: ``prefill_timeout_s``
for the Prefill call, ``decode_timeout_s`` for the whole Decode and ``decode_idle_timeout_s``
between two of its messages. The calls and their timeouts are the executor's
(:class:`~services.router.execution.engine_calls.EngineCalls`): a timeout is ``engine_timeout``,
counted in ``pdserve_router_engine_timeouts_total``, fed to the engine's breaker and answered with
an Abort of the request on that engine; a Decode that never sent a delta also releases the KV the
prefill engine holds (an Abort there), as the executor's does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from services.engines.requests import DecodeRequest, FinishReason, Fork, PrefillResult
from services.router.config import RouterSettings
from services.router.errors import EngineRequestFailed, RouterError, engine_error
from services.router.execution.engine_calls import BACKSTOP_GRACE_S, EngineCalls
from services.router.execution.generation import Chunk, GenerationRequest, RunInfo
from services.router.execution.migration import is_engine_fault
from services.router.metrics import RouterMetrics
from services.router.scheduling.policies import PromptInfo
from services.router.scheduling.pool import EnginePool, EngineSlot
from services.router.scheduling.scheduler import Plan, Scheduler

FORKING_KINDS = frozenset({"reference"})
"""Engine kinds whose prefill samples ``n`` first tokens and whose decode forks."""

_Item = Chunk | BaseException


@dataclass(frozen=True)
class ForkContext:
    """What a forked run uses of its executor: the pool, the scheduler, the bounds, the
    metrics and the executor's engine calls."""

    pool: EnginePool
    scheduler: Scheduler
    settings: RouterSettings
    metrics: RouterMetrics
    calls: EngineCalls


def forked_runs(
    context: ForkContext, requests: list[GenerationRequest], infos: list[RunInfo]
) -> list[_ChoiceStream] | None:
    """One chunk stream per choice of one prompt (``requests[i]`` is choice ``i``), or
    ``None`` when they cannot fork (see the module docstring); counted either way."""
    if len(requests) < 2:
        return None
    base = requests[0]
    prompt = PromptInfo(
        base.prompt_token_ids,
        context_tokens=len(base.prompt_token_ids) + base.sampling.max_tokens,
    )
    try:
        plan = context.scheduler.plan(base.model, prompt)
    except RouterError:
        plan = None  # each choice plans again and answers the error through the usual path
    if (
        plan is None
        or plan.prefill is None
        or plan.prefill.record.engine_kind not in FORKING_KINDS
        or plan.decode.record.engine_kind not in FORKING_KINDS
    ):
        context.metrics.choices.labels(path="per_choice").inc()
        return None
    context.metrics.choices.labels(path="forked").inc()
    run = _ForkedRun(context, plan, base, len(requests), infos)
    return [_ChoiceStream(run, i) for i in range(len(requests))]


class _ChoiceStream:
    """Choice ``index`` of a forked run. Reading it starts the run; closing every choice's
    stream (read or not) cancels the run if it is still going."""

    def __init__(self, run: _ForkedRun, index: int) -> None:
        self._run = run
        self._index = index
        self._ended = False
        self._closed = False

    def __aiter__(self) -> _ChoiceStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._ended or self._closed:
            raise StopAsyncIteration
        item = await self._run.next_item(self._index)
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finish_reason is not None:
            self._ended = True
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._run.release()


class _ForkedRun:
    """The one Prefill + Decode of a forked prompt, feeding one queue per choice. It starts
    with the first choice stream read and is cancelled once every stream is closed."""

    def __init__(
        self,
        context: ForkContext,
        plan: Plan,
        request: GenerationRequest,
        n: int,
        infos: list[RunInfo],
    ) -> None:
        assert plan.prefill is not None
        self._context = context
        self._calls = context.calls
        self._prefill_slot: EngineSlot = plan.prefill
        self._decode_slot = plan.decode
        self._request = request
        self._n = n
        self._infos = infos
        self._queues: list[asyncio.Queue[_Item]] = [asyncio.Queue() for _ in range(n)]
        self._unfinished = set(range(n))
        self._open = n
        self._task: asyncio.Future[None] | None = None

    async def next_item(self, index: int) -> _Item:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return await self._queues[index].get()

    async def release(self) -> None:
        """One choice's stream is closed; the last one cancels the run if it is going."""
        self._open -= 1
        if self._open == 0 and self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _put(self, index: int, chunk: Chunk) -> None:
        self._queues[index].put_nowait(chunk)
        if chunk.finish_reason is not None:
            self._unfinished.discard(index)

    async def _run(self) -> None:
        stage = "prefill"
        try:
            with self._context.pool.reserve(self._decode_slot):
                result = await self._prefill()
                stage = "decode"
                forks = self._first_tokens(result)
                if forks:
                    await self._decode(result, forks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = engine_error(exc, stage=stage)
            for index in self._unfinished:
                self._queues[index].put_nowait(error)

    async def _prefill(self) -> PrefillResult:
        request = self._request
        result, elapsed = await self._calls.prefill(
            self._prefill_slot,
            replace(request, sampling=replace(request.sampling, n=self._n)),
            self._infos[0],
        )
        self._context.metrics.ttft_phase_by("prefill").observe(elapsed)
        return result

    def _first_tokens(self, result: PrefillResult) -> list[Fork]:
        """Send every choice's first token; the forks the decode engine continues."""
        firsts = [
            (result.first_token_id, result.text, result.finish_reason, result.logprobs),
            *((f.token_id, f.text, f.finish_reason, f.logprobs) for f in result.more_choices),
        ]
        if len(firsts) != self._n:
            raise EngineRequestFailed(
                f"prefill engine {self._prefill_slot.engine_id} returned {len(firsts)} first "
                f"tokens for n={self._n}",
                code="protocol_mismatch",
            )
        forks: list[Fork] = []
        for index, (token, text, reason, logprobs) in enumerate(firsts):
            info = self._infos[index]
            info.path = "forked"
            info.prefill_engine = self._prefill_slot.engine_id
            info.decode_engine = self._decode_slot.engine_id
            info.prompt_tokens = result.usage.prompt_tokens
            info.cached_tokens = result.usage.cached_tokens
            info.cache_write_tokens = result.usage.cache_write_tokens
            info.completion_tokens = 1
            finish = reason
            if reason is None and result.kv_handle is not None:
                forks.append(Fork(index, token))
            else:
                finish = reason or FinishReason.STOP
            self._put(
                index,
                Chunk(
                    text,
                    1,
                    finish,
                    (logprobs,) if logprobs else (),
                    result.prompt_logprobs,
                    (token,),
                ),
            )
        return forks

    async def _decode(self, result: PrefillResult, forks: list[Fork]) -> None:
        context, slot, request = self._context, self._decode_slot, self._request
        settings = context.settings
        whole_s, idle_s = settings.decode_timeout_s, settings.decode_idle_timeout_s
        decode_request = DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            kv_handle=result.kv_handle,
            first_token_id=forks[0].first_token_id,
            forks=tuple(forks),
            trace=request.trace,
        )
        started = time.perf_counter()
        context.pool.call_started(slot)
        stream = slot.connector.decode(decode_request, timeout_s=whole_s + BACKSTOP_GRACE_S)
        first = True
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
                except Exception as exc:
                    error = (
                        self._calls.decode_timed_out(request, slot, bound, first)
                        if isinstance(exc, TimeoutError)
                        else engine_error(exc, stage="decode")
                    )
                    if is_engine_fault(error):
                        context.pool.call_failed(slot)
                    raise error from exc
                finally:
                    self._infos[0].engine_wait_s += time.perf_counter() - waited
                if first:
                    first = False
                    context.pool.call_succeeded(slot)
                    handoff = delta.kv_transfer_s if delta.kv_transfer_s is not None else 0.0
                    context.metrics.ttft_phase_by("handoff").observe(handoff)
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
                self._infos[delta.choice].completion_tokens += len(delta.token_ids)
                self._put(
                    delta.choice,
                    Chunk(
                        delta.text,
                        len(delta.token_ids),
                        delta.finish_reason,
                        delta.logprobs,
                        token_ids=tuple(delta.token_ids),
                    ),
                )
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            if first:
                # The decode engine never started: release the KV the producer holds.
                self._calls.abort_later(self._prefill_slot, request)
