"""Completion across ranks (consumer engine) and producer leases: the two state machines."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.kv_transfer.allocator import BlockAllocator
from services.kv_transfer.completion import CompletionTracker, ProducerLeases
from services.kv_transfer.errors import (
    BlockStateError,
    DuplicateReportError,
    LeaseError,
    UnknownRankError,
)
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.protocol import KVNotification

GRID = [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_request_completes_only_when_every_rank_reported_once():
    tracker = CompletionTracker(GRID)
    for rank in GRID[:-1]:
        assert tracker.report("r", rank) is None
    assert tracker.missing("r") == {(1, 1)}
    done = tracker.report("r", (1, 1), ok=False, failed_block_ids=[4, 2])
    assert done is not None
    assert [r.rank for r in done.reports] == GRID
    assert not done.ok and done.failed_ranks == ((1, 1),) and done.failed_block_ids == (2, 4)
    assert tracker.pending() == 0


def test_duplicate_reports_are_refused_and_counted_also_after_completion():
    metrics = KVTransferMetrics(CollectorRegistry())
    tracker = CompletionTracker([(0, 0), (1, 0)], engine_id="decode-0", metrics=metrics)
    tracker.report("r", (0, 0))
    with pytest.raises(DuplicateReportError, match="pp0tp0 reported 'r' twice"):
        tracker.report("r", (0, 0))
    assert tracker.report("r", (1, 0)) is not None
    with pytest.raises(DuplicateReportError):
        tracker.report("r", (1, 0))  # late duplicate of a completed request
    assert tracker.duplicates == 2
    labels = {"consumer_engine": "decode-0", "consumer_rank": "pp1tp0"}
    assert (
        metrics.registry.get_sample_value("pdserve_kv_transfer_duplicate_reports_total", labels)
        == 1
    )


def test_reports_from_outside_the_grid_are_refused():
    tracker = CompletionTracker(GRID)
    with pytest.raises(UnknownRankError):
        tracker.report("r", (2, 0))
    assert tracker.pending() == 0


def test_forgotten_request_starts_afresh():
    tracker = CompletionTracker([(0, 0), (0, 1)])
    tracker.report("r", (0, 0))
    tracker.forget("r")
    assert tracker.report("r", (0, 0)) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def note(
    request_id: str, rank: tuple[int, int], expected: int = 2, *, engine: str = "d", ok: bool = True
):
    return KVNotification(request_id, engine, 1, rank, expected, ok)


def held(blocks: int = 8) -> tuple[BlockAllocator, ProducerLeases, Clock, tuple[int, ...]]:
    allocator = BlockAllocator(blocks)
    clock = Clock()
    leases = ProducerLeases(allocator, default_lease_s=5.0, clock=clock)
    ids = allocator.allocate(3)
    leases.hold("r", ids)
    allocator.free(ids)  # the engine drops its own reference; the lease keeps them
    return allocator, leases, clock, ids


def test_lease_releases_after_every_expected_consumer_rank_notified():
    allocator, leases, _, ids = held()
    assert allocator.free_count == 5
    assert leases.notify(note("r", (0, 0))) == ("counted", None)
    assert leases.notify(note("r", (0, 0)))[0] == "duplicate"
    outcome, end = leases.notify(note("r", (0, 1), ok=False))
    assert outcome == "counted" and end is not None
    assert end.outcome == "released" and end.block_ids == ids and end.any_failed
    assert end.notified == {(0, 0), (0, 1)} and end.consumer_engine == "d"
    assert allocator.free_count == 8 and len(leases) == 0


def test_lease_expires_at_its_deadline_and_frees_the_blocks():
    allocator, leases, clock, _ = held()
    leases.notify(note("r", (0, 0)))
    clock.now += 4.9
    assert leases.expire() == []
    clock.now += 0.2
    (end,) = leases.expire()
    assert end.outcome == "expired" and end.notified == {(0, 0)} and end.expected == 2
    assert allocator.free_count == 8
    assert leases.notify(note("r", (0, 1))) == ("unknown_request", None)  # too late


def test_expected_count_from_the_engine_overrides_the_notifications():
    allocator = BlockAllocator(4)
    leases = ProducerLeases(allocator, clock=Clock())
    leases.hold("r", allocator.allocate(1), expected_notifiers=1)
    assert leases.notify(note("r", (0, 0), expected=4))[1] is not None


def test_notifications_from_another_consumer_engine_do_not_count():
    _, leases, _, _ = held()
    leases.notify(note("r", (0, 0)))
    assert leases.notify(note("r", (0, 1), engine="other")) == ("foreign_engine", None)
    assert "r" in leases


def test_lease_misuse_is_refused():
    allocator, leases, _, ids = held()
    with pytest.raises(LeaseError):
        leases.hold("r", ids)
    with pytest.raises(LeaseError):
        leases.abort("nope")
    with pytest.raises(BlockStateError):
        leases.hold("other", [7])  # block 7 was never allocated
    end = leases.abort("r")
    assert end.outcome == "aborted" and allocator.free_count == 8
    assert leases.next_deadline() is None
