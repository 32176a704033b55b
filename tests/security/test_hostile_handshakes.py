"""Hostile handshake records: refused with a counted reason before any NIXL read, no crash.

Huge, truncated, wrong-version and garbage values are covered in
``tests/integration/control_plane/test_hostile_and_outages.py``. Here: records whose geometry
would make a decode rank read outside what the producer registered.

- The control plane (:func:`services.control_plane.aggregation.geometry_errors`) refuses regions
  that wrap past 2**64, overlap, or hold an absurd number of blocks: the engine is INVALID and the
  rejection is counted in ``pdserve_control_plane_records_rejected_total{reason="geometry"}``.
- A record that is self-consistent but points outside the producer's registered memory passes
  the control plane (it cannot see NIXL's registrations); the consumer's NIXL agent refuses its
  descriptors when they are prepared, before any read, and pre-warming counts
  ``pdserve_kv_transfer_prewarm_failures_total{reason="outside_registered_memory"}``. The producer
  is a real worker process with a real NIXL agent; the same process then connects to the genuine
  record, so the refusal is about the addresses and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings
from services.control_plane import (
    ControlPlaneMetrics,
    EngineNotReady,
    EngineRole,
    EngineSpec,
    EngineState,
    RedisControlPlane,
)
from services.control_plane.aggregation import MAX_BLOCKS_PER_REGION, rank_field
from services.control_plane.errors import HandshakeRejected
from services.control_plane.synthetic import synthetic_records, synthetic_spec
from services.control_plane.wire import HandshakeRecord, decode, encode
from services.kv_transfer import nixl_transport
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.errors import IncompatiblePeerError
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.peer_sync import PeerSync
from services.kv_transfer.protocol import WorkerIdentity
from services.topology import ModelShape
from tests.conftest import counter_value
from tests.integration.kv_transfer.harness import DTYPE, WorkerProcess, compat_hash, spawn_workers
from tests.integration.kv_transfer.harness import EngineSpec as HarnessSpec

pytestmark = pytest.mark.integration

LAYERS, HEADS = 2, 2


def _outside(record: HandshakeRecord, kind: str) -> HandshakeRecord:
    """``record`` with a geometry that reads outside what its producer registered."""
    bases = record.region_base_addrs
    if kind == "wraps_address_space":
        return replace(record, region_base_addrs=((1 << 64) - record.block_len, *bases[1:]))
    if kind == "overlapping_regions":
        return replace(
            record, region_base_addrs=(bases[0], bases[0] + record.block_len, *bases[2:])
        )
    if kind == "absurd_block_count":
        return replace(record, num_blocks=MAX_BLOCKS_PER_REGION + 1)
    if kind == "stride_below_block":
        return replace(record, block_stride=record.block_len - 1)
    raise AssertionError(kind)


GEOMETRY_CASES = [
    "wraps_address_space",
    "overlapping_regions",
    "absurd_block_count",
    "stride_below_block",
]


@pytest.mark.parametrize("kind", GEOMETRY_CASES)
async def test_control_plane_refuses_regions_outside_any_sane_geometry(
    control_plane: RedisControlPlane, metrics: ControlPlaneMetrics, kind: str
) -> None:
    engine = await control_plane.register(synthetic_spec("victim", pp_size=1, tp_size=2))
    records = synthetic_records(engine)
    hostile = _outside(records[(0, 1)], kind)
    # A publisher is refused before anything reaches Redis...
    with pytest.raises(HandshakeRejected, match="geometry"):
        await control_plane.publish_handshakes(engine, [hostile])
    # ...and one written behind the control plane's back, over a READY grid, on every read.
    status = await control_plane.publish_handshakes(engine, list(records.values()))
    assert status is not None and status.state is EngineState.READY
    key = control_plane.keys.handshakes("victim", engine.generation)
    await control_plane.connection.client.hset(key, rank_field(0, 1), encode(hostile))
    with pytest.raises(EngineNotReady) as caught:
        await control_plane.get_topology("victim")
    assert any(p.startswith("geometry") for p in caught.value.problems), caught.value.problems
    assert (
        counter_value(metrics, "pdserve_control_plane_records_rejected_total", reason="geometry")
        >= 1
    )


@pytest.fixture(scope="module")
def producer_worker() -> Iterator[WorkerProcess]:
    """One real producer worker process (torch + NIXL)."""
    (worker,) = spawn_workers(1)
    try:
        yield worker
    finally:
        worker.stop()


async def _until(condition: Callable[[], bool], within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110 - polls plain (non-async) state
            await asyncio.sleep(0.02)


def _engine_spec(model_hash: str) -> EngineSpec:
    return EngineSpec(
        engine_id="prefill-hostile",
        role=EngineRole.PREFILL,
        model="test-model",
        compat_hash=model_hash,
        shape=ModelShape(
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            block_size=HarnessSpec("x", 0, LAYERS, HEADS, 1, 1).block_size,
        ),
        endpoint="127.0.0.1:0",
    )


async def test_data_plane_refuses_addresses_outside_the_registered_memory_before_any_read(
    cp_settings: ControlPlaneSettings,
    producer_worker: WorkerProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    control_plane = RedisControlPlane(
        cp_settings.model_copy(update={"lease_ttl_s": 60.0}), ControlPlaneMetrics()
    )
    model_hash = compat_hash(HarnessSpec("x", 0, LAYERS, HEADS, 1, 1))
    producer = await control_plane.register(_engine_spec(model_hash))
    harness_spec = HarnessSpec("prefill-hostile", producer.generation, LAYERS, HEADS, 1, 1)
    genuine = decode(
        producer_worker.call("setup", engine=harness_spec, rank=(0, 0), num_blocks=8),
        HandshakeRecord,
    )
    # Self-consistent, but every region starts one whole pool past the registered buffer.
    pool_bytes = len(genuine.region_base_addrs) * genuine.num_blocks * genuine.block_stride
    shifted = replace(
        genuine, region_base_addrs=tuple(a + pool_bytes for a in genuine.region_base_addrs)
    )

    shard = harness_spec.layout().shards[(0, 0)]
    pool = KVBlockPool(
        KVPoolSpec(shard.layers, shard.kv_heads, 8, harness_spec.block_size,
                   harness_spec.head_size, DTYPE)
    )  # fmt: skip
    transport = NixlTransport(pool, WorkerIdentity("decode-hostile", 1, 0, 0))
    consumer = KVConsumer(transport, harness_spec.layout())
    registry = CollectorRegistry()
    sync = PeerSync(
        consumer, control_plane, compat_hash=model_hash, metrics=KVTransferMetrics(registry)
    )
    try:
        # Geometry the control plane would refuse never reaches NIXL on the data plane either
        # (no descriptor list of 2**24 blocks is built, no address wraps).
        sliced: list[object] = []
        slice_descriptors = nixl_transport.slice_descriptors

        def recording_slice(*args: object) -> object:
            sliced.append(args)
            return slice_descriptors(*args)

        with monkeypatch.context() as patched:
            patched.setattr(nixl_transport, "slice_descriptors", recording_slice)
            for kind in GEOMETRY_CASES:
                with pytest.raises(IncompatiblePeerError) as caught:
                    transport.add_peer(_outside(genuine, kind))
                assert caught.value.reason == "geometry", kind
                assert sliced == [], kind  # refused before a descriptor row is built
        assert transport.peer_generation("prefill-hostile", (0, 0)) is None

        async with control_plane.watch() as watcher:
            following = asyncio.create_task(sync.follow(watcher))
            status = await control_plane.publish_handshakes(producer, [shifted])
            assert status is not None and status.state is EngineState.READY
            await _until(
                lambda: (
                    (
                        registry.get_sample_value(
                            "pdserve_kv_transfer_prewarm_failures_total",
                            {
                                "producer_engine": "prefill-hostile",
                                "reason": "outside_registered_memory",
                            },
                        )
                        or 0
                    )
                    >= 1
                )
            )
            assert consumer.connected("prefill-hostile") is None
            assert transport.peer_generation("prefill-hostile", (0, 0)) is None
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
        # The genuine record of the same producer connects: only the addresses were refused.
        transport.add_peer(genuine)
        assert transport.peer_generation("prefill-hostile", (0, 0)) == producer.generation
        assert producer_worker.process.is_alive()
    finally:
        transport.close()
        await control_plane.close()
        producer_worker.call("close", timeout_s=30)
