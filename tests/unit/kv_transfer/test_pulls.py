"""Pull bookkeeping: which producer ranks are notified, when, and with what verdict."""

from __future__ import annotations

import numpy as np

from services.kv_transfer.pulls import PullState, ReadState
from services.kv_transfer.transport import PullSpec
from services.topology import EngineLayout, plan_reads

PRODUCER = EngineLayout.uniform(4, 2, 2, 1)  # two PP stages
CONSUMER = EngineLayout.uniform(4, 2, 1, 1)


def pull_state(notify_only=()) -> PullState:
    reads = plan_reads(CONSUMER.shards[(0, 0)], PRODUCER)
    spec = PullSpec("r", "p", 1, reads, (1, 2), (3, 4), notify_only=notify_only)
    state = PullState(spec, started=0.0, deadline=1.0)
    ids = np.array([3, 4]), np.array([1, 2])
    state.reads = [ReadState(r, ("p", (r.remote_pp, r.remote_tp)), *ids) for r in reads]
    return state


def test_each_rank_is_notified_once_when_its_reads_end():
    state = pull_state()
    assert state.due_notifications() == []
    state.reads[1].done = True
    assert state.due_notifications() == [((1, 0), True)]
    state.reads[0].fail("timeout", "slow")
    assert state.due_notifications() == [((0, 0), False)]
    assert state.due_notifications() == []
    result = state.result(now=0.5)
    assert not result.ok and result.failed_block_ids == (3, 4)
    assert result.failures[0].remote_block_ids == (1, 2)
    assert [t.producer_rank for t in result.transfers] == [(1, 0)]


def test_gone_producers_are_not_notified_and_unread_replicas_wait_for_the_whole_pull():
    state = pull_state(notify_only=((0, 1),))
    state.reads[0].fail("remote_disconnected", "dead")
    assert state.due_notifications() == []
    state.reads[1].done = True
    assert state.due_notifications() == [((1, 0), True), ((0, 1), False)]
