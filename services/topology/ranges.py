"""Half-open ranges and the PP x TP cut of a model's layers and KV heads.

Conventions (the same as vLLM's):

- PP stage ``p`` owns a contiguous global layer range; the stages tile ``[0, num_layers)`` in
  order. Splits may be uneven (7 layers over 3 stages is ``[0,3) [3,5) [5,7)`` by default, or any
  explicit partition).
- TP rank ``t`` of a stage owns a contiguous KV-head range. When ``tp_size <= num_kv_heads`` the
  ranks tile ``[0, num_kv_heads)`` in order (``num_kv_heads % tp_size == 0``). When
  ``tp_size > num_kv_heads`` each rank holds exactly one head, replicated over
  ``tp_size // num_kv_heads`` consecutive ranks (``tp_size % num_kv_heads == 0``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.topology.errors import LayoutError

RankKey = tuple[int, int]
"""``(pp_rank, tp_rank)``."""


@dataclass(frozen=True, order=True)
class Range:
    """The half-open integer interval ``[start, stop)``; never negative, possibly empty."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.stop < self.start:
            raise LayoutError(f"invalid range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __contains__(self, item: object) -> bool:
        return isinstance(item, int) and self.start <= item < self.stop

    def __str__(self) -> str:
        return f"[{self.start},{self.stop})"

    def intersect(self, other: Range) -> Range | None:
        """The overlap of two ranges, or ``None`` when it is empty."""
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return Range(lo, hi) if lo < hi else None

    def shift(self, offset: int) -> Range:
        """This range moved by ``-offset``: global indices to indices local to a shard."""
        return Range(self.start - offset, self.stop - offset)


@dataclass(frozen=True)
class WorkerShard:
    """What one ``(pp_rank, tp_rank)`` worker owns: a global layer range and a KV-head range."""

    layers: Range
    kv_heads: Range


def split_layers(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[Range, ...]:
    """Layer ranges of the ``pp_size`` stages, in stage order.

    ``partition`` gives the number of layers per stage explicitly (vLLM's
    ``VLLM_PP_LAYER_PARTITION``); by default the first ``num_layers % pp_size`` stages get one
    layer more. Raises :class:`LayoutError` when a stage would be empty or the partition does
    not sum to ``num_layers``.
    """
    if pp_size < 1:
        raise LayoutError(f"pp_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise LayoutError(f"cannot split {num_layers} layers over {pp_size} PP stages")
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if stage < extra else 0) for stage in range(pp_size)]
    else:
        sizes = list(partition)
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise LayoutError(
                f"layer partition {sizes} must have {pp_size} positive parts summing to "
                f"{num_layers}"
            )
    ranges: list[Range] = []
    start = 0
    for size in sizes:
        ranges.append(Range(start, start + size))
        start += size
    return tuple(ranges)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> Range:
    """The KV heads TP rank ``tp_rank`` holds (see the module docstring for replication)."""
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if num_kv_heads < 1:
        raise LayoutError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not divide over TP={tp_size}")
        per_rank = num_kv_heads // tp_size
        return Range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP={tp_size} is not a multiple of {num_kv_heads} KV heads")
    head = tp_rank // (tp_size // num_kv_heads)
    return Range(head, head + 1)


@dataclass(frozen=True)
class EngineLayout:
    """The PP x TP cut of one engine: every worker's shard, keyed by ``(pp_rank, tp_rank)``."""

    num_layers: int
    num_kv_heads: int
    pp_size: int
    tp_size: int
    shards: Mapping[RankKey, WorkerShard]

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_kv_heads: int,
        pp_size: int,
        tp_size: int,
        layer_partition: Sequence[int] | None = None,
    ) -> EngineLayout:
        """The standard layout: :func:`split_layers` stages, :func:`kv_head_range` ranks."""
        stages = split_layers(num_layers, pp_size, layer_partition)
        shards = {
            (pp, tp): WorkerShard(stages[pp], kv_head_range(num_kv_heads, tp_size, tp))
            for pp in range(pp_size)
            for tp in range(tp_size)
        }
        return cls(num_layers, num_kv_heads, pp_size, tp_size, shards)

    def stage_layers(self, pp_rank: int) -> Range:
        """The layer range of PP stage ``pp_rank`` (the same on every TP rank of a valid layout)."""
        return self.shards[(pp_rank, 0)].layers
