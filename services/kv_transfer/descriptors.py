"""Descriptor lists and index arithmetic for NIXL reads (pure numpy; no NIXL, no torch).

A *slice* is a set of regions (a layer range, K and V) cut to one head range. Its descriptor
list has one ``(address, length, device)`` row per (layer, region, block), in that order, covering
*every* block of the regions: it is prepared once per peer, and a request then selects its blocks
by index (:func:`slice_indices`), which costs a few numpy operations instead of building and
validating descriptors per request. A layer has two regions (``HND``: K, then V) or one
(``HNC``: K and V packed in each head's part of a block, vLLM's ``LBHNC``); either way a head
slice of one block of one region is one contiguous range. Consecutive blocks of a full-head
slice are adjacent in memory, so NIXL merges them into larger transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from services.control_plane.wire import KV_REGIONS_PER_LAYER, HandshakeRecord
from services.topology import Range

_INDEX_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class RegionGeometry:
    """One worker's regions as descriptor building needs them (local pool or remote record)."""

    base_addrs: tuple[int, ...]
    layers: Range
    kv_heads: Range
    num_blocks: int
    block_len: int
    block_stride: int
    device_id: int
    memory_type: str
    regions_per_layer: int = 2
    """``KV_REGIONS_PER_LAYER`` of the record's layout: 2 (``HND``) or 1 (``HNC``)."""

    @classmethod
    def of(cls, source: HandshakeRecord) -> RegionGeometry:
        """From a remote worker's handshake record (the local pool's: ``KVBlockPool.geometry``)."""
        return cls(
            base_addrs=source.region_base_addrs,
            layers=source.layers,
            kv_heads=source.kv_heads,
            num_blocks=source.num_blocks,
            block_len=source.block_len,
            block_stride=source.block_stride,
            device_id=source.device_id,
            memory_type=source.memory_type,
            regions_per_layer=KV_REGIONS_PER_LAYER[source.kv_layout],
        )

    @property
    def head_bytes(self) -> int:
        return self.block_len // len(self.kv_heads)

    def slice_bytes(self, heads: Range) -> int:
        """Bytes of one block of one region cut to ``heads``."""
        return len(heads) * self.head_bytes


def slice_descriptors(
    geometry: RegionGeometry, layers: Range, heads: Range
) -> npt.NDArray[np.uint64]:
    """Rows ``(address, length, device_id)`` for every (layer, region, block) of the slice.

    ``layers`` and ``heads`` are global and must lie inside the geometry's shard. Row of
    (layer ``l``, region ``r``, block ``b``), with ``R`` regions per layer:
    ``((l - layers.start) * R + r) * num_blocks + b``.
    """
    if layers.intersect(geometry.layers) != layers or heads.intersect(geometry.kv_heads) != heads:
        raise ValueError(
            f"slice layers {layers} heads {heads} outside the shard "
            f"{geometry.layers} x {geometry.kv_heads}"
        )
    per_layer = geometry.regions_per_layer
    first = (layers.start - geometry.layers.start) * per_layer
    bases = np.array(
        geometry.base_addrs[first : first + per_layer * len(layers)], dtype=np.uint64
    )  # regions in (layer, region) order
    head_offset = (heads.start - geometry.kv_heads.start) * geometry.head_bytes
    offsets = np.arange(geometry.num_blocks, dtype=np.uint64) * np.uint64(geometry.block_stride)
    addresses = (bases[:, None] + offsets[None, :] + np.uint64(head_offset)).reshape(-1)
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0] = addresses
    rows[:, 1] = geometry.slice_bytes(heads)
    rows[:, 2] = geometry.device_id
    return rows


def slice_indices(
    slice_layers: Range,
    read_layers: Range,
    num_blocks: int,
    block_ids: Sequence[int] | npt.NDArray[np.int64],
    *,
    regions_per_layer: int = 2,
) -> npt.NDArray[np.int32]:
    """Indices into a slice's descriptor list for ``read_layers`` x regions x ``block_ids``.

    The order is layer-major, then region (K/V), then the order of ``block_ids``; the same call
    on the local and the remote side (with each side's block ids) gives index lists that pair
    up (both sides must have the same ``regions_per_layer``).
    """
    offset = read_layers.start - slice_layers.start
    if offset < 0 or read_layers.stop > slice_layers.stop:
        raise ValueError(f"read layers {read_layers} outside the prepared {slice_layers}")
    if regions_per_layer * len(slice_layers) * num_blocks > _INDEX_LIMIT:
        raise ValueError("descriptor list too large for int32 indices")
    blocks = np.asarray(block_ids)
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block ids outside [0, {num_blocks})")
    # Row of (layer, region) = R * layer + region; the outer sum is computed in int32 directly.
    rows = np.arange(
        regions_per_layer * offset,
        regions_per_layer * (offset + len(read_layers)),
        dtype=np.int32,
    )
    indices: npt.NDArray[np.int32] = np.add.outer(
        rows * np.int32(num_blocks), blocks.astype(np.int32)
    ).reshape(-1)
    return indices
