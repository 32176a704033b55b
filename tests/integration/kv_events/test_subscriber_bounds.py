"""What one hostile engine can make a router's KV-event subscriber hold and compute: a frame
over libzmq's MAXMSGSIZE, a flood past the per-engine budget, large payloads decoded off the
loop. A raw ZMQ PUB socket plays the engine (no vLLM); the loop's responsiveness is measured by
events (a ticker task's count between two messages), never by wall-clock time."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from services.kv_events.events import BlockStored, EventBatch, encode_batch
from services.kv_events.subscriber import (
    INLINE_DECODE_BYTES,
    MAX_FRAME_BYTES,
    MESSAGE_COST_BYTES,
    EventSubscriber,
)
from tests.integration.kv_events.harness import RecordingSink, bound_port, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def batch(i: int, blocks: int = 1) -> bytes:
    """Batch ``i``: ``blocks`` blocks of 16 tokens whose ids take 5 bytes each in msgpack."""
    tokens = tuple(100_000 + i for _ in range(16 * blocks))
    hashes = tuple(i * 1_000_000 + b for b in range(blocks))
    return encode_batch(EventBatch(0.0, (BlockStored(hashes, None, tokens, 16),)))


async def test_a_frame_over_the_transport_bound_is_a_counted_disconnect_then_the_stream_goes_on(
    context: zmq.asyncio.Context,
) -> None:
    pub = context.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    port = bound_port(pub)
    sink = RecordingSink()
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", "", sink, context=context)
    sub.start()
    try:
        await asyncio.sleep(0.5)
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), batch(0)])
        await wait_until(lambda: sink.seqs == [0], "the first batch")
        # libzmq closes the connection unread: nothing of the frame is queued or decoded.
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\x90" * (MAX_FRAME_BYTES + 1)])
        await wait_until(lambda: sink.events("stale") != [], "the disconnect")
        assert sink.events("stale")[0] == ("stale", "disconnected", False)
        seq = 2
        while not any(s >= 2 for s in sink.seqs):  # the reconnect takes a moment: keep going
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(seq)])
            seq += 1
            await asyncio.sleep(0.05)
        assert 1 not in sink.seqs
        # No replay endpoint: the reconnect's missed batches are a loss, then it resumes.
        assert ("stale", "no_replay", True) in sink.log
        assert sink.log[-1] == ("resumed",) or ("resumed",) in sink.log
        assert sink.drops == []
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_a_flooding_engine_is_dropped_and_stale_while_the_loop_keeps_running(
    context: zmq.asyncio.Context,
) -> None:
    """Payloads above INLINE_DECODE_BYTES (decoded in a thread) past a small budget: counted
    ``flood`` drops, one ``stale("flood", lost=True)``, and the loop runs other tasks between
    any two messages."""
    payload_of = [batch(i, blocks=900) for i in range(2)]
    size = len(payload_of[0])
    assert size > INLINE_DECODE_BYTES
    burst = 4 * (size + MESSAGE_COST_BYTES)  # four batches, then the budget is spent
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    port = bound_port(pub)
    ticks = 0
    seen: list[int] = []  # the ticker's count at every message the sink heard of

    class TickingSink(RecordingSink):
        def apply(self, seq: int, batch: EventBatch) -> None:
            seen.append(ticks)
            super().apply(seq, batch)

        def dropped(self, reason: str) -> None:
            seen.append(ticks)
            super().dropped(reason)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    sink = TickingSink()
    # 1 byte/s: once over, nothing refills within the test.
    sub = EventSubscriber(
        f"tcp://127.0.0.1:{port}", "", sink, context=context, max_bytes_per_s=1, burst_bytes=burst
    )
    sub.start()
    tick_task = asyncio.get_running_loop().create_task(ticker())
    try:
        await asyncio.sleep(0.5)
        sent = 40
        for seq in range(sent):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload_of[seq % 2]])
        await wait_until(lambda: len(sink.applied) + len(sink.drops) >= 20, "the flood")
        # At most the burst's four (the first ones may race the subscription).
        assert 1 <= len(sink.applied) <= 4, (sink.seqs, sink.log[:8])
        assert sink.seqs == sorted(sink.seqs)
        assert set(sink.drops) == {"flood"}
        assert sink.events("stale").count(("stale", "flood", True)) == 1
        assert ("resumed",) not in sink.log
        # The loop ran the ticker between every two messages (each decode or drop yields).
        assert all(b > a for a, b in itertools.pairwise(seen)), len(seen)
    finally:
        tick_task.cancel()
        await sub.close()
        pub.close(linger=0)


async def test_the_budget_refills_and_the_stream_resumes(context: zmq.asyncio.Context) -> None:
    pub = context.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    port = bound_port(pub)
    sink = RecordingSink()
    one = len(batch(0)) + MESSAGE_COST_BYTES
    sub = EventSubscriber(
        f"tcp://127.0.0.1:{port}",
        "",
        sink,
        context=context,
        max_bytes_per_s=20 * one,
        burst_bytes=2 * one,
    )
    sub.start()
    try:
        await asyncio.sleep(0.5)
        for seq in range(20):  # far faster than 20 a second: some are over the budget
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(seq)])
        await wait_until(lambda: "flood" in sink.drops, "a flood drop")
        seq = 20
        while ("resumed",) not in sink.log:  # then at a pace the budget covers
            await asyncio.sleep(0.2)
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(seq)])
            seq += 1
        assert ("stale", "flood", True) in sink.log
        assert sink.seqs == sorted(sink.seqs)
    finally:
        await sub.close()
        pub.close(linger=0)
