"""pdserve's KV-event subscriber against vLLM's real ``ZmqEventPublisher`` (PUB + ROUTER replay,
on 127.0.0.1 ports): in-order delivery, replay of what was published before the subscription
and during an outage, a gap past the replay buffer, malformed payloads, a dead or hung
publisher. vLLM is imported here only (the subscriber speaks its wire format without it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from services.kv_events.events import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from services.kv_events.subscriber import EventSubscriber
from tests.integration.kv_events.harness import (
    Proxy,
    Publisher,
    RecordingSink,
    bound_port,
    wait_until,
)

pytestmark = pytest.mark.integration

kv_events = pytest.importorskip("vllm.distributed.kv_events")


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.shutdown()


def subscriber(
    endpoint: str, replay: str, sink: RecordingSink, ctx: zmq.asyncio.Context, **kw: Any
) -> EventSubscriber:
    sub = EventSubscriber(endpoint, replay, sink, context=ctx, replay_timeout_s=10.0, **kw)
    sub.start()
    return sub


async def test_batches_before_and_after_the_subscription_arrive_in_order_once(
    publisher: Publisher, context: zmq.asyncio.Context
) -> None:
    publisher.stored(3)
    await asyncio.sleep(0.3)  # published before anyone subscribed: only the replay has them
    sink = RecordingSink()
    sub = subscriber(publisher.endpoint, publisher.replay_endpoint, sink, context)
    try:
        await wait_until(lambda: len(sink.applied) == 3, "the replayed batches")
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        publisher.stored(4)
        await wait_until(lambda: len(sink.applied) == 7, "the published batches")
        await asyncio.sleep(0.3)
        assert sink.seqs == list(range(7))
        stores = [batch.events[0] for _, batch in sink.applied]
        assert all(isinstance(event, BlockStored) for event in stores)
        assert [event.block_hashes for event in stores] == [(i,) for i in range(7)]
        assert stores[5].token_ids == (5, 5, 5, 5)
        assert sink.events("stale") == []
        assert sub.replays == 1
    finally:
        await sub.close()


async def test_an_outage_is_replayed_once_the_publisher_is_reachable_again(
    publisher: Publisher, context: zmq.asyncio.Context
) -> None:
    proxy = Proxy(publisher.port)
    await proxy.restore()
    sink = RecordingSink()
    sub = subscriber(f"tcp://127.0.0.1:{proxy.port}", publisher.replay_endpoint, sink, context)
    try:
        await asyncio.sleep(0.5)
        publisher.stored(2)
        await wait_until(lambda: len(sink.applied) == 2, "the first batches")
        await proxy.cut()
        await wait_until(lambda: sink.events("stale") != [], "the disconnect")
        assert sink.events("stale") == [("stale", "disconnected", False)]
        publisher.stored(3)  # missed by the subscription
        await asyncio.sleep(0.3)
        await proxy.restore()
        await wait_until(lambda: sink.events("resumed") != [], "the reconnect's replay")
        await wait_until(lambda: len(sink.applied) == 5, "the missed batches")
        publisher.stored(1)
        await wait_until(lambda: len(sink.applied) == 6, "the next batch")
        assert sink.seqs == list(range(6))
        assert sink.events("stale") == [("stale", "disconnected", False)]
    finally:
        await sub.close()
        await proxy.close()


async def test_a_gap_past_the_replay_buffer_is_a_lost_stream_then_goes_on(
    context: zmq.asyncio.Context,
) -> None:
    publisher = Publisher(buffer_steps=2)
    proxy = Proxy(publisher.port)
    await proxy.restore()
    sink = RecordingSink()
    sub = subscriber(f"tcp://127.0.0.1:{proxy.port}", publisher.replay_endpoint, sink, context)
    try:
        await asyncio.sleep(0.5)
        publisher.stored(2)
        await wait_until(lambda: len(sink.applied) == 2, "the first batches")
        await proxy.cut()
        await wait_until(lambda: sink.events("stale") != [], "the disconnect")
        publisher.stored(5)  # seq 2..6; the replay buffer keeps only 5 and 6
        await asyncio.sleep(0.5)
        await proxy.restore()
        await wait_until(lambda: 6 in sink.seqs, "the batches after the gap")
        assert ("stale", "gap", True) in sink.log
        assert sink.seqs == [0, 1, 5, 6]
        # Lost, then the stream goes on: resumed after the first batch past the gap.
        lost_at = sink.log.index(("stale", "gap", True))
        assert ("resumed",) in sink.log[lost_at:]
    finally:
        await sub.close()
        await proxy.close()
        publisher.shutdown()


async def test_a_replay_longer_than_the_replay_queue_comes_whole_in_rounds(
    publisher: Publisher, context: zmq.asyncio.Context
) -> None:
    """vLLM's ROUTER sends its buffer at once and drops what the connection cannot take; the
    subscriber's replay queue holds only REPLAY_RCVHWM messages, so it asks again from the
    next batch until the end marker: every batch once, in order, no loss."""
    publisher.stored(5000)
    await asyncio.sleep(0.5)
    sink = RecordingSink()
    sub = subscriber(publisher.endpoint, publisher.replay_endpoint, sink, context)
    try:
        await wait_until(lambda: len(sink.applied) == 5000, "the replayed batches", 120.0)
        await asyncio.sleep(0.3)
        assert sink.seqs == list(range(5000))
        assert sink.events("stale") == []
        assert sink.drops == []
    finally:
        await sub.close()


async def test_malformed_payloads_are_counted_and_the_stream_goes_on(
    publisher: Publisher, context: zmq.asyncio.Context
) -> None:
    sink = RecordingSink()
    sub = subscriber(publisher.endpoint, publisher.replay_endpoint, sink, context)
    try:
        await asyncio.sleep(0.5)
        publisher.stored(1)
        # vLLM encodes it, but 2 blocks of 4 cannot hold 5 tokens.
        publisher.raw(
            [
                kv_events.BlockStored(
                    block_hashes=[1, 2],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4, 5],
                    block_size=4,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                )
            ]
        )
        publisher.raw([kv_events.BlockRemoved(block_hashes=[0], medium=None)])
        await wait_until(lambda: len(sink.applied) == 2, "the valid batches")
        assert sink.drops == ["schema"]
        assert sink.seqs == [0, 2]
        assert isinstance(sink.applied[1][1].events[0], BlockRemoved)
    finally:
        await sub.close()


async def test_hostile_frames_are_dropped_by_reason(context: zmq.asyncio.Context) -> None:
    """A publisher that is not vLLM: wrong frame counts, short sequence numbers, garbage and
    oversized payloads."""
    pub = context.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    port = bound_port(pub)
    sink = RecordingSink()
    sub = subscriber(f"tcp://127.0.0.1:{port}", "", sink, context)
    try:
        await asyncio.sleep(0.5)
        seq = (0).to_bytes(8, "big")
        await pub.send_multipart([b"", seq])
        await pub.send_multipart([b"", b"\x00", b"x"])
        await pub.send_multipart([b"", seq, b"\xc1"])  # msgpack's never-used byte
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\x90" * (MAX_PAYLOAD_BYTES + 1)])
        await wait_until(lambda: len(sink.drops) == 4, "four drops")
        assert sink.drops == ["frames", "seq", "malformed", "oversized"]
        assert sink.applied == []
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_a_dead_publisher_makes_the_engine_stale(context: zmq.asyncio.Context) -> None:
    publisher = Publisher()
    sink = RecordingSink()
    sub = subscriber(publisher.endpoint, publisher.replay_endpoint, sink, context)
    try:
        await asyncio.sleep(0.5)
        publisher.stored(1)
        await wait_until(lambda: len(sink.applied) == 1, "a batch")
        publisher.shutdown()
        await wait_until(lambda: sink.events("stale") != [], "staleness")
        assert sink.events("stale") == [("stale", "disconnected", False)]
    finally:
        await sub.close()


async def test_a_hung_publisher_is_stale_after_the_heartbeat_timeout(
    publisher: Publisher, context: zmq.asyncio.Context
) -> None:
    proxy = Proxy(publisher.port)
    await proxy.restore()
    sink = RecordingSink()
    sub = subscriber(
        f"tcp://127.0.0.1:{proxy.port}", publisher.replay_endpoint, sink, context, heartbeat_s=0.2
    )
    try:
        await asyncio.sleep(0.5)
        publisher.stored(1)
        await wait_until(lambda: len(sink.applied) == 1, "a batch")
        proxy.freeze()  # connected, but no byte (nor heartbeat) goes through
        await wait_until(lambda: sink.events("stale") != [], "staleness")
        assert sink.events("stale") == [("stale", "disconnected", False)]
    finally:
        await sub.close()
        await proxy.close()


async def test_an_endpoint_libzmq_cannot_parse_is_a_stale_engine_not_a_crash(
    context: zmq.asyncio.Context,
) -> None:
    sink = RecordingSink()
    sub = subscriber("tcp://no-port", "", sink, context)
    try:
        await wait_until(lambda: sink.events("stale") != [], "staleness")
        assert sink.events("stale") == [("stale", "endpoint", True)]
    finally:
        await sub.close()


async def test_without_a_replay_endpoint_a_gap_is_a_lost_stream(
    context: zmq.asyncio.Context,
) -> None:
    """A raw PUB with no replay endpoint: the first batch read starts the stream (seq 3: no
    loss, nothing was known), a jump is a loss, the batch after it resumes."""
    pub = context.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    port = bound_port(pub)
    sink = RecordingSink()
    sub = subscriber(f"tcp://127.0.0.1:{port}", "", sink, context)
    payload = encode_batch(EventBatch(0.0, (AllBlocksCleared(),)))
    try:
        await asyncio.sleep(0.5)
        for seq in (3, 4, 9, 10):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        await wait_until(lambda: len(sink.applied) == 4, "four batches")
        assert sink.seqs == [3, 4, 9, 10]
        assert sink.events("stale") == [("stale", "no_replay", True)]
        assert sink.log.index(("stale", "no_replay", True)) == 2  # before batch 9
        assert sink.log[3:5] == [("apply", 9), ("resumed",)]
    finally:
        await sub.close()
        pub.close(linger=0)
