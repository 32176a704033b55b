"""Pre-warming from the control plane: a consumer connects to a producer's NIXL agents when the
producer turns READY in a real Redis, before any request, and lets go when it is replaced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings
from services.control_plane import (
    ControlPlaneMetrics,
    EngineRole,
    EngineSpec,
    EngineState,
    RedisControlPlane,
)
from services.control_plane.synthetic import synthetic_records
from services.control_plane.wire import HandshakeRecord, decode
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.peer_sync import PeerSync
from services.kv_transfer.protocol import WorkerIdentity
from services.topology import ModelShape
from tests.integration.kv_transfer.conftest import WORKER_POOL
from tests.integration.kv_transfer.harness import DTYPE, WorkerProcess, compat_hash
from tests.integration.kv_transfer.harness import EngineSpec as HarnessSpec

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group(WORKER_POOL)]

LAYERS, HEADS = 4, 2


def _spec(engine_id: str, role: EngineRole, model_hash: str) -> EngineSpec:
    return EngineSpec(
        engine_id=engine_id,
        role=role,
        model="test-model",
        compat_hash=model_hash,
        shape=ModelShape(
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            block_size=HarnessSpec("x", 0, LAYERS, HEADS, 1, 1).block_size,
        ),
        endpoint="127.0.0.1:0",
    )


def _prewarm_failures(registry: CollectorRegistry, engine_id: str) -> float:
    """Failed pre-warm attempts of one producer, whatever the reason."""
    return sum(
        sample.value
        for family in registry.collect()
        if family.name == "pdserve_kv_transfer_prewarm_failures"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("producer_engine") == engine_id
    )


async def _until(condition: Callable[[], bool], within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110 - polls plain (non-async) state
            await asyncio.sleep(0.02)


async def test_consumer_prewarms_on_ready_and_lets_go_on_a_new_generation(
    cp_settings: ControlPlaneSettings, workers: list[WorkerProcess]
) -> None:
    # A long lease: this test is about pre-warming, and NIXL's first import here takes seconds.
    control_plane = RedisControlPlane(
        cp_settings.model_copy(update={"lease_ttl_s": 60.0}), ControlPlaneMetrics()
    )
    model_hash = compat_hash(HarnessSpec("x", 0, LAYERS, HEADS, 1, 1))
    producer = await control_plane.register(_spec("prefill-a", EngineRole.PREFILL, model_hash))
    harness_spec = HarnessSpec("prefill-a", producer.generation, LAYERS, HEADS, 1, 1)
    record = decode(workers[0].call("setup", engine=harness_spec, rank=(0, 0)), HandshakeRecord)

    shard = harness_spec.layout().shards[(0, 0)]
    pool = KVBlockPool(
        KVPoolSpec(shard.layers, shard.kv_heads, 16, harness_spec.block_size,
                   harness_spec.head_size, DTYPE)
    )  # fmt: skip
    transport = NixlTransport(pool, WorkerIdentity("decode-a", 1, 0, 0))
    consumer = KVConsumer(transport, harness_spec.layout())
    registry = CollectorRegistry()
    sync = PeerSync(
        consumer, control_plane, compat_hash=model_hash, metrics=KVTransferMetrics(registry)
    )
    try:
        async with control_plane.watch() as watcher:
            following = asyncio.create_task(sync.follow(watcher))
            # An incompatible producer is never connected, even READY: it turns READY before
            # prefill-a does, so once prefill-a is connected its change has been applied too.
            other = await control_plane.register(_spec("prefill-b", EngineRole.PREFILL, "0" * 32))
            assert other.generation > 0
            other_status = await control_plane.publish_handshakes(
                other, list(synthetic_records(other).values())
            )
            assert other_status is not None and other_status.state is EngineState.READY
            await watcher.wait_for("prefill-b", EngineState.READY, 5, other.generation)
            assert consumer.connected("prefill-a") is None  # registered, not READY: no handshake

            status = await control_plane.publish_handshakes(producer, [record])
            assert status is not None and status.state is EngineState.READY
            await _until(lambda: consumer.connected("prefill-a") == producer.generation)
            assert transport.peer_generation("prefill-a", (0, 0)) == producer.generation
            assert consumer.connected("prefill-b") is None
            # Left out for its compat hash, not tried and failed (its agents are placeholders).
            assert _prewarm_failures(registry, "prefill-b") == 0

            # The producer restarts under the same id: the old generation is let go at once.
            restarted = await control_plane.register(
                _spec("prefill-a", EngineRole.PREFILL, model_hash)
            )
            await watcher.wait_for("prefill-a", EngineState.PENDING, 5, restarted.generation)
            await _until(lambda: consumer.connected("prefill-a") is None)
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
        assert (
            registry.get_sample_value(
                "pdserve_kv_transfer_prewarm_failures_total",
                {"producer_engine": "prefill-a", "reason": "not_ready"},
            )
            is None
        )
    finally:
        transport.close()
        await control_plane.close()
