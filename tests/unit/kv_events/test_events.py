"""The codec's older encoding: vLLM versions before 0.32 sent each event as an array, the tag
first and the fields in declaration order (``array_like`` msgspec structs, trailing defaults
omitted); :func:`decode_batch` reads it as it reads 0.32's tagged maps."""

from __future__ import annotations

import msgpack
import pytest

from services.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
)

STORED = BlockStored((-7, b"\x01\x02"), 3, tuple(range(8)), 4, None, "GPU")
BATCH = EventBatch(2.5, (STORED, BlockRemoved((-7,), "GPU"), AllBlocksCleared()), 0)


def test_array_events_decode_as_the_map_encoding_does() -> None:
    array_events = [
        ["BlockStored", [-7, b"\x01\x02"], 3, list(range(8)), 4, None, "GPU", None],
        ["BlockRemoved", [-7], "GPU"],
        ["AllBlocksCleared"],
    ]
    payload = msgpack.packb([2.5, array_events, 0], use_bin_type=True)
    assert decode_batch(payload) == BATCH == decode_batch(encode_batch(BATCH))


def test_array_events_without_their_trailing_defaults() -> None:
    """An older BlockStored had no ``medium`` or ``lora_name``; ``omit_defaults`` drops them."""
    payload = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4]]])
    assert decode_batch(payload) == EventBatch(1.0, (BlockStored((5,), None, (1, 2, 3, 4), 4),))


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ([["BlockMoved", [1]]], "unknown_event"),
        ([["BlockStored", [1], None, [1, 2, 3], 4]], "schema"),  # 3 tokens in a block of 4
        ([["BlockRemoved", "not a list"]], "schema"),
        ([[1, 2]], "schema"),  # no tag
    ],
)
def test_bad_array_events_are_refused_by_reason(events: list[object], reason: str) -> None:
    with pytest.raises(EventDecodeError) as raised:
        decode_batch(msgpack.packb([1.0, events]))
    assert raised.value.reason == reason
