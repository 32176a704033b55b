"""The seam every caller of an engine service goes through: :class:`EngineConnector`, the calls on
one engine (Prefill, Decode, DecodeOnce, Abort) written once. The gRPC clients
(:class:`~services.serving.client.h2.H2EngineClient`,
:class:`~services.serving.client.grpc_aio.GrpcAioEngineClient`) implement it; the router holds
one per engine generation (:mod:`services.router.scheduling.connector`) and its tests use fakes.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Sequence

from services.engines.errors import EngineStalled, LoRANotServed
from services.engines.lora import LoRAAdapter
from services.engines.requests import DecodeRequest, PrefillResult, SamplingParams, TokenDelta
from services.engines.trace_context import TraceContext
from services.serving.wire.convert import merge_deltas


class EngineConnector(abc.ABC):
    """Calls on one engine. Safe to share between concurrent requests.

    Errors: the classes of :mod:`services.engines.errors` (``InvalidRequest``,
    ``EngineOverloaded``, ``EngineDraining``, ``UnknownKVHandle``, ``KVLeaseExpired``,
    ``ProducerUnavailable``, ``KVTransferFailed``, ``EngineFailed``...) as the engine raised
    them, and ``services.serving.errors.EngineUnreachable`` when the engine cannot be reached
    or the call outlives ``timeout_s`` (the transport's deadline). The router times its calls
    itself, with ``timeout_s`` as a backstop a little later, so that its own
    ``TimeoutError`` names the bound that tripped; it translates all of them (see
    :func:`services.router.errors.engine_error`).

    Every call of a request carries the request's W3C trace context when it has one (``trace``,
    or ``DecodeRequest.trace``): the gRPC connector sends it as the call's metadata.
    """

    @abc.abstractmethod
    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
        lora: LoRAAdapter | None = None,
    ) -> PrefillResult:
        """Prefill on this engine (with LoRA adapter ``lora`` when given); the KV is held for
        a consumer until the handle's lease."""

    @abc.abstractmethod
    def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens; closing the iterator early aborts the request."""

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        """The request's whole result as one delta (for a caller that does not stream it on).
        When no step comes within ``idle_timeout_s`` (the first included) the engine's request
        is aborted and :class:`~services.engines.errors.EngineStalled` raised; ``timeout_s``
        bounds the whole call. Cancelling the awaiting task aborts the request. A stream that
        ends without a finish is returned without one (the caller decides).

        This default reads :meth:`decode` to its end under the idle bound; the gRPC connector
        makes one ``DecodeOnce`` call instead (the engine enforces the bound)."""
        stream = self.decode(request, timeout_s=timeout_s)
        steps: list[TokenDelta] = []
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_timeout_s) as bound:
                        step = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if not bound.expired():
                        raise
                    raise EngineStalled(
                        f"no step of {request.request_id} within "
                        f"idle_timeout_s={idle_timeout_s:g} s"
                    ) from None
                steps.append(step)
                if step.finish_reason is not None:
                    break
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        return merge_deltas(steps) if steps else TokenDelta((), "")

    async def load_lora(
        self, adapter: LoRAAdapter, *, load_inplace: bool = False, timeout_s: float | None = None
    ) -> tuple[str, ...]:
        """Load ``adapter`` on this engine (``EngineService.LoadLoRA``); the names of the
        adapters it holds after. This default: a connector that carries no LoRA call."""
        raise LoRANotServed(f"this engine connector carries no LoRA call ({adapter.name!r})")

    async def unload_lora(self, name: str, *, timeout_s: float | None = None) -> bool:
        """Unload adapter ``name`` (``EngineService.UnloadLoRA``); ``False`` when the engine
        did not hold it. This default: a connector that carries no LoRA call."""
        raise LoRANotServed(f"this engine connector carries no LoRA call ({name!r})")

    @abc.abstractmethod
    async def abort(self, request_id: str, *, trace: TraceContext | None = None) -> bool:
        """Abort a request or release its held KV; ``False`` when the engine does not know it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection. Idempotent."""
