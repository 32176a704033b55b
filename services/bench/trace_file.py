"""A request trace in Mooncake's FAST'25 format, its prompts, and what its reuse allows.

The format (the public ``mooncake_trace.jsonl``, ``conversation_trace.jsonl`` ...): one JSON
object a line, ``timestamp`` (ms since the trace's start), ``input_length`` and
``output_length`` (tokens), ``hash_ids``: one id per ``block_tokens``-token block of the prompt
(512 in Mooncake's files; the last block may be partial), equal ids meaning equal blocks, and a
block's id standing for its whole prefix (an id appears after the same ids each time).

Prompts are token ids: block ``h`` is ``block_tokens`` ids drawn from a generator seeded with
``h`` (so equal ids give equal blocks, in every process), cut to ``input_length``.

Two references the bench puts beside the engines' cached tokens, both over full engine blocks
and never a prompt's last token (an engine computes it for its logits):

- :func:`reusable_tokens`, the **ceiling**: a cache that never evicts, shared by every engine:
  each request's leading blocks that an earlier request had;
- :class:`CapacityOracle`, the **offline oracle**: as many LRU caches as prefill engines, each
  of an engine's capacity, every request sent to the cache holding its longest prefix (ties:
  the cache that got the fewest prompt tokens so far), which then holds the request's blocks.
  Greedy with hindsight of every cache, not an optimum; what placement from KV events can
  approach.

Bad lines (not JSON, fields missing or of the wrong type, negative lengths, ``hash_ids`` not
covering the prompt, a prompt with no room for a token within the model's context) are skipped
and counted, the first one named; a file that cannot be read raises :class:`TraceError`.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_TOKENS = 512
"""Mooncake's block size (tokens per hash id)."""


class TraceError(Exception):
    """The trace cannot be read at all (missing, unreadable, no valid line)."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class Trace:
    requests: list[TraceRequest]
    lines: int = 0
    skipped: int = 0
    first_skipped: str | None = None
    """``line N: why`` of the first line skipped."""


def read_trace(
    path: Path, *, max_model_len: int, block_tokens: int = BLOCK_TOKENS, limit: int | None = None
) -> Trace:
    """The valid requests of ``path`` in timestamp order (at most ``limit``, the first ones by
    line); :class:`TraceError` when it cannot be read or holds no valid request."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from exc
    trace = Trace([])
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if limit is not None and len(trace.requests) >= limit:
            break
        trace.lines += 1
        try:
            trace.requests.append(_request(line, max_model_len, block_tokens))
        except ValueError as exc:
            trace.skipped += 1
            if trace.first_skipped is None:
                trace.first_skipped = f"line {number}: {exc}"
    if not trace.requests:
        why = f" (first: {trace.first_skipped})" if trace.first_skipped else ""
        raise TraceError(f"no valid request in the trace {path}{why}")
    trace.requests.sort(key=lambda request: request.timestamp_ms)
    return trace


def _request(line: str, max_model_len: int, block_tokens: int) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in record:
            raise ValueError(f"no {name}")
    timestamp, length, output, ids = (
        record["timestamp"],
        record["input_length"],
        record["output_length"],
        record["hash_ids"],
    )
    if not _number(timestamp) or timestamp < 0:
        raise ValueError(f"timestamp {timestamp!r} is not a number >= 0")
    for name, value in (("input_length", length), ("output_length", output)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} {value!r} is not an integer >= 0")
    if length < 1:
        raise ValueError("input_length 0: an empty prompt")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError("hash_ids is not a list of integers")
    if len(ids) != math.ceil(length / block_tokens):
        raise ValueError(
            f"{len(ids)} hash_ids for {length} tokens (blocks of {block_tokens}: "
            f"{math.ceil(length / block_tokens)})"
        )
    if length >= max_model_len:
        raise ValueError(f"input_length {length} leaves no room within the context {max_model_len}")
    return TraceRequest(float(timestamp), length, output, tuple(ids))


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Prompts:
    """Token ids of trace requests (blocks made once per hash id, kept)."""

    def __init__(self, vocab_size: int, block_tokens: int = BLOCK_TOKENS) -> None:
        # Clear of the low ids (a checkpoint's special tokens) and of the top of the range.
        self._range = (16, max(32, vocab_size - 16))
        self._block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}

    def prompt(self, request: TraceRequest) -> list[int]:
        tokens: list[int] = []
        for hash_id in request.hash_ids:
            tokens += self._block(hash_id)
        return tokens[: request.input_length]

    def _block(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = random.Random(hash_id)
            low, high = self._range
            block = [rng.randrange(low, high) for _ in range(self._block_tokens)]
            self._blocks[hash_id] = block
        return block


def cacheable_tokens(
    request: TraceRequest, blocks: int, engine_block: int, block_tokens: int
) -> int:
    """Tokens an engine can find cached when the first ``blocks`` trace blocks are held: full
    engine blocks, never the prompt's last token."""
    tokens = min(blocks * block_tokens, request.input_length - 1)
    return tokens // engine_block * engine_block


def reusable_tokens(
    requests: Sequence[TraceRequest], *, engine_block: int, block_tokens: int = BLOCK_TOKENS
) -> list[int]:
    """Per request, the ceiling's tokens (see the module docstring): the leading blocks an
    earlier request had (full trace blocks only)."""
    seen: set[int] = set()
    reusable: list[int] = []
    for request in requests:
        found = _leading(request.hash_ids[: request.input_length // block_tokens], seen)
        reusable.append(cacheable_tokens(request, found, engine_block, block_tokens))
        seen.update(request.hash_ids[: request.input_length // block_tokens])
    return reusable


def _leading(ids: Sequence[int], held: set[int] | OrderedDict[int, None]) -> int:
    count = 0
    for hash_id in ids:
        if hash_id not in held:
            break
        count += 1
    return count


@dataclass
class _Cache:
    capacity: int
    """Trace blocks it holds at most."""
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    tokens_sent: int = 0


class CapacityOracle:
    """See the module docstring. ``capacity_tokens``: one engine's KV capacity."""

    def __init__(
        self,
        engines: int,
        capacity_tokens: int,
        *,
        engine_block: int,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        capacity = max(1, capacity_tokens // block_tokens)
        self._caches = [_Cache(capacity) for _ in range(engines)]
        self._engine_block = engine_block
        self._block_tokens = block_tokens

    def send(self, request: TraceRequest) -> int:
        """Route ``request``; the tokens it finds cached there."""
        full = request.hash_ids[: request.input_length // self._block_tokens]
        best = max(
            self._caches, key=lambda cache: (_leading(full, cache.blocks), -cache.tokens_sent)
        )
        found = _leading(full, best.blocks)
        best.tokens_sent += request.input_length
        # Used now, the head most recently (as an engine frees a request's tail first).
        for hash_id in reversed(full):
            best.blocks[hash_id] = None
            best.blocks.move_to_end(hash_id)
        while len(best.blocks) > best.capacity:
            best.blocks.popitem(last=False)
        return cacheable_tokens(request, found, self._engine_block, self._block_tokens)


def oracle_tokens(
    requests: Sequence[TraceRequest],
    engines: int,
    capacity_tokens: int,
    *,
    engine_block: int,
    block_tokens: int = BLOCK_TOKENS,
) -> list[int]:
    """Per request, the offline oracle's cached tokens over a fleet of ``engines``."""
    oracle = CapacityOracle(
        engines, capacity_tokens, engine_block=engine_block, block_tokens=block_tokens
    )
    return [oracle.send(request) for request in requests]
