"""``DecodeOnce`` (the unary decode of a non-streamed request) over real gRPC against the stub
engine's host: the one answer equals the stream's steps together; the engine enforces the
caller's idle bound itself (a stalled backend ends the call with ``EngineStalled`` at once, even
while its abort waits on the stalled work, and the request is aborted); a caller that goes away
aborts the request; bad calls are refused with a status, and an engine without the RPC is a
translated error, not a crash."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import grpc.aio
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.errors import EngineStalled, InvalidRequest, ProducerUnavailable
from services.engines.requests import DecodeRequest, FinishReason, Fork, SamplingParams, TokenDelta
from services.engines.stub import StubBackend, StubOptions
from services.proto_gen.pdserve.v1 import decode_pb2, decode_pb2_grpc
from services.router.errors import engine_error
from services.serving.client.grpc_aio import GrpcAioEngineClient
from services.serving.errors import ProtocolMismatch
from services.serving.wire import convert
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

CALL_BOUND_S = 60.0
"""Client-side bound of every call; hitting it is a hang and fails the test."""


class StallingStub(StubBackend):
    """The stub engine, whose decode stalls after ``after`` steps the way a stopped rank does:
    no step comes, and aborting the request waits for the rank too (until ``resumed``)."""

    def __init__(self, after: int, options: StubOptions | None = None) -> None:
        super().__init__(options)
        self.after = after
        self.resumed = asyncio.Event()
        self.closed: list[str] = []

    def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        return self._stalling(request, super().decode(request))

    async def _stalling(
        self, request: DecodeRequest, inner: AsyncIterator[TokenDelta]
    ) -> AsyncIterator[TokenDelta]:
        try:
            sent = 0
            async for delta in inner:
                if sent == self.after:
                    await self.resumed.wait()
                yield delta
                sent += 1
        finally:
            await self.resumed.wait()
            self.closed.append(request.request_id)
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()


def requests_of(host: object, engine_id: str, outcome: str) -> float | None:
    registry = host.registry  # type: ignore[attr-defined]
    value: float | None = registry.get_sample_value(
        "pdserve_engine_requests_total",
        {"engine": engine_id, "role": "decode", "rpc": "DecodeOnce", "outcome": outcome},
    )
    return value


async def running_requests(client: GrpcAioEngineClient, expected: int) -> int:
    """The engine's running requests, polled until ``expected`` (bounded)."""
    for _ in range(int(CALL_BOUND_S / 0.02)):
        load = await client.get_load()
        if load.running_requests == expected:
            break
        await asyncio.sleep(0.02)
    return load.running_requests


async def test_decode_once_answers_what_the_stream_sends_in_one_message(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-o", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-o", role=EngineRole.DECODE) as dec,
    ):
        prefill, decode = (
            GrpcAioEngineClient(pre.endpoints.grpc),
            GrpcAioEngineClient(dec.endpoints.grpc),
        )
        prompt, sampling = (5, 6, 7), SamplingParams(max_tokens=6)
        answers = []
        for request_id in ("streamed", "once"):
            result = await prefill.prefill(request_id, prompt, sampling)
            request = DecodeRequest(
                request_id, prompt, sampling, result.kv_handle, result.first_token_id
            )
            if request_id == "streamed":
                answers.append(convert.merge_deltas([d async for d in decode.decode(request)]))
            else:
                answers.append(
                    await asyncio.wait_for(
                        decode.decode_once(request, idle_timeout_s=30), CALL_BOUND_S
                    )
                )
        streamed, once = answers
        assert len(once.token_ids) == 5 and once.finish_reason is FinishReason.LENGTH
        assert (once.token_ids, once.text, once.usage) == (
            streamed.token_ids,
            streamed.text,
            streamed.usage,
        )
        assert once.kv_transfer_s is not None  # the first step's, as the stream's first message
        assert requests_of(dec.host, "decode-o", "ok") == 1.0
        await prefill.close()
        await decode.close()


