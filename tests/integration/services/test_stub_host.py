"""The engine host and its servicers end to end over real gRPC and a real Redis control plane,
with the stub engine (instant, deterministic): lifecycle, error codes, the producer gate,
cancellation, drain, lost registration, and the client's error mapping."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.synthetic import synthetic_spec
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineRegistration
from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineFailed,
    InvalidRequest,
    KVTransferFailed,
    ProducerUnavailable,
)
from services.engines.requests import DecodeRequest, FinishReason, KVHandle, SamplingParams
from services.engines.stub import StubBackend, StubOptions
from services.proto_gen.pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    types_pb2,
)
from services.serving.client.grpc_aio import GrpcAioClientPool, GrpcAioEngineClient
from services.serving.errors import EngineUnreachable, ProtocolMismatch
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration


class SpyStub(StubBackend):
    """The stub engine, counting decode calls (to prove nothing was pulled)."""

    def __init__(self, options: StubOptions | None = None) -> None:
        super().__init__(options)
        self.decode_calls = 0

    def decode(self, request: DecodeRequest):  # type: ignore[override]
        self.decode_calls += 1
        return super().decode(request)


class SilentStub(StubBackend):
    """Never publishes its handshakes: the engine stays PENDING."""

    async def start(self, registration: EngineRegistration) -> None:
        return None


async def test_prefill_then_decode_round_trip_with_health_load_and_metrics(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-a", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-a", role=EngineRole.DECODE) as dec,
    ):
        # The entry point's hook (the heap freeze) ran once each, when READY, before the line.
        assert pre.ready_output_at_ready == dec.ready_output_at_ready == [""]
        pool = GrpcAioClientPool()
        prefill, decode = pool.get(pre.endpoints.grpc), pool.get(dec.endpoints.grpc)
        assert pool.get(pre.endpoints.grpc) is prefill
        assert await prefill.health() and await decode.health()
        result = await prefill.prefill("req-1", [5, 6, 7], SamplingParams(max_tokens=4))
        assert result.kv_handle is not None
        assert result.kv_handle.producer_engine_id == "prefill-a"
        assert result.kv_handle.generation == pre.endpoints.generation
        request = DecodeRequest(
            "req-1",
            (5, 6, 7),
            SamplingParams(max_tokens=4),
            result.kv_handle,
            result.first_token_id,
        )
        deltas = [delta async for delta in decode.decode(request)]
        tokens = [t for d in deltas for t in d.token_ids]
        first = result.first_token_id
        assert tokens == [first + 1, first + 2, first + 3]
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 4
        load = await decode.get_load()
        assert load.kv_blocks_free == load.kv_blocks_total == StubOptions().num_kv_blocks
        with pytest.raises(ProtocolMismatch):
            await decode.prefill("req-2", [1], SamplingParams())
        assert pre.endpoints.metrics is not None
        with urllib.request.urlopen(pre.endpoints.metrics, timeout=5) as response:  # noqa: ASYNC210
            text = response.read().decode()
        assert (
            'pdserve_engine_requests_total{engine="prefill-a",outcome="ok",role="prefill"'
            ',rpc="Prefill"} 1.0' in text
        )
        assert 'pdserve_engine_handshake_ranks_published{engine="prefill-a",rank="0:0"} 1.0' in text
        assert "pdserve_engine_kv_blocks_total" in text
        await pool.close()
        assert len(pool) == 0


async def test_decode_never_pulls_from_a_producer_that_is_not_ready(
    cp_settings: ControlPlaneSettings, control_plane: RedisControlPlane
) -> None:
    settings = service_settings(cp_settings)
    spy = SpyStub()
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-b", role=EngineRole.PREFILL) as pre,
        hosted(settings, spy, engine_id="decode-b", role=EngineRole.DECODE) as dec,
    ):
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        prefill = GrpcAioEngineClient(pre.endpoints.grpc)
        result = await prefill.prefill("req-1", [1, 2], SamplingParams(max_tokens=3))
        assert result.kv_handle is not None
        # A registered but PENDING producer (no handshakes), compatible otherwise.
        pending_spec = synthetic_spec("prefill-pending", num_layers=4, num_kv_heads=4)
        pending = await control_plane.register(pending_spec)
        handles = {
            "unknown": KVHandle("prefill-nobody", 1, "req-1", (0,), 2, 2e9),
            "old generation": KVHandle(
                "prefill-b", result.kv_handle.generation - 1, "req-1", (0,), 2, 2e9
            ),
            "not ready": KVHandle("prefill-pending", pending.generation, "req-1", (0,), 2, 2e9),
        }
        for why, handle in handles.items():
            request = DecodeRequest("req-1", (1, 2), SamplingParams(), handle, 7)
            with pytest.raises(ProducerUnavailable) as raised:
                _ = [d async for d in client.decode(request)]
            assert "prefill-" in str(raised.value), why
            assert dec.endpoints.grpc in str(raised.value)
        assert spy.decode_calls == 0
        # A handle from a decode engine is refused as invalid, also before any pull.
        decode_handle = KVHandle("decode-b", dec.endpoints.generation, "req-1", (0,), 2, 2e9)
        with pytest.raises(InvalidRequest, match="not a KV producer"):
            _ = [
                d
                async for d in client.decode(
                    DecodeRequest("req-1", (1, 2), SamplingParams(), decode_handle, 7)
                )
            ]
        assert spy.decode_calls == 0
        await client.close()
        await prefill.close()


async def test_cancelling_a_decode_stream_aborts_it_and_frees_its_blocks(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    backend = StubBackend(StubOptions(token_delay_s=0.02))
    async with hosted(settings, backend, engine_id="decode-c", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        stream = client.decode(DecodeRequest("req-1", (1, 2, 3), SamplingParams(max_tokens=500)))
        received = 0
        async for _delta in stream:
            received += 1
            if received == 3:
                break
        load = await client.get_load()
        assert load.running_requests == 1  # still running until the cancel lands
        with pytest.raises(DuplicateRequest):
            _ = [
                d
                async for d in client.decode(
                    DecodeRequest("req-1", (1,), SamplingParams(max_tokens=2))
                )
            ]
        await stream.aclose()
        for _ in range(200):
            load = await client.get_load()
            if load.running_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert load.running_requests == 0
        assert load.kv_blocks_free == load.kv_blocks_total
        metrics = dec.host.registry
        assert (
            metrics.get_sample_value(
                "pdserve_engine_requests_total",
                {"engine": "decode-c", "role": "decode", "rpc": "Decode", "outcome": "CANCELLED"},
            )
            == 1.0
        )
        await client.close()


async def test_sigterm_drain_finishes_in_flight_stream_refuses_new_work_and_deregisters(
    cp_settings: ControlPlaneSettings, control_plane: RedisControlPlane
) -> None:
    settings = service_settings(cp_settings)
    backend = StubBackend(StubOptions(token_delay_s=0.01))
    async with hosted(settings, backend, engine_id="decode-d", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        stream = client.decode(DecodeRequest("req-1", (1, 2), SamplingParams(max_tokens=60)))
        first = await anext(stream)
        dec.stop.set()  # what SIGTERM does in the CLI
        for _ in range(1000):  # the host begins draining within one loop turn or so
            if backend._draining:
                break
            await asyncio.sleep(0.005)
        assert backend._draining
        with pytest.raises(EngineDraining):
            _ = [
                d
                async for d in client.decode(
                    DecodeRequest("req-2", (1,), SamplingParams(max_tokens=2))
                )
            ]
        assert not await client.health()
        rest = [delta async for delta in stream]
        tokens = [t for d in [first, *rest] for t in d.token_ids]
        assert len(tokens) == 60
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert await dec.exit_code() == 0
        assert await control_plane.get_engine("decode-d") is None
        with pytest.raises(EngineUnreachable):
            await client.get_load()
        await client.close()


async def test_lost_registration_stops_serving_with_exit_code_1(
    cp_settings: ControlPlaneSettings, control_plane: RedisControlPlane
) -> None:
    settings = service_settings(cp_settings)
    async with hosted(
        settings, StubBackend(), engine_id="prefill-e", role=EngineRole.PREFILL
    ) as pre:
        # Someone else registers the same engine id: this host's generation is fenced off.
        await control_plane.register(synthetic_spec("prefill-e"))
        assert await pre.exit_code(timeout_s=3 * cp_settings.heartbeat_interval_s + 5) == 1


async def test_engine_that_never_turns_ready_exits_1_and_deregisters(
    cp_settings: ControlPlaneSettings, control_plane: RedisControlPlane
) -> None:
    settings = service_settings(cp_settings, ready_timeout_s=0.5)
    host_cm = hosted(settings, SilentStub(), engine_id="prefill-f", role=EngineRole.PREFILL)
    with pytest.raises(AssertionError, match="exited with 1 before READY"):
        async with host_cm:
            pass
    assert await control_plane.get_engine("prefill-f") is None


async def test_unreachable_engine_is_reported_with_its_target() -> None:
    client = GrpcAioEngineClient("127.0.0.1:1")
    with pytest.raises(EngineUnreachable, match=r"127\.0\.0\.1:1") as raised:
        await client.prefill("r", [1], SamplingParams(), timeout_s=5)
    assert raised.value.target == "127.0.0.1:1"
    with pytest.raises(EngineUnreachable):
        await client.health()
    await client.close()


async def test_oversized_message_is_refused_and_the_engine_keeps_serving(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    settings = settings.model_copy(
        update={"grpc": settings.grpc.model_copy(update={"max_message_bytes": 64 * 1024})}
    )
    async with hosted(
        settings, StubBackend(), engine_id="prefill-g", role=EngineRole.PREFILL
    ) as pre:
        client = GrpcAioEngineClient(pre.endpoints.grpc)
        with pytest.raises(InvalidRequest):
            await client.prefill("big", [1] * 50_000, SamplingParams())
        assert await client.health()
        await client.close()


# -- malformed requests, fuzzed against a live server ---------------------------------------

request_ids = st.one_of(
    st.text(max_size=140), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True)
)
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40) | st.lists(
    st.integers(0, 40_000), max_size=5
)
sampling_messages = st.builds(
    types_pb2.SamplingParams,
    max_tokens=st.integers(0, 2**32 - 1),
    temperature=st.floats(width=32),
    top_p=st.floats(width=32),
    top_k=st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=5),
    ignore_eos=st.booleans(),
)
handles = st.builds(
    types_pb2.KVHandle,
    producer_engine_id=st.text(max_size=20),
    generation=st.integers(0, 2**64 - 1),
    request_id=st.text(max_size=20),
    block_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4),
    num_tokens=st.integers(0, 2**32 - 1),
    lease_expires_at_s=st.floats(),
)
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAVAILABLE,  # a well-formed handle naming a producer that does not exist
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a well-formed request larger than the KV pool
}


async def test_fuzzed_malformed_requests_get_invalid_argument_never_a_crash(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, StubBackend(), engine_id="prefill-h", role=EngineRole.PREFILL) as pre,
        hosted(settings, StubBackend(), engine_id="decode-h", role=EngineRole.DECODE) as dec,
    ):
        prefill_channel = grpc.aio.insecure_channel(pre.endpoints.grpc)
        decode_channel = grpc.aio.insecure_channel(dec.endpoints.grpc)
        prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
        decode = decode_pb2_grpc.DecodeServiceStub(decode_channel)
        seen: list[grpc.StatusCode] = []
        loop = asyncio.get_running_loop()

        async def prefill_once(message: prefill_pb2.PrefillRequest) -> grpc.StatusCode:
            try:
                await prefill.Prefill(message, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        async def decode_once(message: decode_pb2.DecodeRequest) -> grpc.StatusCode:
            try:
                async for _chunk in decode.Decode(message, timeout=10):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        # hypothesis drives a synchronous test body: run each example on the live loop.
        examples: list[tuple[str, object]] = []

        @hypothesis_settings(
            max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(
            request_ids,
            token_lists,
            st.one_of(st.none(), sampling_messages),
            st.one_of(st.none(), handles),
            st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        )
        def collect(request_id, tokens, sampling, handle, first_token_id) -> None:  # type: ignore[no-untyped-def]
            p = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=tokens)
            d = decode_pb2.DecodeRequest(request_id=request_id, token_ids=tokens)
            if sampling is not None:
                p.sampling.CopyFrom(sampling)
                d.sampling.CopyFrom(sampling)
            if handle is not None:
                d.kv_handle.CopyFrom(handle)
            if first_token_id is not None:
                d.first_token_id = first_token_id
            examples.append(("prefill", p))
            examples.append(("decode", d))

        await loop.run_in_executor(None, collect)
        for kind, message in examples:
            if kind == "prefill":
                seen.append(await prefill_once(message))  # type: ignore[arg-type]
            else:
                seen.append(await decode_once(message))  # type: ignore[arg-type]
        assert set(seen) <= ALLOWED, set(seen) - ALLOWED
        assert grpc.StatusCode.INVALID_ARGUMENT in seen
        # Both engines are still up and idle.
        for endpoint in (pre.endpoints.grpc, dec.endpoints.grpc):
            client = GrpcAioEngineClient(endpoint)
            assert await client.health()
            load = await client.get_load()
            assert load.running_requests == 0
            await client.close()
        await prefill_channel.close(None)
        await decode_channel.close(None)


class FailingStub(StubBackend):
    """Streams two tokens, then fails the request (``error``) or the whole engine."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def decode(self, request: DecodeRequest):  # type: ignore[override]
        count = 0
        async for delta in super().decode(request):
            yield delta
            count += 1
            if count == 2:
                raise self.error


