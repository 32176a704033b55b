"""Byte-exact pulls between real NIXL agents in separate processes, for many PP x TP pairs."""

from __future__ import annotations

import pytest

from services.kv_transfer.planning import notification_plan
from tests.integration.kv_transfer.conftest import WORKER_POOL
from tests.integration.kv_transfer.harness import (
    EngineSpec,
    WorkerProcess,
    engine_record_bytes,
    rank_field,
)

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group(WORKER_POOL)]


def run_pulls(
    workers: list[WorkerProcess],
    producer: EngineSpec,
    consumer: EngineSpec,
    requests: list[tuple[str, int, int]],
    serving_late: frozenset[tuple[int, int]] = frozenset(),
) -> dict[str, object]:
    """Producers prefill ``requests`` ``(id, blocks, seed)``; every consumer rank pulls each.
    The producer ranks in ``serving_late`` start polling only once every pull has returned."""
    p_ranks, c_ranks = producer.ranks(), consumer.ranks()
    assert len(p_ranks) + len(c_ranks) <= len(workers)
    producers = workers[: len(p_ranks)]
    consumers = workers[len(p_ranks) : len(p_ranks) + len(c_ranks)]
    for worker, rank in zip(producers, p_ranks, strict=True):
        worker.send("setup", engine=producer, rank=rank)
    for worker, rank in zip(consumers, c_ranks, strict=True):
        worker.send("setup", engine=consumer, rank=rank)
    records = {rank_field(r): w.recv() for w, r in zip(producers, p_ranks, strict=True)}
    for worker in consumers:
        worker.recv()

    remote: dict[str, tuple[int, ...]] = {}
    for request_id, n_blocks, seed in requests:
        ids = {
            w.call("prefill", request_id=request_id, n_blocks=n_blocks, seed=seed)
            for w in producers
        }
        assert len(ids) == 1, "producer ranks must agree on block ids"
        remote[request_id] = ids.pop()
    request_ids = [r[0] for r in requests]
    for worker, rank in zip(producers, p_ranks, strict=True):
        if rank not in serving_late:  # producers poll while consumers connect and pull
            worker.send("serve", request_ids=request_ids)
    for worker in consumers:
        worker.send("connect", engine=engine_record_bytes(producer), records=records)
    for worker in consumers:
        worker.recv()
    summaries = []
    for request_id, _, seed in requests:
        for worker in consumers:
            worker.send(
                "pull",
                request_id=request_id,
                producer_engine=producer.engine_id,
                generation=producer.generation,
                remote_ids=remote[request_id],
                seed=seed,
            )
        summaries.extend(worker.recv() for worker in consumers)
    # Consumers keep progressing, as real ranks do, until every producer rank has reported:
    # a notification to a replica nobody read may still sit in UCX when the pull returns.
    for worker in consumers:
        worker.progress()
    for worker, rank in zip(producers, p_ranks, strict=True):
        if rank in serving_late:
            worker.send("serve", request_ids=request_ids)
    ended = [worker.recv() for worker in producers]
    for worker in consumers:
        worker.settle()
    return {"summaries": summaries, "ended": ended}


def assert_all_good(outcome: dict[str, object], requests: list[tuple[str, int, int]]) -> None:
    for summary in outcome["summaries"]:  # type: ignore[attr-defined]
        assert summary["ok"], summary
        assert summary["problems"] == [], summary["problems"]
        assert summary["bytes"] > 0
    for ended in outcome["ended"]:  # type: ignore[attr-defined]
        assert ended == {r[0]: "released" for r in requests}, ended


REQUESTS = [("req-a", 5, 1), ("req-b", 3, 2)]


def test_homogeneous_tp2_pull_is_byte_exact_and_releases_producer_blocks(workers):
    producer = EngineSpec("prefill-a", 1, num_layers=4, num_kv_heads=4, pp=1, tp=2)
    consumer = EngineSpec("decode-a", 1, num_layers=4, num_kv_heads=4, pp=1, tp=2, role="decode")
    assert_all_good(run_pulls(workers, producer, consumer, REQUESTS), REQUESTS)
    labels = {
        "producer_engine": "prefill-a",
        "consumer_engine": "decode-a",
        "producer_rank": "pp0tp1",
        "consumer_rank": "pp0tp1",
    }
    consumer_rank_1 = workers[3]
    expected_bytes = sum(n for _, n, _ in REQUESTS) * 4 * 2 * 2 * 4 * 8 * 2
    assert (
        consumer_rank_1.call("metric", name="pdserve_kv_transfer_bytes_total", labels=labels)
        == expected_bytes
    )
    producer_rank_1 = workers[1]
    assert producer_rank_1.call(
        "metric",
        name="pdserve_kv_transfer_notifications_total",
        labels={**labels, "outcome": "counted"},
    ) == len(REQUESTS)


def test_pp2_producer_to_tp2_consumer(workers):
    producer = EngineSpec("prefill-b", 1, num_layers=4, num_kv_heads=4, pp=2, tp=1)
    consumer = EngineSpec("decode-b", 1, num_layers=4, num_kv_heads=4, pp=1, tp=2, role="decode")
    assert_all_good(run_pulls(workers, producer, consumer, REQUESTS), REQUESTS)


def test_tp4_producer_to_tp2_consumer(workers):
    producer = EngineSpec("prefill-c", 1, num_layers=2, num_kv_heads=4, pp=1, tp=4)
    consumer = EngineSpec("decode-c", 1, num_layers=2, num_kv_heads=4, pp=1, tp=2, role="decode")
    assert_all_good(run_pulls(workers, producer, consumer, REQUESTS), REQUESTS)


def test_uneven_layer_splits_on_both_sides(workers):
    producer = EngineSpec(
        "prefill-d", 1, num_layers=7, num_kv_heads=2, pp=3, tp=1, partition=(2, 4, 1)
    )
    consumer = EngineSpec(
        "decode-d", 1, num_layers=7, num_kv_heads=2, pp=2, tp=1, partition=(5, 2), role="decode"
    )
    assert_all_good(run_pulls(workers, producer, consumer, REQUESTS), REQUESTS)


def test_producer_tp_above_kv_heads_reads_one_replica_and_frees_all(workers):
    producer = EngineSpec("prefill-e", 1, num_layers=2, num_kv_heads=2, pp=1, tp=4)
    consumer = EngineSpec("decode-e", 1, num_layers=2, num_kv_heads=2, pp=1, tp=2, role="decode")
    assert_all_good(run_pulls(workers, producer, consumer, REQUESTS), REQUESTS)


def test_a_replica_nobody_read_is_notified_by_a_consumer_that_only_polls_afterwards(workers):
    """The notice to an unread replica goes out when the pull ends; that replica's agent only
    progresses later (so UCX cannot deliver it yet), and the consumer then has no read left to
    check. Its idle polls must still progress the agent until the notice is through."""
    producer = EngineSpec("prefill-f", 1, num_layers=2, num_kv_heads=2, pp=1, tp=4)
    consumer = EngineSpec("decode-f", 1, num_layers=2, num_kv_heads=2, pp=1, tp=2, role="decode")
    plan = notification_plan(consumer.layout(), producer.layout())
    unread = frozenset(remote for remotes in plan.notify_only.values() for remote in remotes)
    assert unread, "the layout must leave a replica unread"
    requests = [("req-f", 4, 3)]
    outcome = run_pulls(workers, producer, consumer, requests, serving_late=unread)
    assert_all_good(outcome, requests)
    for summary in outcome["summaries"]:  # type: ignore[attr-defined]
        assert summary["unnotified"] == [], summary