async def test_a_stalled_engine_ends_decode_once_with_engine_stalled_and_aborts_the_request(
    cp_settings: ControlPlaneSettings,
) -> None:
    """The stall answers within the idle bound although the backend's abort is still waiting
    on the stalled work (as a stopped rank holds it); once that resumes, the request is gone."""
    settings = service_settings(cp_settings)
    backend = StallingStub(after=2)
    async with hosted(settings, backend, engine_id="decode-s", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        request = DecodeRequest("stalls", (1, 2, 3), SamplingParams(max_tokens=50))
        with pytest.raises(EngineStalled, match=r"idle_timeout_s=0\.3") as stalled:
            await asyncio.wait_for(client.decode_once(request, idle_timeout_s=0.3), CALL_BOUND_S)
        assert "next token" in str(stalled.value)
        routed = engine_error(stalled.value, stage="decode")
        assert (routed.code, routed.status_code) == ("engine_timeout", 504)
        assert requests_of(dec.host, "decode-s", "DEADLINE_EXCEEDED") == 1.0
        assert backend.closed == []  # the abort still waits on the stalled work
        assert (await client.get_load()).running_requests == 1
        backend.resumed.set()
        assert await running_requests(client, 0) == 0
        assert backend.closed == ["stalls"]
        load = await client.get_load()
        assert load.kv_blocks_free == load.kv_blocks_total
        await client.close()


async def test_a_caller_that_goes_away_aborts_the_decode_once_request(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    backend = StubBackend(StubOptions(token_delay_s=0.02))
    async with hosted(settings, backend, engine_id="decode-g", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        request = DecodeRequest("leaves", (1, 2, 3), SamplingParams(max_tokens=5000))
        call = asyncio.create_task(client.decode_once(request, idle_timeout_s=30))
        assert await running_requests(client, 1) == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await running_requests(client, 0) == 0
        load = await client.get_load()
        assert load.kv_blocks_free == load.kv_blocks_total
        for _ in range(int(CALL_BOUND_S / 0.02)):
            if requests_of(dec.host, "decode-g", "CANCELLED") == 1.0:
                break
            await asyncio.sleep(0.02)
        assert requests_of(dec.host, "decode-g", "CANCELLED") == 1.0
        await client.close()


async def test_decode_once_refuses_bad_bounds_forks_and_orphan_handles_and_a_prefill_lacks_it(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-r", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-r", role=EngineRole.DECODE) as dec,
    ):
        channel = grpc.aio.insecure_channel(dec.endpoints.grpc)
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        for bad in (
            decode_pb2.DecodeRequest(request_id="no-bound", token_ids=[1]),
            decode_pb2.DecodeRequest(request_id="zero", token_ids=[1], idle_timeout_s=0.0),
            decode_pb2.DecodeRequest(request_id="nan", token_ids=[1], idle_timeout_s=float("nan")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.DecodeOnce(bad, timeout=CALL_BOUND_S)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "idle_timeout_s" in (caught.value.details() or "")
        await channel.close()
        prefill, decode = (
            GrpcAioEngineClient(pre.endpoints.grpc),
            GrpcAioEngineClient(dec.endpoints.grpc),
        )
        sampling = SamplingParams(max_tokens=4)  # (the stub prefills one choice)
        result = await prefill.prefill("forked", (5, 6), sampling)
        forks = (Fork(0, result.first_token_id), Fork(1, result.first_token_id))
        request = DecodeRequest(
            "forked", (5, 6), sampling, result.kv_handle, result.first_token_id, forks=forks
        )
        with pytest.raises(InvalidRequest, match="forked decode streams"):
            await decode.decode_once(request, idle_timeout_s=30, timeout_s=CALL_BOUND_S)
        # The producer gate answers as for Decode: a handle of an unknown producer.
        assert result.kv_handle is not None
        orphan = DecodeRequest(
            "orphan",
            (5, 6),
            sampling,
            replace(result.kv_handle, producer_engine_id="prefill-gone"),
            result.first_token_id,
        )
        with pytest.raises(ProducerUnavailable):
            await decode.decode_once(orphan, idle_timeout_s=30, timeout_s=CALL_BOUND_S)
        # A prefill engine serves no DecodeService: UNIMPLEMENTED, translated at the boundary.
        with pytest.raises(ProtocolMismatch) as mismatch:
            await prefill.decode_once(
                DecodeRequest("wrong-role", (1,), SamplingParams()),
                idle_timeout_s=30,
                timeout_s=CALL_BOUND_S,
            )
        assert engine_error(mismatch.value, stage="decode").code == "protocol_mismatch"
        await prefill.close()
        await decode.close()
