"""Every shard of a reference-engine PP x TP layout in one process, for tests.

A deployed reference engine runs each ``(pp_rank, tp_rank)`` in its own process with
torch.distributed. This module runs the same shards in one process instead: PP stages one after
the other, the TP ranks of a stage on threads whose all-reduce is an in-memory sum. It exists so
tests can check that any layout computes what the unsharded model computes, with the very code
the workers run (the reference engine's tests in tests/unit/engines and tests/integration/engines
use it; nothing in ``services`` does).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import TracebackType

import torch

from services.engines.reference.batch import ForwardBatch, PagedKVCache, SequenceChunk
from services.engines.reference.layers import AllReduce
from services.engines.reference.loader import load_model
from services.engines.reference.model import LlamaShard
from services.engines.reference.sharding import ShardSpec
from services.topology import EngineLayout


class ThreadAllReduce:
    """An all-reduce among ``world_size`` threads: every rank deposits its tensor, and each sums
    all of them in rank order, so every rank gets a bit-identical result.

    Each rank's callable must be called by exactly one thread, the same number of times on every
    rank. :meth:`abort` releases ranks blocked in a call (they raise ``BrokenBarrierError``).
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def for_rank(self, rank: int) -> AllReduce:
        """The ``all_reduce`` callable for TP rank ``rank``."""

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = tensor
            self._barrier.wait()  # every rank has deposited
            parts = [part for part in self._slots if part is not None]
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            self._barrier.wait()  # every rank has read before any deposits again
            return total

        return all_reduce

    def abort(self) -> None:
        """Break the barrier so blocked ranks stop waiting."""
        self._barrier.abort()

    def reset(self) -> None:
        """Make the reducer usable again after :meth:`abort`."""
        self._barrier.reset()
        self._slots = [None] * len(self._slots)


class LocalShardGroup:
    """The shards of ``layout`` loaded from ``directory``, each with its own paged KV cache of
    ``num_blocks`` blocks of ``block_size`` tokens.

    :meth:`step` runs one forward step across all of them and returns the last stage's logits.
    All TP ranks of the last stage compute the logits; a rank that disagrees with rank 0 is a
    sharding bug and raises ``RuntimeError``. Use as a context manager (or call :meth:`close`)
    to stop the threads.
    """

    def __init__(
        self,
        directory: str | Path,
        layout: EngineLayout,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layout = layout
        self.block_size = block_size
        self.stages: list[list[LlamaShard]] = []
        self.caches: list[list[PagedKVCache]] = []
        self._reducers: list[ThreadAllReduce] = []
        for pp_rank in range(layout.pp_size):
            reducer = ThreadAllReduce(layout.tp_size)
            shards = [
                load_model(
                    directory,
                    ShardSpec.from_layout(layout, pp_rank, tp_rank),
                    all_reduce=reducer.for_rank(tp_rank) if layout.tp_size > 1 else None,
                    dtype=dtype,
                )
                for tp_rank in range(layout.tp_size)
            ]
            self._reducers.append(reducer)
            self.stages.append(shards)
            self.caches.append(
                [shard.allocate_kv_cache(num_blocks, block_size) for shard in shards]
            )
        self._pool = ThreadPoolExecutor(max_workers=layout.tp_size, thread_name_prefix="tp-rank")

    def step(self, chunks: Sequence[SequenceChunk], *, all_tokens: bool = False) -> torch.Tensor:
        """Run one step; returns ``[S, vocab]`` logits of each sequence's last new token, or
        ``[T, vocab]`` for every new token with ``all_tokens``."""
        batch = ForwardBatch.build(chunks, self.block_size)
        hidden: torch.Tensor | None = None
        for pp_rank in range(len(self.stages)):
            # TP ranks of a stage agree bit for bit (see ThreadAllReduce); pass rank 0's on.
            hidden = self._run_stage(pp_rank, batch, hidden)[0]
        assert hidden is not None  # at least one stage
        indices = None if all_tokens else batch.last_token_indices
        last = self.stages[-1]
        logits = [shard.compute_logits(hidden, indices) for shard in last]
        if any(not torch.equal(other, logits[0]) for other in logits[1:]):
            raise RuntimeError("TP ranks of the last stage computed different logits")
        return logits[0]

    def close(self) -> None:
        """Stop the TP threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LocalShardGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _run_stage(
        self, pp_rank: int, batch: ForwardBatch, hidden: torch.Tensor | None
    ) -> list[torch.Tensor]:
        shards, caches = self.stages[pp_rank], self.caches[pp_rank]
        if len(shards) == 1:
            return [shards[0](batch, caches[0], hidden)]
        futures: list[Future[torch.Tensor]] = [
            self._pool.submit(shard.forward, batch, cache, hidden)
            for shard, cache in zip(shards, caches, strict=True)
        ]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            # One rank failed: the others may be blocked in an all-reduce that will never fill.
            self._reducers[pp_rank].abort()
            wait(futures)
            self._reducers[pp_rank].reset()
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, threading.BrokenBarrierError):
                raise error
        return [future.result() for future in futures]
