"""The reads one vLLM consumer rank issues, from pdserve's transfer plan (pure: no vLLM import).

vLLM 0.32.0's pull worker maps ranks by TP ratio only (``tp_mapping.compute_tp_mapping``): it
cannot read from a PP-sharded producer, decode PP is refused, and a consumer TP below the
producer's reads whole remote blocks into split local handles. pdserve's connector instead
plans with :func:`services.kv_transfer.planning.reads_for` over the producer's READY records
(every record carries its layer and KV-head range) and the consumer's own cut, so any
``(PP, TP) -> (PP, TP)`` pair of the same dense model works:

- each :class:`PlannedRead` becomes one descriptor list pair, prepared once per peer: the local
  one over the consumer rank's regions, the remote one over the producer rank's, both cut to the
  read's layers x KV heads (:func:`~services.kv_transfer.descriptors.slice_descriptors`);
- a request then selects its blocks by index on both sides
  (:meth:`RankTransferPlan.block_indices`);
- the notification duties come from :func:`~services.kv_transfer.planning.notification_plan`:
  each producer rank is told how many consumer ranks notify it (vLLM's producer frees a
  request's blocks when ``"<request>:<count>"`` arrived ``count`` times), and replicas nobody
  reads are notified anyway by one consumer rank.

vLLM's ``LBHNC`` page (CPU and GPU attention backends) is one region per layer whose block is
``[kv_heads, block_size, 2 * head_size]`` (record layout ``HNC``): a head's K and V of one
block are one contiguous range, which is what a head-sliced read needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from services.control_plane.wire import HandshakeRecord
from services.kv_transfer.descriptors import RegionGeometry, slice_descriptors, slice_indices
from services.kv_transfer.planning import notification_plan, reads_for
from services.topology import EngineLayout, PlannedRead, Range, WorkerShard, kv_head_range
from services.topology.errors import LayoutError
from services.topology.ranges import RankKey


def consumer_layout(layer_ranges: Sequence[Range], num_kv_heads: int, tp_size: int) -> EngineLayout:
    """The consumer engine's cut: vLLM's stage layer ranges x pdserve's KV-head ranges."""
    shards = {
        (pp, tp): WorkerShard(layers, kv_head_range(num_kv_heads, tp_size, tp))
        for pp, layers in enumerate(layer_ranges)
        for tp in range(tp_size)
    }
    return EngineLayout(
        num_layers=layer_ranges[-1].stop,
        num_kv_heads=num_kv_heads,
        pp_size=len(layer_ranges),
        tp_size=tp_size,
        shards=shards,
    )


def producer_layout(
    records: Mapping[RankKey, HandshakeRecord], *, num_layers: int, num_kv_heads: int
) -> EngineLayout:
    """The producer engine's cut, as its READY records describe it."""
    if not records:
        raise LayoutError("the producer has no handshake records")
    pp_size = 1 + max(pp for pp, _ in records)
    tp_size = 1 + max(tp for _, tp in records)
    if len(records) != pp_size * tp_size:
        raise LayoutError(f"producer records {sorted(records)} are not a PP x TP grid")
    shards = {rank: WorkerShard(r.layers, r.kv_heads) for rank, r in records.items()}
    return EngineLayout(num_layers, num_kv_heads, pp_size, tp_size, shards)


@dataclass(frozen=True)
class RankRead:
    """One planned read with the descriptor rows of both sides (prepared once per peer)."""

    read: PlannedRead
    local_rows: npt.NDArray[np.uint64]
    """Rows ``(address, length, device)`` over the local regions: (layer, region, block)."""
    remote_rows: npt.NDArray[np.uint64]
    """The same rows over the producer rank's regions."""
    notifiers: int
    """How many consumer ranks notify this read's producer rank per request."""

    @property
    def remote_rank(self) -> RankKey:
        return (self.read.remote_pp, self.read.remote_tp)


@dataclass(frozen=True)
class RankTransferPlan:
    """What one consumer rank reads from one producer engine generation, and whom it notifies."""

    rank: RankKey
    local: RegionGeometry
    remote: Mapping[RankKey, RegionGeometry]
    reads: tuple[RankRead, ...]
    notify_only: tuple[tuple[RankKey, int], ...]
    """Producer ranks nobody reads that this rank notifies, with their notifier counts."""

    @property
    def peers(self) -> tuple[RankKey, ...]:
        """Every producer rank this consumer rank talks to (reads or notifications), sorted."""
        ranks = {read.remote_rank for read in self.reads}
        ranks.update(rank for rank, _ in self.notify_only)
        return tuple(sorted(ranks))

    def block_indices(
        self,
        read: RankRead,
        local_block_ids: Sequence[int] | npt.NDArray[np.int64],
        remote_block_ids: Sequence[int] | npt.NDArray[np.int64],
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Indices into ``read``'s local and remote descriptor lists for one request's blocks
        (paired row by row: local block ``i`` receives remote block ``i``)."""
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError(
                f"{len(local_block_ids)} local blocks for {len(remote_block_ids)} remote ones"
            )
        remote = self.remote[read.remote_rank]
        local_idx = slice_indices(
            read.read.layers,
            read.read.layers,
            self.local.num_blocks,
            local_block_ids,
            regions_per_layer=self.local.regions_per_layer,
        )
        remote_idx = slice_indices(
            read.read.layers,
            read.read.layers,
            remote.num_blocks,
            remote_block_ids,
            regions_per_layer=remote.regions_per_layer,
        )
        return local_idx, remote_idx


def plan_rank(
    rank: RankKey,
    consumer: EngineLayout,
    records: Mapping[RankKey, HandshakeRecord],
    local: RegionGeometry,
) -> RankTransferPlan:
    """The reads and notifications of consumer ``rank`` against the producer's ``records``.

    Raises :class:`LayoutError` when the two sides cannot be paired: another model cut, another
    region layout or element size per head (a head slice must be the same bytes on both sides),
    or a local geometry that is not the consumer's shard.
    """
    producer = producer_layout(
        records, num_layers=consumer.num_layers, num_kv_heads=consumer.num_kv_heads
    )
    shard = consumer.shards[rank]
    if (local.layers, local.kv_heads) != (shard.layers, shard.kv_heads):
        raise LayoutError(
            f"local regions hold layers {local.layers} heads {local.kv_heads}, consumer rank "
            f"{rank} owns {shard.layers} x {shard.kv_heads}"
        )
    remote = {key: RegionGeometry.of(record) for key, record in records.items()}
    for key, geometry in remote.items():
        if geometry.regions_per_layer != local.regions_per_layer:
            raise LayoutError(
                f"producer rank {key} has {geometry.regions_per_layer} regions per layer, the "
                f"consumer {local.regions_per_layer}"
            )
        if geometry.head_bytes != local.head_bytes:
            raise LayoutError(
                f"producer rank {key} has {geometry.head_bytes} bytes per head and block, the "
                f"consumer {local.head_bytes} (block size, head size and dtype must match)"
            )
    duties = notification_plan(consumer, producer)
    reads = tuple(
        RankRead(
            read=read,
            local_rows=slice_descriptors(local, read.layers, read.kv_heads),
            remote_rows=slice_descriptors(
                remote[(read.remote_pp, read.remote_tp)], read.layers, read.kv_heads
            ),
            notifiers=duties.notifiers[(read.remote_pp, read.remote_tp)],
        )
        for read in reads_for(rank, consumer, producer)
    )
    notify_only = tuple(
        (remote_rank, duties.notifiers[remote_rank])
        for remote_rank in duties.notify_only.get(rank, ())
    )
    return RankTransferPlan(rank, local, remote, reads, notify_only)
