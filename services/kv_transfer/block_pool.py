"""A worker's paged KV block pool: the tensors an engine attends over and NIXL moves.

Layout (HND, like vLLM's NIXL connector): one buffer ``[layers, 2, num_blocks, kv_heads,
block_size, head_size]`` whose ``[layer, 0]`` / ``[layer, 1]`` views are that local layer's K and
V tensors, each ``[num_blocks, kv_heads, block_size, head_size]``. Consequences the transfer code
relies on:

- each (layer, K/V) tensor is one contiguous *region*; regions are ordered
  ``(layer0 K, layer0 V, layer1 K, ...)``, as :class:`~services.control_plane.wire.HandshakeRecord`
  publishes them (:meth:`KVTransport.handshake_record
  <services.kv_transfer.transport.KVTransport.handshake_record>`);
- block ``b`` of a region starts at ``base + b * block_stride`` and is ``block_len`` bytes;
- within a block, the local head ``h`` is the contiguous range starting at ``h * head_bytes``,
  so any head slice of one block of one layer is one contiguous range.

The buffer is zeroed at creation (every page is touched before NIXL registers it). The same code
serves CPU memory (``DRAM``) and GPU memory (``VRAM``): only ``device`` differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.control_plane.aggregation import DTYPE_BYTES
from services.control_plane.wire import KV_LAYOUT_HND, KV_REGIONS_PER_LAYER
from services.kv_transfer.allocator import BlockAllocator
from services.kv_transfer.descriptors import RegionGeometry
from services.kv_transfer.protocol import BlockIds
from services.topology import Range, WorkerShard

KV_LAYOUT = KV_LAYOUT_HND


@dataclass(frozen=True)
class KVPoolSpec:
    """The shape of one worker's pool: its shard of the model and its block geometry."""

    layers: Range
    """Global layer range the worker owns."""
    kv_heads: Range
    """Global KV-head range the worker owns."""
    num_blocks: int
    block_size: int
    """Tokens per block."""
    head_size: int
    dtype: str = "float16"
    """A key of :data:`~services.control_plane.aggregation.DTYPE_BYTES`."""
    device: str = "cpu"
    """A torch device string: ``cpu`` (NIXL ``DRAM``) or ``cuda:N`` (NIXL ``VRAM``)."""

    def __post_init__(self) -> None:
        if not self.layers or not self.kv_heads:
            raise ValueError(f"empty shard: layers {self.layers}, KV heads {self.kv_heads}")
        if min(self.num_blocks, self.block_size, self.head_size) < 1:
            raise ValueError("num_blocks, block_size and head_size must be >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}: one of {sorted(DTYPE_BYTES)}")

    @property
    def shard(self) -> WorkerShard:
        return WorkerShard(self.layers, self.kv_heads)

    @property
    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head within one block of one region."""
        return self.block_size * self.head_size * self.element_size

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region (all local heads)."""
        return len(self.kv_heads) * self.head_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return 2 * len(self.layers) * self.region_bytes


class KVBlockPool:
    """Per-worker K/V tensors plus a reference-counted block allocator.

    Not thread-safe: one engine loop owns it. Memory registration with NIXL is the transport's
    job (:class:`~services.kv_transfer.nixl_transport.NixlTransport` registers :attr:`buffer`).
    """

    def __init__(self, spec: KVPoolSpec) -> None:
        self.spec = spec
        dtype = getattr(torch, spec.dtype)
        self.buffer = torch.zeros(
            len(spec.layers),
            2,
            spec.num_blocks,
            len(spec.kv_heads),
            spec.block_size,
            spec.head_size,
            dtype=dtype,
            device=torch.device(spec.device),
        )
        self.keys: tuple[torch.Tensor, ...] = tuple(self.buffer[:, 0])
        """Local layer ``i``'s K tensor ``[num_blocks, kv_heads, block_size, head_size]``."""
        self.values: tuple[torch.Tensor, ...] = tuple(self.buffer[:, 1])
        self.allocator = BlockAllocator(spec.num_blocks)

    # -- allocation ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def free_count(self) -> int:
        return self.allocator.free_count

    def allocate(self, count: int) -> BlockIds:
        """``count`` blocks with one owner each; raises :class:`PoolExhaustedError`."""
        return self.allocator.allocate(count)

    def incref(self, block_ids: Iterable[int]) -> None:
        self.allocator.incref(block_ids)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner per id; raises :class:`BlockStateError` on a double free."""
        self.allocator.free(block_ids)

    # -- tensors and regions -----------------------------------------------------------------

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V tensors of *global* layer ``layer``."""
        if layer not in self.spec.layers:
            raise IndexError(f"layer {layer} not in this pool's layers {self.spec.layers}")
        index = layer - self.spec.layers.start
        return self.keys[index], self.values[index]

    def regions(self) -> tuple[torch.Tensor, ...]:
        """The region tensors in handshake order ``(layer0 K, layer0 V, layer1 K, ...)``."""
        return tuple(t for pair in zip(self.keys, self.values, strict=True) for t in pair)

    @property
    def memory_type(self) -> str:
        """NIXL memory type: ``DRAM`` for CPU memory, ``VRAM`` for GPU memory."""
        return "DRAM" if self.buffer.device.type == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        index = self.buffer.device.index
        return 0 if index is None else int(index)

    def geometry(self) -> RegionGeometry:
        """The regions as descriptor building reads them (as a handshake publishes them)."""
        return RegionGeometry(
            base_addrs=tuple(int(t.data_ptr()) for t in self.regions()),
            layers=self.spec.layers,
            kv_heads=self.spec.kv_heads,
            num_blocks=self.spec.num_blocks,
            block_len=self.spec.block_len,
            block_stride=self.spec.block_len,
            device_id=self.device_id,
            memory_type=self.memory_type,
            regions_per_layer=KV_REGIONS_PER_LAYER[KV_LAYOUT],
        )
