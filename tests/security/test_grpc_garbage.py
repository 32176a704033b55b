"""Raw garbage on the engines' gRPC methods: refused with a status code, never a crash.

``tests/integration/services/test_stub_host.py`` fuzzes well-formed protobuf messages with
hostile values and an oversized prompt. Here the bytes themselves are hostile: random and
truncated protobuf, wrong wire types, a length prefix promising far more than is sent, and a
message over the server's limit, sent to every method with serialization bypassed. Each call must
end with a gRPC status (never hang), and the engine must keep serving afterwards.

Known gap: bytes that do not parse as the request message are answered by grpc.aio itself
(deserialization happens before the servicer) with ``UNKNOWN`` "Error parsing message", not
``INVALID_ARGUMENT``; mapping that needs custom request deserializers in the server's handlers.
"""

from __future__ import annotations

import random

import grpc
import grpc.aio
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.backend import SamplingParams
from services.serving.client import EngineClient
from services.serving.stub_backend import StubBackend
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

METHODS = {
    "/pdserve.v1.PrefillService/Prefill": "unary",
    "/pdserve.v1.DecodeService/Decode": "stream",
    "/pdserve.v1.EngineService/Abort": "unary",
    "/pdserve.v1.EngineService/GetLoad": "unary",
}
MAX_MESSAGE_BYTES = 64 * 1024


def garbage_payloads() -> list[bytes]:
    rng = random.Random(8)
    payloads = [rng.randbytes(n) for n in (1, 7, 64, 4096)]
    payloads += [
        b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 10,  # field 1 (string) claims 4 GiB, sends 10 bytes
        b"\x0a\x05ab",  # truncated length-delimited field
        b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # varint longer than 10 bytes
        b"\x0b\x0b\x0b\x0b",  # start-group tags that never end
        b"\x12" + b"\x7f" + b"\xff" * 127,  # invalid UTF-8 in a string field
        b"\x00" * 32,  # field number 0 is invalid
    ]
    return payloads


async def _call(channel: grpc.aio.Channel, method: str, kind: str, payload: bytes) -> None:
    if kind == "unary":
        await channel.unary_unary(method)(payload, timeout=10)
    else:
        async for _ in channel.unary_stream(method)(payload, timeout=10):
            pass


async def test_garbage_bytes_get_a_status_code_and_the_engine_keeps_serving(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    settings = settings.model_copy(
        update={"grpc": settings.grpc.model_copy(update={"max_message_bytes": MAX_MESSAGE_BYTES})}
    )
    allowed = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INTERNAL,  # grpc's own "failed to deserialize" answer
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # over the message limit
        grpc.StatusCode.UNAVAILABLE,  # a decode request naming an unknown producer
        grpc.StatusCode.NOT_FOUND,
    }
    seen: dict[grpc.StatusCode, int] = {}
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-g", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-g", role=EngineRole.DECODE) as dec,
    ):
        served = {pre.endpoints.grpc: "Decode", dec.endpoints.grpc: "Prefill"}
        for endpoint, not_served in served.items():
            async with grpc.aio.insecure_channel(endpoint) as channel:
                for method, kind in METHODS.items():
                    if method.endswith("/" + not_served):
                        continue
                    for payload in [*garbage_payloads(), b"\x0a" * (MAX_MESSAGE_BYTES + 1)]:
                        try:
                            await _call(channel, method, kind, payload)
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() is grpc.StatusCode.UNKNOWN:
                                # grpc.aio's own answer when the request does not parse (before
                                # any pdserve code runs); known gap, see the module docstring.
                                assert "Error parsing message" in (exc.details() or ""), exc
                            else:
                                assert exc.code() in allowed, (method, payload[:16], exc)
                            seen[exc.code()] = seen.get(exc.code(), 0) + 1
        calls = 2 * (len(METHODS) - 1)  # each engine serves its own service and EngineService
        assert seen.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) >= calls
        assert sum(seen.values()) >= calls * 5
        client = EngineClient(pre.endpoints.grpc)
        result = await client.prefill("after-garbage", [1, 2, 3], SamplingParams(max_tokens=2))
        assert result.kv_handle is not None and await client.health()
        await client.close()
        assert not pre.task.done() and not dec.task.done()
