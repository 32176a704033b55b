"""``pdserve prefill`` and ``pdserve decode`` with the reference engine, as real processes over
gRPC: disaggregated prefill -> decode across layouts (checked against local decoding on the same
engine), abort mid-stream, the producer gate, malformed input, and SIGTERM drains that lose no
in-flight request.

Four engines are shared by the module (starting one costs seconds per rank on two cores):
prefill PP=2, prefill PP=1 TP=1, decode TP=2, decode PP=2. The drain test stops two of them, so
it runs last.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.engines.errors import EngineDraining, InvalidRequest, ProducerUnavailable
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    KVHandle,
    PrefillResult,
    SamplingParams,
    TokenDelta,
)
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.integration.services.processes import ServiceProcess, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = (12, 40, 7, 99, 150, 3, 77, 201, 18)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ENGINE_ARGS = (
    "--engine",
    "reference",
    "--num-kv-blocks",
    "64",
    "--block-size",
    "4",
    "--kv-lease-s",
    "30",
    "--drain-timeout-s",
    "40",
)
LAYOUTS = {
    "prefill-pp2": ("prefill", ("--pp", "2")),
    "prefill-1x1": ("prefill", ()),
    "decode-tp2": ("decode", ("--tp", "2")),
    "decode-pp2": ("decode", ("--pp", "2")),
}


class Cluster:
    def __init__(self, services: dict[str, ServiceProcess], cp: ControlPlaneSettings) -> None:
        self.services = services
        self.cp_settings = cp

    def client(self, engine_id: str) -> GrpcAioEngineClient:
        return GrpcAioEngineClient(self.services[engine_id].grpc)


@pytest.fixture(scope="module")
def cluster(
    redis_server: LocalRedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    model = make_tiny_model(tmp_path_factory.mktemp("services-tiny"), seed=0)
    namespace = f"svc{uuid.uuid4().hex[:10]}"
    specs = [
        (role, engine_id, (*ENGINE_ARGS, "--model", str(model), *layout))
        for engine_id, (role, layout) in LAYOUTS.items()
    ]
    work_dir = tmp_path_factory.mktemp("services-logs")
    with running_services(
        specs, redis_url=redis_server.url, namespace=namespace, work_dir=work_dir
    ) as services:
        yield Cluster(
            services,
            ControlPlaneSettings(redis=RedisSettings(url=redis_server.url), namespace=namespace),
        )


async def collect(stream: object) -> list[TokenDelta]:
    return [delta async for delta in stream]  # type: ignore[attr-defined]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def wait_blocks_free(client: GrpcAioEngineClient, timeout_s: float = 30.0) -> None:
    """Until the engine's KV pool is whole again (freeing crosses rank processes)."""
    for _ in range(int(timeout_s / 0.05)):
        load = await client.get_load()
        if load.kv_blocks_free == load.kv_blocks_total and load.running_requests == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks not freed on {client.target}: {await client.get_load()}")


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [
        ("prefill-pp2", "decode-tp2"),
        ("prefill-1x1", "decode-pp2"),
        ("prefill-pp2", "decode-pp2"),
        ("prefill-1x1", "decode-tp2"),
    ],
)
async def test_disaggregated_decode_matches_local_decode(
    cluster: Cluster, producer: str, consumer: str
) -> None:
    prefill, decode = cluster.client(producer), cluster.client(consumer)
    rid = f"pd-{producer}-{consumer}"
    result = await prefill.prefill(rid, PROMPT, GREEDY)
    assert result.kv_handle is not None
    assert result.kv_handle.producer_engine_id == producer
    remote = await collect(
        decode.decode(DecodeRequest(rid, PROMPT, GREEDY, result.kv_handle, result.first_token_id))
    )
    local = await collect(decode.decode(DecodeRequest(f"local-{rid}", PROMPT, GREEDY)))
    assert [result.first_token_id, *tokens_of(remote)] == tokens_of(local)
    assert remote[0].kv_transfer_s is not None and remote[0].kv_transfer_s >= 0
    assert remote[-1].finish_reason is FinishReason.LENGTH
    assert remote[-1].usage is not None and remote[-1].usage.completion_tokens == 12
    # The producer freed the KV once every consumer rank notified it.
    await wait_blocks_free(prefill)
    await wait_blocks_free(decode)
    await prefill.close()
    await decode.close()


async def test_abort_mid_stream_frees_blocks_on_both_sides(cluster: Cluster) -> None:
    prefill, decode = cluster.client("prefill-1x1"), cluster.client("decode-pp2")
    long = SamplingParams(max_tokens=150, ignore_eos=True)
    result = await prefill.prefill("abort-1", PROMPT, long)
    assert result.kv_handle is not None
    stream = decode.decode(
        DecodeRequest("abort-1", PROMPT, long, result.kv_handle, result.first_token_id)
    )
    seen = 0
    async for _delta in stream:
        seen += 1
        if seen == 2:
            break
    assert (await decode.get_load()).kv_blocks_free < (await decode.get_load()).kv_blocks_total
    await stream.aclose()  # cancels the call: the engine aborts the request
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)

    # KV held for a consumer that never comes is released by Abort on the producer.
    held = await prefill.prefill("held-1", PROMPT, long)
    assert held.kv_handle is not None
    load = await prefill.get_load()
    assert load.kv_blocks_free == load.kv_blocks_total - len(held.kv_handle.block_ids)
    assert await prefill.abort("held-1") is True
    await wait_blocks_free(prefill)
    assert await prefill.abort("held-1") is False
    await prefill.close()
    await decode.close()


