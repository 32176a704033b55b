"""What every engine service's servicers share: admission, error translation, the Engine service.

:class:`ServingState` is the one object the servicers of an engine share with its host: the
backend, the request limits, whether requests are admitted (only while READY and not draining),
the metrics, and the way a servicer reports that the engine failed (the host then exits
non-zero). :meth:`ServingState.rpc` wraps every RPC: it refuses work when not admitting, turns
errors into status codes with :func:`services.serving.wire.status.status_for`, aborts the request on
the backend when the caller goes away, and counts the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from services.engines.backend import BackendDescription, EngineBackend
from services.engines.errors import EngineDraining, EngineFailed, RequestError
from services.engines.lora import LoRAAdapter
from services.engines.requests import RequestLimits
from services.proto_gen.pdserve.v1 import engine_pb2, engine_pb2_grpc
from services.serving.host.metrics import EngineServiceMetrics
from services.serving.wire import convert, fields
from services.serving.wire.status import status_for

logger = logging.getLogger(__name__)

AnyContext = grpc.aio.ServicerContext[Any, Any]


@dataclass
class RpcOutcome:
    """Filled in by a servicer while it runs: the request to abort if the caller goes away,
    and the outcome label for ``pdserve_engine_requests_total`` when it succeeds."""

    request_id: str | None = None
    label: str = "ok"


class ServingState:
    """The state an engine's servicers share with its host (see the module docstring)."""

    def __init__(
        self,
        backend: EngineBackend,
        description: BackendDescription,
        metrics: EngineServiceMetrics,
        *,
        engine_id: str,
        on_engine_failed: Callable[[EngineFailed], None],
    ) -> None:
        self.backend = backend
        self.description = description
        self.limits = RequestLimits.of(description)
        self.metrics = metrics
        self.engine_id = engine_id
        self.generation = 0
        self.admitting = False
        self.draining = False
        self._on_engine_failed = on_engine_failed

    def check_admitting(self) -> None:
        if self.admitting:
            return
        if self.draining:
            raise EngineDraining(f"engine {self.engine_id} is draining and admits no new request")
        raise EngineDraining(f"engine {self.engine_id} is not serving yet (not READY)")

    @contextlib.asynccontextmanager
    async def rpc(
        self, name: str, context: AnyContext, *, admit: bool = True
    ) -> AsyncIterator[RpcOutcome]:
        """Run one RPC's body; see the module docstring. ``admit=False`` for RPCs that are
        served while draining (Abort, GetLoad)."""
        outcome = RpcOutcome()
        try:
            if admit:
                self.check_admitting()
            yield outcome
        except (asyncio.CancelledError, GeneratorExit):
            # The caller cancelled or went away: the engine must not keep working for nobody.
            self.metrics.count_request(name, grpc.StatusCode.CANCELLED.name)
            if outcome.request_id is not None:
                await self.abort_quietly(outcome.request_id)
            raise
        except Exception as exc:
            code, details, metadata = status_for(exc)
            if isinstance(exc, EngineFailed):
                logger.error("engine %s failed during %s: %s", self.engine_id, name, exc)
                self._on_engine_failed(exc)
            elif not isinstance(exc, RequestError):
                logger.exception("%s on engine %s failed unexpectedly", name, self.engine_id)
            self.metrics.count_request(name, code.name)
            await context.abort(code, details, metadata)
        else:
            self.metrics.count_request(name, outcome.label)

    def engine_failed(self, exc: EngineFailed) -> None:
        """Report a failure noticed outside :meth:`rpc` (a stream that failed mid-way)."""
        self._on_engine_failed(exc)

    async def abort_quietly(self, request_id: str) -> None:
        """Abort on the backend when cleaning up; a failure here is logged, never raised."""
        try:
            await self.backend.abort(request_id)
        except Exception:
            logger.exception("aborting %s on engine %s failed", request_id, self.engine_id)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Abort and GetLoad: served in every state, draining included; LoadLoRA and UnloadLoRA
    while the engine admits requests (READY, not draining)."""

    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def Abort(  # noqa: N802 (gRPC method name)
        self,
        request: engine_pb2.AbortRequest,
        context: grpc.aio.ServicerContext[engine_pb2.AbortRequest, engine_pb2.AbortResponse],
    ) -> engine_pb2.AbortResponse:
        async with self.state.rpc("Abort", context, admit=False):
            request_id = fields.validate_request_id(request.request_id)
            found = await self.state.backend.abort(request_id)
            return engine_pb2.AbortResponse(found=found)
        raise AssertionError("unreachable: rpc() aborts the call on error")

    async def GetLoad(  # noqa: N802 (gRPC method name)
        self,
        request: engine_pb2.GetLoadRequest,
        context: grpc.aio.ServicerContext[engine_pb2.GetLoadRequest, engine_pb2.LoadStats],
    ) -> engine_pb2.LoadStats:
        async with self.state.rpc("GetLoad", context, admit=False):
            load = self.state.backend.load()
            self.state.metrics.observe_load(load)
            return convert.load_to_proto(
                load,
                engine_id=self.state.engine_id,
                generation=self.state.generation,
                draining=self.state.draining,
            )
        raise AssertionError("unreachable: rpc() aborts the call on error")

    async def LoadLoRA(  # noqa: N802 (gRPC method name)
        self,
        request: engine_pb2.LoadLoRARequest,
        context: grpc.aio.ServicerContext[engine_pb2.LoadLoRARequest, engine_pb2.LoRAAdapters],
    ) -> engine_pb2.LoRAAdapters:
        async with self.state.rpc("LoadLoRA", context):
            adapter = convert.lora_from_proto(request.adapter)
            held = await self.state.backend.load_lora(adapter, replace=request.load_inplace)
            return engine_pb2.LoRAAdapters(names=list(held))
        raise AssertionError("unreachable: rpc() aborts the call on error")

    async def UnloadLoRA(  # noqa: N802 (gRPC method name)
        self,
        request: engine_pb2.UnloadLoRARequest,
        context: grpc.aio.ServicerContext[
            engine_pb2.UnloadLoRARequest, engine_pb2.UnloadLoRAResponse
        ],
    ) -> engine_pb2.UnloadLoRAResponse:
        async with self.state.rpc("UnloadLoRA", context):
            LoRAAdapter(request.name, "-").validate()  # the name's bounds
            found = await self.state.backend.unload_lora(request.name)
            return engine_pb2.UnloadLoRAResponse(found=found)
        raise AssertionError("unreachable: rpc() aborts the call on error")
