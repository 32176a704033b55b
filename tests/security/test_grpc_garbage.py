"""Raw garbage on the engines' gRPC methods: refused with a clear status code, never a crash.

``tests/integration/services/test_stub_host.py`` fuzzes well-formed protobuf messages with
hostile values and an oversized prompt. Here the bytes themselves are hostile: random and
truncated protobuf, wrong wire types, a length prefix promising far more than is sent, and a
message over the server's limit, sent to every method with serialization bypassed.

Contract (``services.serving.host.handlers``): bytes that do not parse as the RPC's request message
are ``INVALID_ARGUMENT`` naming the RPC and the message type, with ``pdserve-error:
InvalidRequest``, counted in ``pdserve_engine_requests_total{outcome="INVALID_ARGUMENT"}``,
without a traceback in the log; a message over the limit is gRPC's own
``RESOURCE_EXHAUSTED``; nothing is ever ``UNKNOWN`` or ``INTERNAL``, and the engine keeps
serving valid requests afterwards.
"""

from __future__ import annotations

import logging
import random

import grpc
import grpc.aio
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.requests import DecodeRequest, SamplingParams
from services.engines.stub import StubBackend
from services.serving.client.grpc_aio import GrpcAioEngineClient
from services.serving.host.config import EngineServiceSettings
from services.serving.wire.status import ERROR_KEY
from tests.integration.services.conftest import RunningHost, hosted, service_settings

pytestmark = pytest.mark.integration

# method path -> (rpc name, request message type, kind)
METHODS = {
    "/pdserve.v1.PrefillService/Prefill": ("Prefill", "pdserve.v1.PrefillRequest", "unary"),
    "/pdserve.v1.DecodeService/Decode": ("Decode", "pdserve.v1.DecodeRequest", "stream"),
    "/pdserve.v1.EngineService/Abort": ("Abort", "pdserve.v1.AbortRequest", "unary"),
    "/pdserve.v1.EngineService/GetLoad": ("GetLoad", "pdserve.v1.GetLoadRequest", "unary"),
}
NOT_SERVED_BY = {EngineRole.PREFILL: "Decode", EngineRole.DECODE: "Prefill"}
MAX_MESSAGE_BYTES = 64 * 1024
CALL_TIMEOUT_S = 10

# Invalid wire format whatever the message's fields are: every request type refuses them.
UNDECODABLE = [
    b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 10,  # field 1 (length-delimited) claims 4 GiB, sends 10
    b"\x0a\x05ab",  # truncated length-delimited field
    b"\x08",  # a varint field's tag and no value
    b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # varint longer than 10 bytes
    b"\x0b\x0b\x0b\x0b",  # start-group tags that never end
    b"\x0f\x00",  # wire type 7 does not exist
]


def garbage_payloads() -> list[bytes]:
    """Hostile bytes of every kind; some happen to parse for some message types."""
    rng = random.Random(8)
    payloads = [rng.randbytes(n) for n in (1, 7, 64, 4096)]
    payloads.append(b"\x12" + b"\x7f" + b"\xff" * 127)  # invalid UTF-8 in a string field 2
    # Field number 0 is invalid, yet protobuf (upb) accepts it for a message without fields
    # (GetLoadRequest): not in UNDECODABLE.
    payloads.append(b"\x00" * 32)
    return payloads + UNDECODABLE


async def _call(channel: grpc.aio.Channel, method: str, payload: bytes) -> None:
    if METHODS[method][2] == "unary":
        await channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)
    else:
        async for _ in channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S):
            pass


def _served(role: EngineRole) -> list[str]:
    return [path for path, (rpc, _, _) in METHODS.items() if rpc != NOT_SERVED_BY[role]]


def _invalid_argument_count(running: RunningHost, role: EngineRole, rpc: str) -> float:
    value = running.host.registry.get_sample_value(
        "pdserve_engine_requests_total",
        {
            "engine": running.host.engine_id,
            "role": role.value,
            "rpc": rpc,
            "outcome": "INVALID_ARGUMENT",
        },
    )
    return value or 0.0


def _settings(cp_settings: ControlPlaneSettings) -> EngineServiceSettings:
    settings = service_settings(cp_settings)
    return settings.model_copy(
        update={"grpc": settings.grpc.model_copy(update={"max_message_bytes": MAX_MESSAGE_BYTES})}
    )


