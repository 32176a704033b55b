"""Running one request on the engines a :class:`~services.router.scheduling.scheduler.Plan` names.

:meth:`Executor.runs` is the one entry: one :meth:`Executor.generate` per choice of a prompt,
whose first leg, where the plan's engines fork, is one shared Prefill and forked Decode
(:mod:`services.router.execution.fork`); every choice has the failover and migration below
either way. :meth:`Executor.generate` is an async generator of
:class:`Chunk`. The HTTP layer awaits the first chunk before it answers, so every failure up to
the first token (no engine, every prefill attempt failed, a decode engine refusing the request)
is an ordinary OpenAI error;
a failure after it raises :class:`~services.router.errors.EngineRequestFailed` from the
generator, which the streaming layer turns into an error event (never a silent truncation).

Disaggregated: Prefill on the prefill engine (retried on another compatible engine when the
failure is the engine's, :meth:`EngineCalls.prefill`), the first token goes out, then Decode
with the KV handle on the decode engine. Local: Decode without a handle. A decode stream that
ends without a finish reason is an error (``decode_truncated``). A request whose decode engine,
or the producer of its KV, fails continues on other engines
(:mod:`services.router.execution.migration`: legs, prefill failover, migration; the request's
output across them is a :class:`Progress`); every engine call feeds the engine's circuit
breaker (:mod:`services.router.scheduling.health`).

Bounds: every engine call is timed by the router itself, aborted on the engine when a bound
trips and counted (:mod:`services.router.execution.engine_calls`). The request, its chunks and its
``RunInfo`` are :mod:`services.router.execution.generation`'s.

Time accounting (``RunInfo``): ``engine_wait_s`` sums the time spent awaiting engine calls, so
router overhead = end-to-end minus it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import replace

from services.control_plane.wire import EngineId
from services.engines.requests import FinishReason, PrefillResult, SamplingParams
from services.router.config import RouterSettings
from services.router.errors import EngineRequestFailed, RouterError
from services.router.execution.engine_calls import EngineCalls
from services.router.execution.fork import ForkedChoice, ForkedLeg, forked_leg
from services.router.execution.generation import Chunk, ChunkStream, GenerationRequest, RunInfo
from services.router.execution.migration import (
    PRODUCER_GONE,
    LegFailed,
    NoContinuation,
    Step,
    is_engine_fault,
    is_migratable,
)
from services.router.metrics import RouterMetrics
from services.router.scheduling.pool import EnginePool, EngineSlot
from services.router.scheduling.scheduler import Scheduler
from services.tokenization.output_text import OutputText
from services.tokenization.tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)


ENDS_BEFORE_INCOMPLETE = frozenset({"vllm"})
"""Engine kinds whose text ends before a trailing incomplete UTF-8 character (vLLM's
detokenizer never releases one); the others release it, as ``U+FFFD``, when the request ends.
A continued request's text, which the router detokenizes, ends as its last engine's would."""
CONTEXT_FREE_TEXT = frozenset({"stub", "sim"})
"""Engine kinds whose text for a token depends on that token alone (the synthetic engines'
``" t<id>"``): a continuation on them keeps the engines' text. The router's tokenizer could not
reproduce it (their ids run past its vocabulary: a drained sim engine's request once failed
there instead of migrating)."""


class Progress:
    """A request's output across legs: the tokens so far, and (from the first continuation
    on) the router's own detokenization of them (:mod:`services.router.execution.migration`,
    "Text")."""

    def __init__(self, prompt_token_ids: tuple[int, ...], sampling: SamplingParams) -> None:
        self._prompt = prompt_token_ids
        self._sampling = sampling
        self.generated: list[int] = []
        self._text: OutputText | None = None
        self.legs = 1
        self.continuing = False
        """Whether the current leg is a continuation (``legs > 1``)."""
        self.engine_kind: str | None = None
        """The kind of the current leg's decode engine (set once it is planned): the request's
        text ends by its rule (:data:`ENDS_BEFORE_INCOMPLETE`), and keeps its text where it is
        context-free (:data:`CONTEXT_FREE_TEXT`)."""

    def next_leg(self, tokenizer: Tokenizer) -> None:
        """Start a continuation of what was produced so far."""
        self.legs += 1
        self.continuing = True
        if self.engine_kind in CONTEXT_FREE_TEXT:
            return  # the engines' text stays exact across the join
        if self._text is None and self.generated:
            # Replaying the tokens marks released what the engines released (the same rule).
            self._text = OutputText(
                tokenizer,
                self._sampling.stop,
                already_released=self.generated,
                include_stop=self._sampling.include_stop_str_in_output,
                min_tokens=self._sampling.min_tokens,
            )

    def prompt(self) -> tuple[int, ...]:
        """The current leg's prompt: the original one plus every token produced so far."""
        return self._prompt + tuple(self.generated)

    def sampling(self) -> SamplingParams:
        """The current leg's sampling: what is left of ``max_tokens`` and ``min_tokens``; the
        prompt's logprobs went out with the first leg; the tokens so far, at the end of the
        leg's prompt, counted as output (``output_tokens_in_prompt``: the output penalties and
        a seeded random stream continue as in an unbroken run)."""
        if not self.generated:
            return self._sampling
        return replace(
            self._sampling,
            max_tokens=self.left(),
            min_tokens=max(self._sampling.min_tokens - len(self.generated), 0),
            prompt_logprobs=None,
            output_tokens_in_prompt=len(self.generated),
        )

    def left(self) -> int:
        return self._sampling.max_tokens - len(self.generated)

    def add(self, step: Step) -> tuple[str, FinishReason | None]:
        """Record ``step``; the text to send the client and the finish reason (a stop string
        the router found across the join finishes the request with ``stop``)."""
        self.generated.extend(step.token_ids)
        if self._text is None:
            return step.text, step.finish_reason
        ids = step.token_ids
        if (
            step.finish_reason is FinishReason.STOP
            and ids
            and ids[-1] in self._sampling.stop_token_ids
        ):
            ids = ids[:-1]  # a stop id is never returned as text
        pieces = []
        for token_id in ids:
            pieces.append(self._text.add(token_id))
            if self._text.stopped:
                return "".join(pieces), FinishReason.STOP
        if step.finish_reason is not None:
            pieces.append(
                self._text.flush(incomplete=self.engine_kind not in ENDS_BEFORE_INCOMPLETE)
            )
        return "".join(pieces), step.finish_reason

    def finish_text(self) -> str:
        """Text still held when the request ends without another step (``max_tokens`` were
        all produced when the broken leg ended)."""
        if self._text is None:
            return ""
        return self._text.flush(incomplete=self.engine_kind not in ENDS_BEFORE_INCOMPLETE)


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
        model_tokenizers: Mapping[str, Tokenizer] | None = None,
    ) -> None:
        """``model_tokenizers``: each served base model's tokenizer (a migration's text so
        far), by the name its engines register; ``tokenizer`` for a model not in it."""
        self._pool = pool
        self._scheduler = scheduler
        self._settings = settings
        self._metrics = metrics
        self._tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self._model_tokenizers = dict(model_tokenizers or {})
        self.calls = EngineCalls(pool, scheduler, settings, metrics)
        """The engine calls and their aborts (shared with :mod:`services.router.execution.fork`)."""

    def runs(self, requests: list[GenerationRequest], infos: list[RunInfo]) -> list[ChunkStream]:
        """The chunk streams of one prompt's choices (``requests[i]`` is choice ``i``, filling
        ``infos[i]``), each run by :meth:`generate`, with failover and migration. Where the
        plan's engines fork, the choices' first leg is one :class:`ForkedLeg` (one prefill and
        one transfer, :mod:`services.router.execution.fork`); which path ran is counted."""
        leg = None
        if len(requests) > 1:
            leg = forked_leg(
                requests,
                infos,
                self._scheduler,
                self.calls,
                pool=self._pool,
                settings=self._settings,
                metrics=self._metrics,
            )
        if leg is None:
            return [self.generate(r, i) for r, i in zip(requests, infos, strict=True)]
        return [
            ForkedChoice(self.generate(r, i, (leg, index)), leg)
            for index, (r, i) in enumerate(zip(requests, infos, strict=True))
        ]

    async def generate(
        self,
        request: GenerationRequest,
        info: RunInfo,
        forked: tuple[ForkedLeg, int] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Run ``request``; see the module docstring. ``info`` is filled as it goes.
        ``forked``: its first leg is choice ``index`` of a shared ``(leg, index)``."""
        info.prompt_tokens = len(request.prompt_token_ids)
        progress = Progress(request.prompt_token_ids, request.sampling)
        avoid_prefill: set[EngineId] = set()
        avoid_decode: set[EngineId] = set()
        kv_failovers = migrations = 0
        last_error: RouterError | None = None
        moving: str | None = None  # a migration's reason: its leg counts it once it has engines

        while True:
            if progress.left() <= 0:  # the broken leg had sent every token already
                yield Chunk(progress.finish_text(), 0, FinishReason.LENGTH)
                return
            leg = self._leg(
                request,
                progress,
                info,
                avoid_prefill,
                avoid_decode,
                moving,
                None if progress.continuing else forked,
            )
            moving = None
            try:
                try:
                    step = await anext(leg)
                except NoContinuation as nowhere:
                    assert last_error is not None
                    # One replica of the role: the client gets the failure itself, at once.
                    raise EngineRequestFailed(
                        f"{last_error.message} (and it could not continue elsewhere: "
                        f"{nowhere.error.message})",
                        code=last_error.code,
                        status_code=last_error.status_code,
                    ) from last_error
                while True:
                    text, finish = progress.add(step)
                    info.completion_tokens = len(progress.generated)
                    yield Chunk(
                        text,
                        len(step.token_ids),
                        finish,
                        step.logprobs,
                        step.prompt_logprobs,
                        step.token_ids,
                    )
                    if finish is not None:  # (a stop string found across a join ends the leg)
                        return
                    try:
                        step = await anext(leg)
                    except StopAsyncIteration:
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
                progress.next_leg(self._model_tokenizers.get(request.model, self._tokenizer))
            finally:
                await leg.aclose()

    async def _leg(
        self,
        request: GenerationRequest,
        progress: Progress,
        info: RunInfo,
        avoid_prefill: set[EngineId],
        avoid_decode: set[EngineId],
        moving: str | None,
        forked: tuple[ForkedLeg, int] | None,
    ) -> AsyncGenerator[Step, None]:
        """One leg of ``request`` (see services.router.execution.migration): plan (a migration,
        ``moving`` its reason, counted once planned), prefill, decode; ``forked``: the plan,
        Prefill and Decode are choice
        ``index`` of a shared ``(leg, index)``. Raises :class:`LegFailed` when another leg may
        succeed, :class:`NoContinuation` when a continuation finds no engines, the error itself
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
        prompt = leg_request.prompt_info()
        if forked is not None:
            plan = forked[0].plan
        else:
            try:
                plan = self._scheduler.plan(
                    request.model, prompt, avoid_prefill=avoid_prefill, avoid_decode=avoid_decode
                )
            except RouterError as exc:
                if not continuing:
                    raise
                raise NoContinuation(exc) from exc
        if moving is not None:
            info.migrations += 1
            self._metrics.migrations.labels(reason=moving).inc()
        progress.engine_kind = plan.decode.record.engine_kind
        if not continuing and forked is None:
            self._metrics.queue_time.observe(time.perf_counter() - request.arrival_s)
        info.decode_engine = plan.decode.engine_id
        with self._pool.reserve(plan.decode):
            prefill_slot: EngineSlot | None = None
            result: PrefillResult | None = None
            if forked is not None:
                result, prefill_slot = await forked[0].prefilled()
                info.prefill_engine = prefill_slot.engine_id
            elif plan.prefill is not None:
                result, prefill_slot = await self.calls.prefill(leg_request, plan, prompt, info)
            if result is None:
                info.prefill_engine = None
                if not continuing:
                    info.path = "local"
                    self._metrics.execution_path_by("local").inc()
                async for step in self._decode_leg(leg_request, plan.decode, None, info, progress):
                    yield step
                return
            assert prefill_slot is not None
            if forked is not None:
                info.path = "forked"
                first = forked[0].first_step(result, forked[1])
            else:
                first = Step(
                    (result.first_token_id,),
                    result.text,
                    result.finish_reason,
                    (result.logprobs,) if result.logprobs is not None else (),
                    result.prompt_logprobs,
                )
            if not continuing:
                # Per choice, forked or not: vLLM's TTFT observes each of a request's n.
                self._metrics.execution_path_by(str(info.path)).inc()
                ttft_s = time.perf_counter() - request.arrival_s
                self._metrics.ttft_by(str(info.path)).observe(ttft_s)
                info.cached_tokens = result.usage.cached_tokens
                info.cache_write_tokens = result.usage.cache_write_tokens
            if first.finish_reason is not None or result.kv_handle is None:
                yield replace(first, finish_reason=first.finish_reason or FinishReason.STOP)
                return
            handed_off = False
            steps = (
                forked[0].decode(forked[1])
                if forked is not None
                else self._decode_leg(leg_request, plan.decode, result, info, progress)
            )
            try:
                yield first
                async for step in steps:
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
                if not handed_off and forked is None:
                    # The decode engine never started: release the KV the producer holds (a
                    # forked leg releases it once, for every choice).
                    self.calls.abort_later(prefill_slot, leg_request)

    async def _decode_leg(
        self,
        request: GenerationRequest,
        slot: EngineSlot,
        prefilled: PrefillResult | None,
        info: RunInfo,
        progress: Progress,
    ) -> AsyncIterator[Step]:
        """:meth:`EngineCalls.decode` with the breaker fed; a failure another leg may get past
        is raised as :class:`LegFailed`."""
        slot.health.begin_call()
        got_delta = False
        try:
            async for step in self.calls.decode(
                request, slot, prefilled, info, progress.continuing
            ):
                if not got_delta:
                    got_delta = True
                    slot.health.success()
                yield step
        except RouterError as exc:
            producer_blamed = not got_delta and prefilled is not None and exc.code in PRODUCER_GONE
            if is_engine_fault(exc) and not producer_blamed:
                self._pool.call_failed(slot)
            if producer_blamed or is_migratable(exc):
                raise LegFailed(exc, slot, None) from exc
            raise

    def observe_end(
        self,
        request_arrival_s: float,
        endpoint: str,
        outcome: str,
        info: RunInfo | None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        """Count the answered request, its end-to-end latency and router overhead, and its
        prompt and generated tokens: ``tokens`` (a request of several choices or prompts: its
        usage's) or else ``info``'s, when the request reached an engine."""
        self._metrics.requests_by(endpoint, outcome).inc()
        self.observe_latency(request_arrival_s, endpoint, info)
        if tokens is None and info is not None and info.path is not None:
            tokens = (info.prompt_tokens, info.completion_tokens)
        if tokens is not None:
            self._metrics.prompt_tokens.observe(tokens[0])
            self._metrics.generation_tokens.observe(tokens[1])

    def observe_latency(
        self, request_arrival_s: float, endpoint: str, info: RunInfo | None
    ) -> None:
        """The request's end-to-end latency and router overhead, without counting it (an
        error raised to the HTTP layer is counted by its handler)."""
        elapsed = time.perf_counter() - request_arrival_s
        self._metrics.e2e_by(endpoint).observe(elapsed)
        if info is not None and info.path is not None:
            self._metrics.overhead.observe(max(elapsed - info.engine_wait_s, 0.0))

    async def close(self) -> None:
        """Wait for the engine aborts still under way."""
        await self.calls.close()
