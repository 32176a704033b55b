"""The reference-counted block allocator: every transition, and a model-based state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.kv_transfer.allocator import BlockAllocator
from services.kv_transfer.errors import BlockStateError, PoolExhaustedError


def test_allocates_lowest_ids_first_so_requests_are_contiguous():
    allocator = BlockAllocator(8)
    assert allocator.allocate(3) == (0, 1, 2)
    allocator.free([1])
    assert allocator.allocate(2) == (1, 3)
    assert allocator.free_count == 4 and allocator.used_count == 4


def test_exhaustion_allocates_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(PoolExhaustedError, match="asked for 2 blocks, 1 of 4 free"):
        allocator.allocate(2)
    assert allocator.free_count == 1


def test_block_returns_to_the_pool_only_when_its_last_owner_frees_it():
    allocator = BlockAllocator(2)
    (block,) = allocator.allocate(1)
    allocator.incref([block])
    assert allocator.refcount(block) == 2
    allocator.free([block])
    assert allocator.free_count == 1
    allocator.free([block])
    assert allocator.free_count == 2 and allocator.refcount(block) == 0


def test_double_free_is_refused_and_changes_nothing():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free([blocks[0]])
    with pytest.raises(BlockStateError, match=r"double free of blocks \[0\]"):
        allocator.free(blocks)  # block 1 is valid, block 0 is not: nothing happens
    assert allocator.refcount(blocks[1]) == 1
    with pytest.raises(BlockStateError, match="double free"):
        allocator.free([blocks[1], blocks[1]])
    assert allocator.refcount(blocks[1]) == 1


def test_incref_of_a_free_block_and_out_of_range_ids_are_refused():
    allocator = BlockAllocator(4)
    with pytest.raises(BlockStateError, match="incref of free blocks"):
        allocator.incref([0])
    with pytest.raises(BlockStateError, match="outside"):
        allocator.free([4])
    with pytest.raises(BlockStateError, match="outside"):
        allocator.refcount(-1)
    with pytest.raises(ValueError):
        BlockAllocator(0)


class AllocatorMachine(RuleBasedStateMachine):
    """Against a dict model: counts, free count and refusals always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(16)
        self.model: dict[int, int] = {}

    @rule(count=st.integers(0, 20))
    def allocate(self, count: int) -> None:
        if count > 16 - len(self.model):
            with pytest.raises(PoolExhaustedError):
                self.allocator.allocate(count)
            return
        blocks = self.allocator.allocate(count)
        assert len(set(blocks)) == count and not set(blocks) & set(self.model)
        self.model.update(dict.fromkeys(blocks, 1))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.model)))
        self.allocator.incref([block])
        self.model[block] += 1

    @rule(block=st.integers(0, 15))
    def free(self, block: int) -> None:
        if block not in self.model:
            with pytest.raises(BlockStateError):
                self.allocator.free([block])
            return
        self.allocator.free([block])
        self.model[block] -= 1
        if not self.model[block]:
            del self.model[block]

    @invariant()
    def agrees_with_model(self) -> None:
        assert self.allocator.free_count == 16 - len(self.model)
        for block in range(16):
            assert self.allocator.refcount(block) == self.model.get(block, 0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
