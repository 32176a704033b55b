"""W3C trace context from the HTTP request to the engines, through real parts: a real router
(uvicorn, Redis control plane) with each of its gRPC clients (``h2``, pdserve's own, and
``grpcio``) in front of real engine hosts (grpc.aio servers, the stub engine).

The engines' gRPC servers record every call's invocation metadata (a server interceptor: what
the servicers read), and their backends record the trace context the servicers put in the
request. A request's ``traceparent`` and ``tracestate`` arrive unchanged with its Prefill,
Decode (streamed), DecodeOnce (not streamed) and the Abort that releases a prefill's KV when the
decode engine refused it; an invalid ``traceparent`` is not forwarded, and the router counts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.errors import EngineOverloaded
from services.engines.requests import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from services.engines.stub import StubBackend
from services.engines.trace_context import TraceContext
from services.router.config import EngineGrpcSettings, RouterSettings
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
REFUSED_PROMPT = [9, 9, 9]
"""The decode engine refuses a request with this prompt (overloaded): the router then aborts
the prefill engine's copy of it."""
WAIT_S = 20.0


class MetadataRecorder(grpc.aio.ServerInterceptor):
    """``(method, invocation metadata)`` of every call the server receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str | bytes]]] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(handler_call_details.invocation_metadata or ())  # type: ignore[arg-type]
        self.calls.append((handler_call_details.method, metadata))
        return await continuation(handler_call_details)

    def traced(self, method: str) -> list[tuple[Any, Any]]:
        """``(traceparent, tracestate)`` of each call of ``method`` (``Service/Method``)."""
        return [
            (metadata.get("traceparent"), metadata.get("tracestate"))
            for name, metadata in self.calls
            if name.endswith(method)
        ]


class RecordingBackend(StubBackend):
    """The stub engine, recording the trace context of each request it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.traces: list[tuple[str, TraceContext | None]] = []

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        self.traces.append(("prefill", request.trace))
        return await super().prefill(request)

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:  # type: ignore[override]
        self.traces.append(("decode", request.trace))
        if list(request.prompt_token_ids) == REFUSED_PROMPT:
            raise EngineOverloaded("refused for the test")
        async for delta in super().decode(request):
            yield delta


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> MetadataRecorder:
    """Every engine server of the test records its calls' metadata."""
    recorder = MetadataRecorder()
    server = grpc.aio.server

    def with_recorder(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        return server(*args, interceptors=[recorder], **kwargs)

    monkeypatch.setattr(grpc.aio, "server", with_recorder)
    return recorder


async def _waited(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("client", ["h2", "grpcio"])
async def test_the_trace_context_of_a_request_reaches_every_engine_call(
    cp_settings: ControlPlaneSettings,
    recorder: MetadataRecorder,
    client: str,
    stub_checkpoint: Path,
) -> None:
    settings = service_settings(cp_settings)
    prefill, decode = RecordingBackend(), RecordingBackend()
    router_settings = RouterSettings(
        control_plane=cp_settings,
        tokenizer=stub_checkpoint,
        served_model_name="stub",
        engine_grpc=EngineGrpcSettings(client=client),
        prefill_timeout_s=10,
        decode_timeout_s=10,
        max_prefill_attempts=1,
        local_fallback=False,
    )
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    sent = (TRACEPARENT, TRACESTATE)
    async with (
        hosted(settings, prefill, engine_id="prefill-t", role=EngineRole.PREFILL),
        hosted(settings, decode, engine_id="decode-t", role=EngineRole.DECODE),
        serving_router(router_settings) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        for stream in (True, False):
            body = {"model": "stub", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream}
            answer = await http.post("/v1/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
        assert recorder.traced("PrefillService/Prefill") == [sent, sent]
        assert recorder.traced("DecodeService/Decode") == [sent]
        assert recorder.traced("DecodeService/DecodeOnce") == [sent]
        trace = TraceContext(TRACEPARENT, TRACESTATE)
        assert prefill.traces == [("prefill", trace)] * 2
        assert decode.traces == [("decode", trace)] * 2

        # The decode engine refuses it: the Abort releasing the prefill's KV carries it too.
        body = {"model": "stub", "prompt": REFUSED_PROMPT, "max_tokens": 3}
        answer = await http.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 503, answer.text
        await _waited(lambda: bool(recorder.traced("EngineService/Abort")))
        assert recorder.traced("EngineService/Abort") == [sent]

        # Invalid (uppercase hex): not forwarded, counted, the request answered as usual.
        recorder.calls.clear()
        body = {"model": "stub", "prompt": [4, 5], "max_tokens": 2}
        answer = await http.post(
            "/v1/completions", json=body, headers={"traceparent": TRACEPARENT.upper()}
        )
        assert answer.status_code == 200, answer.text
        assert recorder.traced("Prefill") == [(None, None)]
        assert recorder.traced("DecodeOnce") == [(None, None)]
        assert prefill.traces[-1] == ("prefill", None)
        metrics = (await http.get("/metrics")).text
        assert 'pdserve_router_trace_context_dropped_total{header="traceparent"} 1.0' in metrics
