"""Failures between real NIXL agents: deaths, hangs, expiry, restarts (generation fencing)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.integration.kv_transfer.conftest import WORKER_POOL
from tests.integration.kv_transfer.harness import (
    EngineSpec,
    WorkerError,
    WorkerProcess,
    engine_record_bytes,
    spawn_workers,
)

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group(WORKER_POOL)]

PRODUCER = EngineSpec("prefill-x", 1, num_layers=2, num_kv_heads=2, pp=1, tp=1)
CONSUMER = EngineSpec("decode-x", 1, num_layers=2, num_kv_heads=2, pp=1, tp=1, role="decode")
# 2 layers x K/V x 1024 blocks x 8 KiB = 32 MiB per side.
BIG_PRODUCER = replace(PRODUCER, block_size=16, head_size=128)
BIG_CONSUMER = replace(CONSUMER, block_size=16, head_size=128)


LOAD_SLACK_S = 4.5
"""What a loaded machine may add to a configured bound (a 1.5 s lease, a 5 s pull timeout): a
wait still ends below the harness's default pull timeout (10 s), so the configured bound is what
ended it (the asserts are about which bound acts, not about speed)."""


@pytest.fixture
def spare() -> list[WorkerProcess]:
    """A fresh worker process the test may kill."""
    workers = spawn_workers(1)
    yield workers
    for worker in workers:
        worker.kill()


def connect(consumer: WorkerProcess, producer: EngineSpec, record: bytes) -> None:
    consumer.call("connect", engine=engine_record_bytes(producer), records={"0:0": record})


def pull(worker: WorkerProcess, request_id: str, producer: EngineSpec, remote, seed, **kw):
    return worker.call(
        "pull",
        request_id=request_id,
        producer_engine=producer.engine_id,
        generation=producer.generation,
        remote_ids=remote,
        seed=seed,
        **kw,
    )


def test_consumer_dying_mid_transfer_leaves_producer_to_free_on_lease_expiry(workers, spare):
    producer, survivor = workers[0], workers[1]
    victim = spare[0]
    record = producer.call("setup", engine=BIG_PRODUCER, rank=(0, 0), lease_s=1.5, num_blocks=1024)
    victim.call("setup", engine=BIG_CONSUMER, rank=(0, 0), num_blocks=1024)
    survivor.call("setup", engine=BIG_CONSUMER, rank=(0, 0), num_blocks=1024)
    doomed = producer.call("prefill", request_id="doomed", n_blocks=1024, seed=0, pattern=False)
    producer.send("serve", request_ids=["doomed"], timeout_s=20)
    connect(victim, BIG_PRODUCER, record)
    pending = victim.call(
        "start_pull_and_hang",
        request_id="doomed",
        producer_engine=PRODUCER.engine_id,
        generation=1,
        remote_ids=doomed,
    )
    assert pending == 1  # its read is posted and not complete
    victim.kill()
    started = time.monotonic()
    assert producer.recv(timeout_s=30) == {"doomed": "expired"}
    assert time.monotonic() - started < 1.5 + LOAD_SLACK_S
    assert producer.call("pool_status") == (1024, 1024)
    assert (
        producer.call(
            "metric",
            name="pdserve_kv_transfer_expired_leases_total",
            labels={
                "producer_engine": "prefill-x",
                "consumer_engine": "unknown",
                "producer_rank": "pp0tp0",
            },
        )
        == 1
    )
    # The producer's agent still serves other consumers.
    fine = producer.call("prefill", request_id="fine", n_blocks=4, seed=7)
    producer.send("serve", request_ids=["fine"])
    connect(survivor, BIG_PRODUCER, record)
    summary = pull(survivor, "fine", BIG_PRODUCER, fine, 7)
    assert summary["ok"] and summary["problems"] == []
    assert producer.recv() == {"fine": "released"}


def test_dead_producer_is_reported_within_bounded_time_and_counted(workers, spare):
    consumer, latecomer = workers[0], workers[1]
    victim = spare[0]
    record = victim.call("setup", engine=PRODUCER, rank=(0, 0))
    consumer.call("setup", engine=CONSUMER, rank=(0, 0), policy="recompute")
    first = victim.call("prefill", request_id="first", n_blocks=3, seed=1)
    second = victim.call("prefill", request_id="second", n_blocks=5, seed=2)
    victim.send("serve", request_ids=["first"])
    connect(consumer, PRODUCER, record)
    assert pull(consumer, "first", PRODUCER, first, 1)["ok"]
    assert victim.recv() == {"first": "released"}
    victim.kill()

    summary = pull(consumer, "second", PRODUCER, second, 2, pull_timeout_s=5.0)
    assert not summary["ok"]
    assert summary["action"] == "recompute"
    assert summary["failed_blocks"] == summary["local_blocks"]
    assert summary["seconds"] < 5.0 + LOAD_SLACK_S
    assert summary["reasons"], summary
    labels = {
        "producer_engine": "prefill-x",
        "consumer_engine": "decode-x",
        "producer_rank": "pp0tp0",
        "consumer_rank": "pp0tp0",
    }
    reason = summary["reasons"][0]
    assert (
        consumer.call(
            "metric", name="pdserve_kv_transfer_failures_total", labels={**labels, "reason": reason}
        )
        == 1
    )
    assert consumer.call("metric", name="pdserve_kv_transfer_recomputes_total", labels=labels) == 1
    # Pre-warming against the dead agent fails loudly instead of waiting for the first request.
    latecomer.call("setup", engine=CONSUMER, rank=(0, 0))
    with pytest.raises(WorkerError, match=r"TransferError|RemoteDisconnectedError"):
        connect(latecomer, PRODUCER, record)


def test_producer_dying_with_a_read_in_flight_is_reported_within_bounded_time(workers, spare):
    consumer = workers[0]
    victim = spare[0]
    record = victim.call("setup", engine=PRODUCER, rank=(0, 0))
    consumer.call("setup", engine=CONSUMER, rank=(0, 0))
    blocks = victim.call("prefill", request_id="orphan", n_blocks=4, seed=3)
    connect(consumer, PRODUCER, record)  # the producer is not polling: the read stays in flight
    summary = pull(
        consumer, "orphan", PRODUCER, blocks, 3, pull_timeout_s=5.0, kill_pid=victim.process.pid
    )
    assert not summary["ok"] and summary["failed_blocks"] == summary["local_blocks"]
    assert summary["reasons"][0] in {"remote_disconnected", "transfer_error", "timeout"}
    assert summary["seconds"] < 5.0 + LOAD_SLACK_S


def test_unresponsive_producer_times_out_and_its_lease_ends(workers):
    producer, consumer = workers[0], workers[1]
    record = producer.call("setup", engine=PRODUCER, rank=(0, 0), lease_s=1.0)
    consumer.call("setup", engine=CONSUMER, rank=(0, 0))
    blocks = producer.call("prefill", request_id="stuck", n_blocks=4, seed=3)
    connect(consumer, PRODUCER, record)  # the producer does not poll: the connection never forms
    summary = pull(consumer, "stuck", PRODUCER, blocks, 3, pull_timeout_s=0.5)
    assert summary["reasons"] == ["timeout"]
    assert 0.5 <= summary["seconds"] < 2.0
    # The consumer's failure notice cannot arrive: the connection never formed (the producer
    # did not progress before the consumer gave the read up), so the lease expires.
    assert producer.call("serve", request_ids=["stuck"]) == {"stuck": "expired"}


def test_pending_pull_fails_when_the_producer_restarts_with_a_new_generation(workers):
    old, new, consumer = workers[0], workers[1], workers[2]
    restarted = EngineSpec("prefill-x", 2, num_layers=2, num_kv_heads=2, pp=1, tp=1)
    old_record = old.call("setup", engine=PRODUCER, rank=(0, 0), lease_s=1.0)
    new_record = new.call("setup", engine=restarted, rank=(0, 0))
    consumer.call("setup", engine=CONSUMER, rank=(0, 0))
    stale = old.call("prefill", request_id="r1", n_blocks=4, seed=4)
    fresh = new.call("prefill", request_id="r2", n_blocks=4, seed=5)
    connect(consumer, PRODUCER, old_record)  # the old producer is not polling: reads stay pending
    summary = pull(
        consumer,
        "r1",
        PRODUCER,
        stale,
        4,
        fence_with=(engine_record_bytes(restarted), {"0:0": new_record}),
    )
    assert summary["reasons"] == ["stale_generation"]
    assert summary["failed_blocks"] == summary["local_blocks"]
    # A request naming the old generation fails as data; the new generation serves.
    assert pull(consumer, "r1-again", PRODUCER, stale, 4)["reasons"] == ["stale_generation"]
    new.send("serve", request_ids=["r2"])
    summary = pull(consumer, "r2", restarted, fresh, 5)
    assert summary["ok"] and summary["problems"] == []
    assert new.recv() == {"r2": "released"}
    assert old.call("serve", request_ids=["r1"]) == {"r1": "expired"}


def test_partial_notifications_expire_and_name_the_consumer_engine(workers):
    producer, consumer_0 = workers[0], workers[1]
    consumer_tp2 = EngineSpec(
        "decode-y", 1, num_layers=2, num_kv_heads=2, pp=1, tp=2, role="decode"
    )
    record = producer.call("setup", engine=PRODUCER, rank=(0, 0), lease_s=1.0)
    consumer_0.call("setup", engine=consumer_tp2, rank=(0, 0))
    blocks = producer.call("prefill", request_id="half", n_blocks=2, seed=6)
    producer.send("serve", request_ids=["half"])
    connect(consumer_0, PRODUCER, record)
    assert pull(consumer_0, "half", PRODUCER, blocks, 6)["ok"]  # rank (0, 1) never pulls
    assert producer.recv() == {"half": "expired"}
    labels = {
        "producer_engine": "prefill-x",
        "consumer_engine": "decode-y",
        "producer_rank": "pp0tp0",
    }
    assert (
        producer.call("metric", name="pdserve_kv_transfer_expired_leases_total", labels=labels) == 1
    )


def test_cancelled_pull_is_reported_as_cancelled(workers):
    producer, consumer = workers[0], workers[1]
    record = producer.call("setup", engine=PRODUCER, rank=(0, 0), lease_s=1.0)
    consumer.call("setup", engine=CONSUMER, rank=(0, 0))
    blocks = producer.call("prefill", request_id="abort-me", n_blocks=2, seed=8)
    connect(consumer, PRODUCER, record)  # not polling: the read stays pending until cancelled
    summary = pull(consumer, "abort-me", PRODUCER, blocks, 8, cancel=True)
    assert summary["reasons"] == ["cancelled"]
    # Nor can its cancel notice: the connection never formed, so the lease expires.
    assert producer.call("serve", request_ids=["abort-me"]) == {"abort-me": "expired"}
