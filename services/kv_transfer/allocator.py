"""Reference-counted allocation of a worker's KV blocks (pure Python, no torch).

A block is free exactly when its count is zero. :meth:`BlockAllocator.allocate` hands out free
blocks with a count of one, lowest ids first so that a request's blocks tend to be contiguous
(adjacent descriptors merge into larger transfers); :meth:`~BlockAllocator.incref` adds an owner
(a producer lease holding a request's blocks while consumers read them);
:meth:`~BlockAllocator.free` drops one owner. Every call validates all its ids before changing
anything, so a refused call leaves the allocator as it was.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from services.kv_transfer.errors import BlockStateError, PoolExhaustedError
from services.kv_transfer.protocol import BlockIds

BlockArray = npt.NDArray[np.int64]


def block_array(block_ids: Iterable[int]) -> BlockArray:
    """Block ids as an int64 array (no copy when they already are one)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.int64, copy=False)
    if isinstance(block_ids, (tuple, list)):
        return np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
    return np.fromiter(block_ids, dtype=np.int64)


class BlockAllocator:
    """Reference counts over blocks ``0 .. num_blocks - 1``. Not thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._free: list[int] = list(range(num_blocks))  # a heap; already one when sorted

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def free_count(self) -> int:
        """Blocks with no owner."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self._num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        """Owners of ``block_id`` (0 when free)."""
        self._checked((block_id,))
        return int(self._refs[block_id])

    def all_allocated(self, block_ids: Iterable[int]) -> bool:
        """Whether every id is in range and has an owner (vectorized: the pull path uses it)."""
        ids = block_array(block_ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._num_blocks):
            return False
        return bool((self._refs[ids] > 0).all())

    def allocate(self, count: int) -> BlockIds:
        """``count`` free blocks, each with one owner. Raises :class:`PoolExhaustedError`."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise PoolExhaustedError(
                f"asked for {count} blocks, {len(self._free)} of {self._num_blocks} free"
            )
        blocks = tuple(heapq.heappop(self._free) for _ in range(count))
        self._refs[list(blocks)] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each block (repeated ids add several). Blocks must be allocated."""
        ids = self._checked(block_ids)
        free = np.unique(ids[self._refs[ids] == 0])
        if free.size:
            raise BlockStateError(f"incref of free blocks {free[:8].tolist()}")
        np.add.at(self._refs, ids, 1)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block (repeated ids drop several); a block reaching zero
        owners returns to the free list. Raises :class:`BlockStateError` on a double free."""
        ids = self._checked(block_ids)
        unique, counts = np.unique(ids, return_counts=True)
        over = unique[counts > self._refs[unique]]
        if over.size:
            raise BlockStateError(f"double free of blocks {over[:8].tolist()}")
        self._refs[unique] -= counts
        for block in unique[self._refs[unique] == 0].tolist():
            heapq.heappush(self._free, block)

    def _checked(self, block_ids: Iterable[int]) -> BlockArray:
        ids = block_array(block_ids)
        bad = ids[(ids < 0) | (ids >= self._num_blocks)]
        if bad.size:
            raise BlockStateError(f"block ids {bad[:8].tolist()} outside [0, {self._num_blocks})")
        return ids
