"""The KV-event types and their msgpack codec, as vLLM publishes them.

vLLM 0.32 (``vllm/distributed/kv_events.py``) sends an ``EventBatch`` as a msgpack array
``[ts, events, data_parallel_rank]`` whose events are msgspec tagged structs: a map with
``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`` and the fields by name.
Earlier vLLM versions encoded each event as an array, the tag first and the fields in
declaration order (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]``). :func:`decode_batch` reads both; :func:`encode_batch` writes
0.32's (what the reference engine publishes). A block hash is the engine's own value
(``int`` or ``bytes``: vLLM's ``ExternalBlockHash``), meaningful only to that engine: a
consumer keys blocks by their token ids and keeps the engine's hashes to apply removals.

Payloads come from engines the router does not trust: every size is bounded and every field
type-checked; anything else is an :class:`EventDecodeError` with a ``reason`` to count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

from services.codec import MsgpackBounds, UnpackError, unpack_bounded

EngineBlockHash: TypeAlias = int | bytes
"""An engine's hash of one block (vLLM's ``ExternalBlockHash``)."""

MAX_PAYLOAD_BYTES = 1 << 20
"""One batch's encoded size; larger payloads are refused unread. A vLLM step stores at most the
blocks of the tokens it computed or received: 128K tokens in 16-token blocks encode to about
0.7 MiB (a token id above 65,535 takes 5 bytes in msgpack, 640 KiB; 8,192 64-bit hashes take
9 bytes each, 72 KiB; measured 0.59 MiB for ids drawn from a 152K vocabulary), so 1 MiB holds
any step up to about 180K tokens while keeping what one engine can queue at the router small
(docs/kv-events.md, "Bounds of a subscription")."""
MAX_EVENTS_PER_BATCH = 4096
MAX_BLOCKS_PER_EVENT = 8192
MAX_TOKENS_PER_EVENT = MAX_BLOCKS_PER_EVENT * 64
MAX_HASH_BYTES = 64
END_OF_REPLAY_SEQ = -1
"""The sequence number of the replay endpoint's last frame (vLLM's ``END_SEQ``)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks entered the cache: ``block_hashes[i]`` holds ``token_ids[i * block_size :
    (i + 1) * block_size]``; the first block continues ``parent_block_hash`` (``None``: the
    prompt's first block)."""

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the cache (evicted)."""

    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (a reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one engine step, in order."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class EventDecodeError(ValueError):
    """A payload that is not a valid event batch; ``reason`` is a metric label."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode_batch(batch: EventBatch) -> bytes:
    """vLLM 0.32's encoding of ``batch`` (what ``msgspec.msgpack.Encoder`` writes for its
    ``KVEventBatch``)."""
    events: list[dict[str, Any]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(event.block_hashes),
                    "parent_block_hash": event.parent_block_hash,
                    "token_ids": list(event.token_ids),
                    "block_size": event.block_size,
                    "lora_id": None,
                    "medium": event.medium,
                    "lora_name": event.lora_name,
                }
            )
        elif isinstance(event, BlockRemoved):
            events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": list(event.block_hashes),
                    "medium": event.medium,
                }
            )
        else:
            events.append({"type": "AllBlocksCleared"})
    body: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


_BATCH_BOUNDS = MsgpackBounds(
    max_bytes=MAX_PAYLOAD_BYTES,
    max_str_len=1 << 16,
    max_bin_len=MAX_HASH_BYTES,
    max_array_len=MAX_TOKENS_PER_EVENT,
    max_map_len=32,
)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one batch in either encoding; raises :class:`EventDecodeError`."""
    try:
        body = unpack_bounded(payload, _BATCH_BOUNDS)
    except UnpackError as exc:
        raise EventDecodeError(f"event batch: {exc}", reason=exc.reason) from exc
    if isinstance(body, dict):  # a batch encoded as a map (not array_like)
        body = [body.get("ts"), body.get("events"), body.get("data_parallel_rank")]
    if not isinstance(body, list) or not 2 <= len(body) <= 3:
        raise EventDecodeError("event batch is not [ts, events, dp_rank]", reason="schema")
    ts, raw_events = body[0], body[1]
    rank = body[2] if len(body) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError("event batch ts is not a number", reason="schema")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise EventDecodeError("event batch data_parallel_rank is not an int", reason="schema")
    if not isinstance(raw_events, list):
        raise EventDecodeError("event batch events is not a list", reason="schema")
    if len(raw_events) > MAX_EVENTS_PER_BATCH:
        raise EventDecodeError(f"{len(raw_events)} events in one batch", reason="oversized")
    return EventBatch(float(ts), tuple(_decode_event(raw) for raw in raw_events), rank)


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # array_like: tag first
        tag: Any = raw[0]
        names = _ARRAY_FIELDS.get(tag)
        if names is None:
            raise EventDecodeError(f"unknown event type {tag!r}", reason="unknown_event")
        fields = dict(zip(names, raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if tag not in _ARRAY_FIELDS:
            raise EventDecodeError(f"unknown event type {tag!r}", reason="unknown_event")
        fields = raw
    else:
        message = "an event is neither a tagged map nor a tagged array"
        raise EventDecodeError(message, reason="schema")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields.get("block_hashes"))
    medium = _optional_str(fields.get("medium"), "medium")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = fields.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent)
    token_ids = fields.get("token_ids")
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids
    ):
        raise EventDecodeError("BlockStored token_ids is not a list of ids", reason="schema")
    block_size = fields.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise EventDecodeError("BlockStored block_size is not a positive int", reason="schema")
    if len(token_ids) != len(hashes) * block_size:
        raise EventDecodeError(
            f"BlockStored has {len(hashes)} blocks of {block_size} but {len(token_ids)} tokens",
            reason="schema",
        )
    lora_name = _optional_str(fields.get("lora_name"), "lora_name")
    return BlockStored(hashes, parent, tuple(token_ids), block_size, lora_name, medium)


def _hash(value: Any) -> EngineBlockHash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise EventDecodeError("a block hash is neither an int nor bytes", reason="schema")
    checked: EngineBlockHash = value
    return checked


def _hashes(value: Any) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise EventDecodeError("block_hashes is not a list", reason="schema")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise EventDecodeError(f"{len(value)} blocks in one event", reason="oversized")
    return tuple(_hash(item) for item in value)


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventDecodeError(f"{name} is not a string", reason="schema")
    return value
