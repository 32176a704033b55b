"""The transfer plan: which reads a local worker issues to gather its KV from a remote engine.

A pure function of the local worker's shard and the remote engine's layout. Any PP split on
either side (layer ranges are intersected) and TP in either direction (head ranges are
intersected) work, including a remote TP larger than the number of KV heads, where several remote
ranks hold the same head: one replica is read, chosen by ``replica_hint`` so that the local ranks
of an engine spread their reads over the replicas.

The guarantee, property-tested: every ``(layer, kv_head)`` of the local shard is read exactly
once, and nothing else is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from services.topology.errors import LayoutError
from services.topology.ranges import EngineLayout, Range, WorkerShard


@dataclass(frozen=True)
class PlannedRead:
    """One contiguous read: ``layers`` x ``kv_heads`` (global indices) from one remote worker.

    The ``*_local`` / ``*_remote`` helpers turn global indices into indices within each side's
    shard, which is how each side's KV region is addressed.
    """

    remote_pp: int
    remote_tp: int
    layers: Range
    kv_heads: Range
    remote_shard: WorkerShard
    local_shard: WorkerShard

    @property
    def remote_layers(self) -> Range:
        """Layer indices within the remote worker's layer range."""
        return self.layers.shift(self.remote_shard.layers.start)

    @property
    def local_layers(self) -> Range:
        """Layer indices within the local worker's layer range."""
        return self.layers.shift(self.local_shard.layers.start)

    @property
    def remote_heads(self) -> Range:
        """Head indices within the remote worker's head range (its head slice)."""
        return self.kv_heads.shift(self.remote_shard.kv_heads.start)

    @property
    def local_heads(self) -> Range:
        """Head indices within the local worker's head range (its head slice)."""
        return self.kv_heads.shift(self.local_shard.kv_heads.start)


def plan_reads(
    local: WorkerShard, remote: EngineLayout, *, replica_hint: int = 0
) -> tuple[PlannedRead, ...]:
    """The reads that give ``local`` exactly its layers x KV heads from the ``remote`` engine.

    Reads come ordered by remote PP stage, then by head range. Raises :class:`LayoutError` when
    the two sides disagree on the model (layer or head count), when the local shard lies outside
    the model, or when the remote layout cannot cover the local shard exactly once (a layout that
    the control plane's aggregation would have refused).
    """
    if local.layers.stop > remote.num_layers or local.kv_heads.stop > remote.num_kv_heads:
        raise LayoutError(
            f"local shard layers {local.layers} heads {local.kv_heads} outside the remote model "
            f"({remote.num_layers} layers, {remote.num_kv_heads} KV heads)"
        )
    reads: list[PlannedRead] = []
    covered_layers = 0
    read_layers: list[Range] = []
    for pp in range(remote.pp_size):
        stage_layers = remote.stage_layers(pp)
        layers = stage_layers.intersect(local.layers)
        if layers is None:
            continue
        covered_layers += len(layers)
        read_layers.append(layers)
        replicas: dict[Range, list[int]] = {}
        for tp in range(remote.tp_size):
            shard = remote.shards[(pp, tp)]
            if shard.layers != stage_layers:
                raise LayoutError(f"remote ({pp},{tp}) layers {shard.layers} != {stage_layers}")
            replicas.setdefault(shard.kv_heads, []).append(tp)
        covered_heads = 0
        previous_stop = -1
        for heads_range in sorted(replicas):
            heads = heads_range.intersect(local.kv_heads)
            if heads is None:
                continue
            if heads.start < previous_stop:
                raise LayoutError(f"remote stage {pp} head ranges overlap at {heads_range}")
            previous_stop = heads.stop
            covered_heads += len(heads)
            holders = replicas[heads_range]
            tp = holders[replica_hint % len(holders)]
            reads.append(PlannedRead(pp, tp, layers, heads, remote.shards[(pp, tp)], local))
        if covered_heads != len(local.kv_heads):
            raise LayoutError(
                f"remote stage {pp} covers {covered_heads} of the {len(local.kv_heads)} KV heads "
                f"{local.kv_heads} the local worker needs"
            )
    # Counting alone would let a layer read twice hide a layer never read.
    for before, after in pairwise(sorted(read_layers)):
        if after.start < before.stop:
            raise LayoutError(f"remote stages overlap at layers {before} and {after}")
    if covered_layers != len(local.layers):
        raise LayoutError(
            f"remote stages cover {covered_layers} of the {len(local.layers)} layers "
            f"{local.layers} the local worker needs"
        )
    return tuple(reads)
