"""The router's h2grpc engine client against real engine hosts (the stub engine behind the real
gRPC services and Redis control plane), next to the grpc.aio client: the same answers, the
same error classes for the engine's statuses and for an engine that cannot be reached, and a
caller that leaves (a cancelled unary call, a closed stream) aborts the request on the engine."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.errors import InvalidRequest, ProducerUnavailable
from services.engines.requests import DecodeRequest, SamplingParams
from services.engines.stub import StubBackend, StubOptions
from services.serving.client.grpc_aio import GrpcAioEngineClient
from services.serving.client.h2 import H2EngineClient
from services.serving.errors import EngineUnreachable, ProtocolMismatch
from services.serving.wire import convert
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

CALL_BOUND_S = 60.0
"""Outer bound of every await; reaching it is a hang and fails the test."""


async def test_both_clients_get_the_same_answers_and_the_same_errors(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-h", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-h", role=EngineRole.DECODE) as dec,
    ):
        outcomes = []
        for name, client_class in (("aio", GrpcAioEngineClient), ("h2", H2EngineClient)):
            prefill = client_class(pre.endpoints.grpc)
            decode = client_class(dec.endpoints.grpc)
            prompt, sampling = (5, 6, 7, 8), SamplingParams(max_tokens=6, logprobs=2)
            answers = []
            for mode in ("stream", "once"):
                request_id = f"{name}-{mode}"
                result = await asyncio.wait_for(
                    prefill.prefill(request_id, prompt, sampling, timeout_s=30), CALL_BOUND_S
                )
                request = DecodeRequest(
                    request_id, prompt, sampling, result.kv_handle, result.first_token_id
                )
                if mode == "stream":
                    deltas = [d async for d in decode.decode(request, timeout_s=30)]
                    answers.append(convert.merge_deltas(deltas))
                else:
                    answers.append(
                        await asyncio.wait_for(
                            decode.decode_once(request, idle_timeout_s=30, timeout_s=30),
                            CALL_BOUND_S,
                        )
                    )
                orphan = replace(
                    request,
                    request_id=f"{request_id}-orphan",
                    kv_handle=replace(result.kv_handle, producer_engine_id="prefill-gone"),  # type: ignore[type-var]
                )
                with pytest.raises(ProducerUnavailable, match="prefill-gone"):
                    await decode.decode_once(orphan, idle_timeout_s=30, timeout_s=30)
            with pytest.raises(InvalidRequest):
                await prefill.prefill(f"{name}-empty", (), SamplingParams(), timeout_s=30)
            with pytest.raises(ProtocolMismatch):  # a prefill engine serves no DecodeService
                await prefill.decode_once(
                    DecodeRequest(f"{name}-role", (1,), SamplingParams()), idle_timeout_s=30
                )
            assert await prefill.abort(f"{name}-unknown") is False
            streamed, once = answers
            assert (streamed.token_ids, streamed.text, streamed.usage) == (
                once.token_ids,
                once.text,
                once.usage,
            )
            outcomes.append((once.token_ids, once.text, once.finish_reason, len(once.logprobs)))
            await prefill.close()
            await decode.close()
        assert outcomes[0] == outcomes[1]
        assert len(outcomes[0][0]) == 5


async def test_a_caller_that_leaves_aborts_the_request_on_the_engine(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    backend = StubBackend(StubOptions(token_delay_s=0.02))
    async with hosted(settings, backend, engine_id="decode-l", role=EngineRole.DECODE) as dec:
        client, observer = (
            H2EngineClient(dec.endpoints.grpc),
            GrpcAioEngineClient(dec.endpoints.grpc),
        )

        async def running(expected: int) -> int:
            for _ in range(int(CALL_BOUND_S / 0.02)):
                load = await observer.get_load()
                if load.running_requests == expected:
                    break
                await asyncio.sleep(0.02)
            return load.running_requests

        once = asyncio.create_task(
            client.decode_once(
                DecodeRequest("leaves-once", (1, 2), SamplingParams(max_tokens=5000)),
                idle_timeout_s=30,
            )
        )
        assert await running(1) == 1
        once.cancel()
        with pytest.raises(asyncio.CancelledError):
            await once
        assert await running(0) == 0
        stream = client.decode(
            DecodeRequest("leaves-stream", (1, 2), SamplingParams(max_tokens=5000))
        )
        await asyncio.wait_for(anext(stream), CALL_BOUND_S)
        assert await running(1) == 1
        await stream.aclose()  # type: ignore[attr-defined]
        assert await running(0) == 0
        load = await observer.get_load()
        assert load.kv_blocks_free == load.kv_blocks_total
        await client.close()
        await observer.close()


async def test_an_engine_that_cannot_be_reached_is_engine_unreachable(unused_tcp_port: int) -> None:
    client = H2EngineClient(f"127.0.0.1:{unused_tcp_port}")
    with pytest.raises(EngineUnreachable) as refused:
        await asyncio.wait_for(
            client.prefill("r", (1,), SamplingParams(), timeout_s=5), CALL_BOUND_S
        )
    assert refused.value.target == f"127.0.0.1:{unused_tcp_port}"
    with pytest.raises(EngineUnreachable):
        await client.abort("r")
    await client.close()