async def test_failure_after_the_first_chunk_ends_the_stream_with_an_error_chunk(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    backend = FailingStub(KVTransferFailed("rank 0:1 lost its peer", "remote_disconnected"))
    async with hosted(settings, backend, engine_id="decode-i", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        deltas = [
            d
            async for d in client.decode(
                DecodeRequest("req-1", (1, 2), SamplingParams(max_tokens=10))
            )
        ]
        assert len(deltas) == 3
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert deltas[-1].error is not None and "lost its peer" in deltas[-1].error
        assert (
            dec.host.registry.get_sample_value(
                "pdserve_engine_requests_total",
                {"engine": "decode-i", "role": "decode", "rpc": "Decode", "outcome": "UNAVAILABLE"},
            )
            == 1.0
        )
        assert await client.health()  # a request-scoped failure: the engine keeps serving
        await client.close()


async def test_engine_failure_mid_stream_stops_the_host_with_exit_code_1(
    cp_settings: ControlPlaneSettings, control_plane: RedisControlPlane
) -> None:
    settings = service_settings(cp_settings)
    backend = FailingStub(EngineFailed("rank 1:0 died"))
    async with hosted(settings, backend, engine_id="decode-j", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        deltas = [
            d
            async for d in client.decode(
                DecodeRequest("req-1", (1, 2), SamplingParams(max_tokens=10))
            )
        ]
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert await dec.exit_code() == 1
        assert await control_plane.get_engine("decode-j") is None
        await client.close()
