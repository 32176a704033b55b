"""KVConsumer and KVProducer over a scripted transport: planning, fencing, policy, metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.control_plane.aggregation import EngineTopology
from services.control_plane.wire import EngineRecord, EngineRole, HandshakeRecord
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.errors import UnknownPeerError
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.producer import KVProducer
from services.kv_transfer.protocol import KVNotification, WorkerIdentity
from services.kv_transfer.transport import FailedRead, PeerTransferStats, PullResult
from services.topology import EngineLayout, ModelShape, Range
from tests.unit.kv_transfer.fakes import FakeTransport

PRODUCER = EngineLayout.uniform(4, 4, 2, 2)  # PP=2 x TP=2
CONSUMER = EngineLayout.uniform(4, 4, 1, 2)  # TP=2


def topology(generation: int) -> EngineTopology:
    engine = EngineRecord(
        engine_id="prefill-0",
        generation=generation,
        role=EngineRole.PREFILL,
        model="m",
        compat_hash="h",
        shape=ModelShape(num_layers=4, num_kv_heads=4, block_size=4, pp_size=2, tp_size=2),
        endpoint="x:1",
        pp_aware=True,
        lease_ttl_ms=1000,
        registered_at_ms=0,
    )
    records = {
        rank: HandshakeRecord(
            engine_id="prefill-0",
            generation=generation,
            pp_rank=rank[0],
            tp_rank=rank[1],
            worker_id="w",
            agent_name=f"a{rank}",
            agent_metadata=b"md",
            memory_type="DRAM",
            device_id=0,
            region_base_addrs=(1, 2, 3, 4),
            num_blocks=8,
            block_len=2 * 4 * 8 * 2,
            block_stride=2 * 4 * 8 * 2,
            block_size=4,
            dtype="float16",
            head_size=8,
            kv_layout="HND",
            layers=shard.layers,
            kv_heads=shard.kv_heads,
            compat_hash="h",
        )
        for rank, shard in PRODUCER.shards.items()
    }
    return EngineTopology(engine, records, PRODUCER)


def consumer_side(policy: str = "fail") -> tuple[KVConsumer, FakeTransport, KVTransferMetrics]:
    pool = KVBlockPool(KVPoolSpec(Range(0, 4), Range(2, 4), 8, 4, 8))
    transport = FakeTransport(pool, WorkerIdentity("decode-0", 1, 0, 1))
    metrics = KVTransferMetrics(CollectorRegistry())
    return KVConsumer(transport, CONSUMER, metrics=metrics, policy=policy), transport, metrics  # type: ignore[arg-type]


def test_connect_prewarms_exactly_the_producer_ranks_this_rank_reads():
    consumer, transport, metrics = consumer_side()
    consumer.connect(topology(1))
    assert sorted(transport.peers) == [("prefill-0", (0, 1)), ("prefill-0", (1, 1))]
    consumer.connect(topology(1))  # idempotent per generation
    assert transport.removed == []
    labels = {
        "producer_engine": "prefill-0",
        "consumer_engine": "decode-0",
        "producer_rank": "pp1tp1",
        "consumer_rank": "pp0tp1",
    }
    assert (
        metrics.registry.get_sample_value("pdserve_kv_transfer_peer_prepare_seconds_count", labels)
        == 1
    )


def test_new_generation_fences_the_old_one_and_pulls_carry_the_plan():
    consumer, transport, _ = consumer_side()
    consumer.connect(topology(1))
    consumer.connect(topology(2))
    assert transport.removed == [("prefill-0", None, "stale_generation")]
    assert consumer.connected("prefill-0") == 2
    consumer.pull(
        "r",
        producer_engine="prefill-0",
        producer_generation=2,
        remote_block_ids=[3],
        local_block_ids=[5],
    )
    (spec,) = transport.started
    assert [(r.remote_pp, r.remote_tp) for r in spec.reads] == [(0, 1), (1, 1)]
    assert spec.notifiers == {(0, 0): 1, (0, 1): 1, (1, 0): 1, (1, 1): 1}
    assert spec.remote_block_ids == (3,) and spec.local_block_ids == (5,)
    with pytest.raises(UnknownPeerError):
        consumer.pull(
            "r",
            producer_engine="nope",
            producer_generation=1,
            remote_block_ids=[],
            local_block_ids=[],
        )


def failed_result() -> PullResult:
    failure = FailedRead((1, 1), Range(2, 4), Range(2, 4), (5, 6), (3, 4), "timeout", "slow")
    stats = PeerTransferStats((0, 1), nbytes=1024, descriptors=8, prep_seconds=1e-5, seconds=0.01)
    return PullResult("r", "prefill-0", 1, (stats,), (failure,), 0.02)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failures_are_reported_with_their_blocks_and_counted(policy: str):
    consumer, transport, metrics = consumer_side(policy)
    transport.results = [failed_result()]
    (outcome,) = consumer.poll()
    assert outcome.action == policy and outcome.failed_block_ids == (5, 6)
    pair = {
        "producer_engine": "prefill-0",
        "consumer_engine": "decode-0",
        "consumer_rank": "pp0tp1",
    }
    sample = metrics.registry.get_sample_value
    assert (
        sample(
            "pdserve_kv_transfer_failures_total",
            {**pair, "producer_rank": "pp1tp1", "reason": "timeout"},
        )
        == 1
    )
    assert sample("pdserve_kv_transfer_bytes_total", {**pair, "producer_rank": "pp0tp1"}) == 1024
    assert (
        sample("pdserve_kv_transfer_latency_seconds_count", {**pair, "producer_rank": "pp0tp1"})
        == 1
    )
    recomputes = sample("pdserve_kv_transfer_recomputes_total", {**pair, "producer_rank": "pp1tp1"})
    assert recomputes == (1 if policy == "recompute" else None)


def test_notifications_that_could_not_be_sent_are_counted_per_producer_rank():
    consumer, transport, metrics = consumer_side()
    stats = PeerTransferStats((0, 1), nbytes=64, descriptors=2, prep_seconds=1e-5, seconds=0.01)
    transport.results = [
        PullResult("r", "prefill-0", 1, (stats,), (), 0.02, unnotified=((0, 1), (1, 1)))
    ]
    (outcome,) = consumer.poll()
    assert outcome.ok
    pair = {
        "producer_engine": "prefill-0",
        "consumer_engine": "decode-0",
        "consumer_rank": "pp0tp1",
    }
    sample = metrics.registry.get_sample_value
    for rank in ("pp0tp1", "pp1tp1"):
        labels = {**pair, "producer_rank": rank}
        assert sample("pdserve_kv_transfer_notification_send_failures_total", labels) == 1


def test_producer_frees_on_notifications_and_expires_the_rest():
    now = [0.0]
    pool = KVBlockPool(KVPoolSpec(Range(0, 2), Range(0, 4), 8, 4, 8))
    transport = FakeTransport(pool, WorkerIdentity("prefill-0", 1, 0, 0))
    metrics = KVTransferMetrics(CollectorRegistry())
    producer = KVProducer(transport, metrics=metrics, default_lease_s=1.0, clock=lambda: now[0])
    for request_id in ("a", "b"):
        blocks = pool.allocate(2)
        producer.hold(request_id, blocks)
        pool.free(blocks)
    gauge = {"producer_engine": "prefill-0", "producer_rank": "pp0tp0"}
    assert metrics.registry.get_sample_value("pdserve_kv_transfer_leased_blocks", gauge) == 4
    transport.inbox = [
        KVNotification("a", "decode-0", 1, (0, 0), 1, True),
        KVNotification("zzz", "decode-0", 1, (0, 0), 1, True),
    ]
    transport.rejected = ["garbage"]
    events = producer.poll()
    assert [e.request_id for e in events.released] == ["a"] and events.expired == ()
    assert events.rejected_notifications == ("garbage",)
    now[0] = 1.5
    events = producer.poll()
    assert [e.request_id for e in events.expired] == ["b"]
    assert pool.free_count == pool.num_blocks
    sample = metrics.registry.get_sample_value
    assert (
        sample("pdserve_kv_transfer_expired_leases_total", {**gauge, "consumer_engine": "unknown"})
        == 1
    )
    assert sample("pdserve_kv_transfer_rejected_notifications_total", gauge) == 1
    note = {**gauge, "consumer_engine": "decode-0", "consumer_rank": "pp0tp0"}
    assert sample("pdserve_kv_transfer_notifications_total", {**note, "outcome": "counted"}) == 1
    assert (
        sample("pdserve_kv_transfer_notifications_total", {**note, "outcome": "unknown_request"})
        == 1
    )
    assert sample("pdserve_kv_transfer_leased_blocks", gauge) == 0


def test_metric_names_follow_the_convention():
    registry = CollectorRegistry()
    KVTransferMetrics(registry)
    names = {metric.name: metric.type for metric in registry.collect()}
    assert names
    for name, kind in names.items():
        assert name.startswith("pdserve_kv_transfer_") and ":" not in name
        if kind == "counter":
            assert not name.endswith("_total")  # the client strips it; samples end in _total
        if kind == "histogram" and "seconds" not in name:
            assert name == "pdserve_kv_transfer_descriptors"
    samples = {s.name for metric in registry.collect() for s in metric.samples}
    assert all(not n.endswith("_created") or n.startswith("pdserve_kv_transfer_") for n in samples)
