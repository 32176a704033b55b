"""The Decode RPC: validate, check the producer is READY at the handle's generation, stream.

A disaggregated request names its producer in the KV handle. Before the backend may start a
pull, :class:`ProducerGate` reads the producer's registration from the control plane: unknown,
not READY, or at another generation than the handle is UNAVAILABLE and nothing is pulled (a
restarted producer's old blocks are gone; its new NIXL agent must never be read with old
addresses); a decode engine or an incompatible one is INVALID_ARGUMENT
(:func:`~services.engines.producer_check.producer_refusal`); a producer with blocks of another
size than this engine's is UNAVAILABLE. The gate is the one owner of this check: backends do
not repeat it (the contract of :meth:`~services.engines.backend.EngineBackend.decode`).

Two RPCs over the same backend stream: ``Decode`` streams its steps; ``DecodeOnce`` answers
with all of them in one message and enforces the caller's idle bound itself
(:class:`_Collector`): a backend that produces no step within it gets its request aborted and
the call fails with :class:`~services.engines.errors.EngineStalled` at once, while the abort
finishes in the background (a stopped rank holds the backend's abort until it resumes, and the
caller must not wait on that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from services.engines.errors import EngineFailed, EngineStalled, InvalidRequest, RequestError
from services.engines.producer_check import ProducerViews
from services.engines.requests import DecodeRequest, FinishReason, KVHandle, TokenDelta, Usage
from services.proto_gen.pdserve.v1 import decode_pb2, decode_pb2_grpc
from services.serving.host.servicer import ServingState
from services.serving.wire import convert
from services.serving.wire.status import status_for
from services.serving.wire.trace_metadata import from_metadata

logger = logging.getLogger(__name__)

_ENDS_ALL = (FinishReason.ERROR,)
"""A finish that ends every sequence of the stream (a fork's STOP, LENGTH or ABORT ends its
own)."""


class ProducerGate:
    """Refuses handles whose producer is not READY at the handle's generation (see module);
    reads producers through the host's :class:`ProducerViews` (which ride out a short
    control-plane outage on remembered views, counted)."""

    def __init__(self, views: ProducerViews, *, compat_hash: str, block_size: int) -> None:
        self.views = views
        self.compat_hash = compat_hash
        self.block_size = block_size

    async def check(self, handle: KVHandle) -> None:
        refusal = await self.views.refusal(
            handle, compat_hash=self.compat_hash, block_size=self.block_size
        )
        if refusal is not None:
            raise refusal.exception()


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """``pdserve.v1.DecodeService`` over an engine backend (status codes in decode.proto).

    Errors before the first chunk are status codes; a failure after it ends the stream with a
    FINISH_REASON_ERROR chunk, as the proto says. Cancelling the call aborts the request.
    """

    def __init__(self, state: ServingState, gate: ProducerGate) -> None:
        self.state = state
        self.gate = gate
        self._unwinding: set[asyncio.Task[None]] = set()
        """Collectors of stalled or abandoned ``DecodeOnce`` calls, still closing their
        backend stream (kept referenced until they end)."""

    async def Decode(  # noqa: N802 (gRPC method name)
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[decode_pb2.DecodeRequest, decode_pb2.DecodeChunk],
    ) -> AsyncIterator[decode_pb2.DecodeChunk]:
        state = self.state
        async with state.rpc("Decode", context) as outcome:
            parsed = convert.decode_request_from_proto(
                request, state.limits, trace=from_metadata(context.invocation_metadata())
            )
            if parsed.forks and not state.backend.forks_decode:
                raise InvalidRequest(
                    f"engine {state.engine_id} cannot fork a decode: send one per choice"
                )
            # The stream ends once each of its sequences (forks) has finished.
            left = parsed.sequences
            if parsed.kv_handle is not None:
                await self.gate.check(parsed.kv_handle)
            outcome.request_id = parsed.request_id
            stream = state.backend.decode(parsed)
            try:
                # Pull errors come before the first delta: they become the call's status.
                first = await anext(stream)
                if first.kv_transfer_s is not None:
                    state.metrics.kv_pull_seconds.labels(state.engine_id).observe(
                        first.kv_transfer_s
                    )
                last = first
                failure_code = grpc.StatusCode.INTERNAL  # a backend's own ERROR finish
                yield convert.delta_to_proto(first)
                if first.finish_reason is not None:
                    left -= 1
                while left > 0 and last.finish_reason not in _ENDS_ALL:
                    try:
                        last = await anext(stream)
                    except StopAsyncIteration:
                        break
                    except (RequestError, EngineFailed) as exc:
                        last = self._failed(parsed.prompt_token_ids, exc)
                        failure_code = status_for(exc)[0]
                    if last.finish_reason is not None:
                        left -= 1
                    yield convert.delta_to_proto(last)
                # Outcome labels as in docs/metrics.md: ok, aborted, or a status code name.
                if last.finish_reason is FinishReason.ABORT:
                    outcome.label = "aborted"
                elif last.finish_reason is FinishReason.ERROR:
                    outcome.label = failure_code.name
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    # Closing runs the backend's release/abort: log a failure, never raise it
                    # over the call's own outcome.
                    try:
                        await aclose()
                    except Exception:
                        logger.exception(
                            "closing the decode stream of %s on engine %s failed",
                            parsed.request_id,
                            state.engine_id,
                        )

    async def DecodeOnce(  # noqa: N802 (gRPC method name)
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[decode_pb2.DecodeRequest, decode_pb2.DecodeChunk],
    ) -> decode_pb2.DecodeChunk:
        state = self.state
        async with state.rpc("DecodeOnce", context) as outcome:
            parsed = convert.decode_request_from_proto(
                request, state.limits, trace=from_metadata(context.invocation_metadata())
            )
            idle_s = convert.idle_timeout_from_proto(request)
            if parsed.forks:
                raise InvalidRequest(
                    "DecodeOnce decodes one sequence: a forked decode streams (Decode)"
                )
            outcome.request_id = parsed.request_id
            collector = _Collector(self, parsed.prompt_token_ids)
            # The producer check and the pull run within the idle bound, as a stream's first
            # message would.
            task = asyncio.get_running_loop().create_task(collector.run(parsed))
            try:
                loop = asyncio.get_running_loop()
                wait_s = idle_s
                while True:
                    await asyncio.wait((task,), timeout=wait_s)
                    if task.done():
                        break
                    wait_s = collector.last_step_at + idle_s - loop.time()
                    if wait_s <= 0:
                        what = "next" if collector.steps else "first"
                        raise EngineStalled(
                            f"engine {state.engine_id} produced no {what} token of "
                            f"{parsed.request_id} within idle_timeout_s={idle_s:g} s; "
                            "the request was aborted"
                        )
            finally:
                if not task.done():
                    # Stalled, or the caller went away: abort without waiting for the backend.
                    task.cancel()
                    self._unwinding.add(task)
                    task.add_done_callback(self._unwound)
            task.result()  # errors before the first step are the call's status (as Decode's)
            steps = collector.steps
            if not steps:  # the stream ended without a step: the caller sees no finish
                return decode_pb2.DecodeChunk()
            answer = convert.merge_deltas(steps)
            if answer.finish_reason is FinishReason.ABORT:
                outcome.label = "aborted"
            elif answer.finish_reason is FinishReason.ERROR:
                outcome.label = collector.failure_code.name
            return convert.delta_to_proto(answer)
        raise AssertionError("unreachable: rpc() aborts the call on error")

    def _unwound(self, task: asyncio.Task[None]) -> None:
        self._unwinding.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning(
                "an abandoned DecodeOnce on engine %s ended with %r",
                self.state.engine_id,
                task.exception(),
            )

    def _failed(self, prompt: tuple[int, ...], exc: Exception) -> TokenDelta:
        if isinstance(exc, EngineFailed):
            self.state.engine_failed(exc)
        logger.warning("decode stream on %s failed mid-way: %s", self.state.engine_id, exc)
        return TokenDelta(
            (), "", FinishReason.ERROR, Usage(len(prompt), 0), error=str(exc) or type(exc).__name__
        )


class _Collector:
    """Reads one backend decode stream to its finish for ``DecodeOnce`` (in its own task, so the
    RPC can give up on a stalled backend without waiting for the stream to close)."""

    def __init__(self, servicer: DecodeServicer, prompt: tuple[int, ...]) -> None:
        self._servicer = servicer
        self._prompt = prompt
        self.steps: list[TokenDelta] = []
        self.last_step_at = asyncio.get_running_loop().time()
        """Loop time of the last step (or of the start): the idle bound counts from it."""
        self.failure_code = grpc.StatusCode.INTERNAL
        """The status code name of a failure after the first step (the outcome label)."""

    async def run(self, request: DecodeRequest) -> None:
        servicer = self._servicer
        state = servicer.state
        if request.kv_handle is not None:
            await servicer.gate.check(request.kv_handle)
        stream = state.backend.decode(request)
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    step = await anext(stream)
                except StopAsyncIteration:
                    return
                except (RequestError, EngineFailed) as exc:
                    if not self.steps:
                        raise  # before the first step: the call's status
                    step = self._servicer._failed(self._prompt, exc)
                    self.failure_code = status_for(exc)[0]
                self.last_step_at = loop.time()
                if not self.steps and step.kv_transfer_s is not None:
                    state.metrics.kv_pull_seconds.labels(state.engine_id).observe(
                        step.kv_transfer_s
                    )
                self.steps.append(step)
                if step.finish_reason is not None:
                    return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()  # runs the backend's release/abort
                except Exception:
                    logger.exception("closing a DecodeOnce stream on %s failed", state.engine_id)