async def _serves_valid_requests(prefill: RunningHost, decode: RunningHost) -> None:
    """Every RPC of both engines still answers a well-formed request."""
    sampling = SamplingParams(max_tokens=3)
    pre = GrpcAioEngineClient(prefill.endpoints.grpc)
    dec = GrpcAioEngineClient(decode.endpoints.grpc)
    try:
        result = await pre.prefill("after-garbage", [1, 2, 3], sampling)
        assert result.kv_handle is not None
        request = DecodeRequest("after-garbage-local", (1, 2, 3), sampling)
        deltas = [delta async for delta in dec.decode(request)]
        assert deltas and deltas[-1].finish_reason is not None
        for client in (pre, dec):
            assert await client.abort("never-started") is False
            assert (await client.get_load()).queue_depth == 0
            assert await client.health()
    finally:
        await pre.close()
        await dec.close()
    assert not prefill.task.done() and not decode.task.done()


async def test_undecodable_bytes_are_invalid_argument_on_every_rpc_and_counted(
    cp_settings: ControlPlaneSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with (
        hosted(
            _settings(cp_settings), StubBackend(), engine_id="prefill-u", role=EngineRole.PREFILL
        ) as pre,
        hosted(
            _settings(cp_settings), StubBackend(), engine_id="decode-u", role=EngineRole.DECODE
        ) as dec,
    ):
        for running, role in ((pre, EngineRole.PREFILL), (dec, EngineRole.DECODE)):
            async with grpc.aio.insecure_channel(running.endpoints.grpc) as channel:
                for method in _served(role):
                    rpc, message_type, _ = METHODS[method]
                    before = _invalid_argument_count(running, role, rpc)
                    for payload in UNDECODABLE:
                        with pytest.raises(grpc.aio.AioRpcError) as raised:
                            await _call(channel, method, payload)
                        error = raised.value
                        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, payload)
                        details = error.details() or ""
                        expected = f"{rpc}: the request could not be decoded as {message_type} "
                        assert details.startswith(expected), details
                        assert f"({len(payload)} bytes)" in details, details
                        trailing = dict(error.trailing_metadata() or ())
                        assert trailing.get(ERROR_KEY) == "InvalidRequest", trailing
                    counted = _invalid_argument_count(running, role, rpc) - before
                    assert counted == len(UNDECODABLE), (role, rpc, counted)
        await _serves_valid_requests(pre, dec)
    # grpc.aio logs a traceback for every request its deserializer fails on; ours never fails.
    loud = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not loud, [record.getMessage()[:200] for record in loud]


async def test_hostile_bytes_never_get_unknown_or_internal_and_the_engine_keeps_serving(
    cp_settings: ControlPlaneSettings,
) -> None:
    allowed = {
        grpc.StatusCode.INVALID_ARGUMENT,  # undecodable, or decoded but failing validation
        grpc.StatusCode.UNAVAILABLE,  # a decode request naming an unknown producer
        grpc.StatusCode.NOT_FOUND,
    }
    seen: dict[grpc.StatusCode, int] = {}
    async with (
        hosted(
            _settings(cp_settings), StubBackend(), engine_id="prefill-g", role=EngineRole.PREFILL
        ) as pre,
        hosted(
            _settings(cp_settings), StubBackend(), engine_id="decode-g", role=EngineRole.DECODE
        ) as dec,
    ):
        for running, role in ((pre, EngineRole.PREFILL), (dec, EngineRole.DECODE)):
            async with grpc.aio.insecure_channel(running.endpoints.grpc) as channel:
                for method in _served(role):
                    for payload in garbage_payloads():
                        try:
                            await _call(channel, method, payload)
                        except grpc.aio.AioRpcError as exc:
                            assert exc.code() in allowed, (method, payload[:16], exc)
                            seen[exc.code()] = seen.get(exc.code(), 0) + 1
                    # Over the server's limit: refused by gRPC itself before any decoding.
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await _call(channel, method, b"\x0a" * (MAX_MESSAGE_BYTES + 1))
                    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
        served_calls = len(_served(EngineRole.PREFILL)) + len(_served(EngineRole.DECODE))
        assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= served_calls * len(UNDECODABLE)
        await _serves_valid_requests(pre, dec)
