"""Which reads each consumer rank issues, and who tells each producer worker it may free.

Every producer worker that prefilled a request holds its blocks until the consumer ranks it
expects have notified it. Two conventions make every rank of both engines agree on those
numbers without talking to each other, and they are fixed here and nowhere else:

- a consumer rank plans with ``replica_hint = tp_rank`` (where the producer's TP exceeds its KV
  heads, this spreads the TP ranks of a stage over the replicas);
- a producer worker that no consumer rank reads (an unread replica) is notified anyway, by the
  lowest consumer rank that reads the same layers and heads from a sibling replica, so that it
  frees the request at once instead of at lease expiry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.topology import EngineLayout, PlannedRead, plan_reads
from services.topology.ranges import RankKey


def reads_for(
    rank: RankKey, consumer: EngineLayout, producer: EngineLayout
) -> tuple[PlannedRead, ...]:
    """The reads consumer rank ``rank`` issues to gather its shard from the producer engine."""
    return plan_reads(consumer.shards[rank], producer, replica_hint=rank[1])


@dataclass(frozen=True)
class NotificationPlan:
    """Who notifies whom for every request between two engines."""

    notifiers: Mapping[RankKey, int]
    """Per producer rank: how many consumer ranks notify it (every producer rank is present)."""
    notify_only: Mapping[RankKey, tuple[RankKey, ...]]
    """Per consumer rank: producer ranks it notifies without reading from them."""


def notification_plan(consumer: EngineLayout, producer: EngineLayout) -> NotificationPlan:
    """The notification duties between ``consumer`` and ``producer`` (see the module docstring)."""
    readers: dict[RankKey, list[RankKey]] = {rank: [] for rank in producer.shards}
    for rank in sorted(consumer.shards):
        for remote in {(r.remote_pp, r.remote_tp) for r in reads_for(rank, consumer, producer)}:
            readers[remote].append(rank)
    notify_only: dict[RankKey, list[RankKey]] = {}
    for remote, who in sorted(readers.items()):
        if who:
            continue
        shard = producer.shards[remote]
        sibling_readers = sorted(
            rank
            for rank, mine in consumer.shards.items()
            if mine.layers.intersect(shard.layers) and mine.kv_heads.intersect(shard.kv_heads)
        )
        who.append(sibling_readers[0])  # the layouts cover every layer and head: never empty
        notify_only.setdefault(sibling_readers[0], []).append(remote)
    return NotificationPlan(
        notifiers={remote: len(who) for remote, who in readers.items()},
        notify_only={rank: tuple(remotes) for rank, remotes in notify_only.items()},
    )