async def test_decode_refuses_handles_of_producers_that_are_not_ready(cluster: Cluster) -> None:
    prefill, decode = cluster.client("prefill-pp2"), cluster.client("decode-tp2")
    result = await prefill.prefill("gate-1", PROMPT, GREEDY)
    assert result.kv_handle is not None
    good = result.kv_handle
    bad_handles = [
        KVHandle(
            good.producer_engine_id,
            good.generation - 1,
            good.request_id,
            good.block_ids,
            good.num_tokens,
            good.lease_expires_at_s,
        ),
        KVHandle(
            "prefill-gone",
            good.generation,
            good.request_id,
            good.block_ids,
            good.num_tokens,
            good.lease_expires_at_s,
        ),
    ]
    for handle in bad_handles:
        with pytest.raises(ProducerUnavailable):
            await collect(decode.decode(DecodeRequest("gate-1", PROMPT, GREEDY, handle, 5)))
    # Nothing was pulled: the producer still holds the KV, the consumer is idle.
    load = await prefill.get_load()
    assert load.kv_blocks_free == load.kv_blocks_total - len(good.block_ids)
    await wait_blocks_free(decode)
    assert await prefill.abort("gate-1") is True
    await wait_blocks_free(prefill)
    await prefill.close()
    await decode.close()


async def test_malformed_requests_get_invalid_argument_and_the_engine_keeps_serving(
    cluster: Cluster,
) -> None:
    prefill = cluster.client("prefill-pp2")
    decode = cluster.client("decode-pp2")
    vocab = 384  # the tiny model's
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await prefill.prefill("bad-1", (1, vocab), GREEDY)
    with pytest.raises(InvalidRequest, match="context"):
        await prefill.prefill("bad-2", (1,) * 600, GREEDY)
    with pytest.raises(InvalidRequest, match="top_p"):
        await prefill.prefill("bad-3", PROMPT, SamplingParams(top_p=2.0))
    with pytest.raises(InvalidRequest, match="request_id"):
        await prefill.prefill("bad id", PROMPT, GREEDY)
    with pytest.raises(InvalidRequest, match="first_token_id"):
        await collect(decode.decode(DecodeRequest("bad-4", PROMPT, GREEDY, None, 3)))
    assert await prefill.health()
    assert await decode.health()
    ok: PrefillResult = await prefill.prefill("after-bad", PROMPT, SamplingParams(max_tokens=1))
    assert ok.kv_handle is None and ok.finish_reason is FinishReason.LENGTH
    await prefill.close()
    await decode.close()


async def test_sigterm_drain_loses_no_in_flight_request(cluster: Cluster) -> None:
    control_plane = RedisControlPlane(cluster.cp_settings)
    # 1. A prefill engine told to stop still serves the KV it holds until it is pulled.
    producer = cluster.services["prefill-1x1"]
    prefill, decode = cluster.client("prefill-1x1"), cluster.client("decode-pp2")
    held = await prefill.prefill("drain-held", PROMPT, GREEDY)
    assert held.kv_handle is not None
    producer.terminate()
    for _ in range(400):
        if not await prefill.health():
            break
        await asyncio.sleep(0.025)
    with pytest.raises(EngineDraining):
        await prefill.prefill("drain-new", PROMPT, GREEDY)
    remote = await collect(
        decode.decode(
            DecodeRequest("drain-held", PROMPT, GREEDY, held.kv_handle, held.first_token_id)
        )
    )
    local = await collect(decode.decode(DecodeRequest("drain-local", PROMPT, GREEDY)))
    assert [held.first_token_id, *tokens_of(remote)] == tokens_of(local)
    assert await asyncio.to_thread(producer.process.wait, 60) == 0
    assert await control_plane.get_engine("prefill-1x1") is None

    # 2. A decode engine told to stop finishes the stream it is serving.
    consumer = cluster.services["decode-tp2"]
    draining = cluster.client("decode-tp2")
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    stream = draining.decode(DecodeRequest("drain-stream", PROMPT, long))
    first = await anext(stream)
    consumer.terminate()
    rest = [delta async for delta in stream]
    assert len(tokens_of([first, *rest])) == 100
    assert rest[-1].finish_reason is FinishReason.LENGTH
    assert await asyncio.to_thread(consumer.process.wait, 60) == 0
    assert await control_plane.get_engine("decode-tp2") is None
    for client in (prefill, decode, draining):
        await client.close()
    await control_plane.close()
