"""The KV-event publisher against real ZMQ sockets: vLLM's frames (topic, seq, payload) in order
from 0, payloads both decoders read, the replay endpoint and its bound, and a full queue that
drops (counted, sequence numbers skipped) instead of blocking the engine."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from services.kv_events.endpoints import advertised
from services.kv_events.events import (
    END_OF_REPLAY_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)
from services.kv_events.publisher import KVEventPublisher, PublisherMetrics
from services.lifetime import ports_to_bind_later

WAIT_MS = 10_000

STORED = BlockStored(
    block_hashes=(-7, 11),
    parent_block_hash=3,
    token_ids=tuple(range(8)),
    block_size=4,
)
REMOVED = BlockRemoved(block_hashes=(-7,))


class _Context(zmq.Context):  # type: ignore[type-arg]
    """Closes every socket it made when the test ends (an unclosed one warns when collected)."""

    made: list[zmq.Socket[bytes]]

    def socket(self, *args: object, **kwargs: object) -> zmq.Socket[bytes]:  # type: ignore[override]
        sock: zmq.Socket[bytes] = super().socket(*args, **kwargs)  # type: ignore[arg-type]
        self.made.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context = _Context()
    context.made = []
    yield context
    for sock in context.made:
        sock.close(0)
    context.term()


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(bind_host="127.0.0.1", topic="kv", metrics=PublisherMetrics())
    yield pub
    pub.close()


def subscribe(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher
) -> zmq.Socket[bytes]:
    """A SUB that receives everything published from now on: ZMQ's slow joiner is waited out
    by publishing probes (AllBlocksCleared) until one arrives, then the rest are drained."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoints.events)
    deadline = time.monotonic() + WAIT_MS / 1000
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the SUB never connected"
        publisher.publish([AllBlocksCleared()])
    probes = publisher.next_seq
    while True:
        _, seq, _ = sub.recv_multipart()
        if int.from_bytes(seq, "big") == probes - 1:
            return sub
        assert sub.poll(WAIT_MS)


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, bytes]:
    assert sub.poll(WAIT_MS), "no frame"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big", signed=True), payload


def test_batches_arrive_in_order_with_consecutive_sequence_numbers(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher
) -> None:
    sub = subscribe(ctx, publisher)
    first = publisher.next_seq
    assert publisher.publish([STORED], ts=1.5)
    assert publisher.publish([REMOVED, AllBlocksCleared()], ts=2.5)
    frames = [receive(sub), receive(sub)]
    assert [(topic, seq) for topic, seq, _ in frames] == [(b"kv", first), (b"kv", first + 1)]
    assert decode_batch(frames[0][2]) == EventBatch(1.5, (STORED,))
    assert decode_batch(frames[1][2]) == EventBatch(2.5, (REMOVED, AllBlocksCleared()))
    assert publisher.metrics.value("pdserve_kv_events_publisher_events_total", type="BlockStored")


def test_sequence_numbers_start_at_zero() -> None:
    pub = KVEventPublisher(bind_host="127.0.0.1")
    try:
        assert pub.next_seq == 0
        pub.publish([STORED])
        assert pub.next_seq == 1
    finally:
        pub.close()


@pytest.mark.slow  # imports vLLM: about 10 s of CPU
def test_vllms_own_decoder_reads_the_payload(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher
) -> None:
    msgspec = importlib.import_module("msgspec")
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    sub = subscribe(ctx, publisher)
    publisher.publish([STORED, REMOVED, AllBlocksCleared()], ts=4.0)
    _, _, payload = receive(sub)
    batch = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
    stored, removed, cleared = batch.events
    assert batch.ts == 4.0
    assert isinstance(stored, kv_events.BlockStored)
    assert stored.block_hashes == [-7, 11] and stored.parent_block_hash == 3
    assert stored.token_ids == list(range(8)) and stored.block_size == 4
    assert isinstance(removed, kv_events.BlockRemoved) and removed.block_hashes == [-7]
    assert isinstance(cleared, kv_events.AllBlocksCleared)


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[tuple[bytes, int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    frames: list[tuple[bytes, int, bytes]] = []
    try:
        while True:
            assert dealer.poll(WAIT_MS), "the replay did not end"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            number = int.from_bytes(seq, "big", signed=True)
            if number == END_OF_REPLAY_SEQ:
                assert (topic, payload) == (b"", b"")
                return frames
            frames.append((topic, number, payload))
    finally:
        dealer.close(0)


def wait_sent(publisher: KVEventPublisher, batches: int) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while publisher.metrics.value("pdserve_kv_events_publisher_batches_total") < batches:
        assert time.monotonic() < deadline, "the publisher did not send"
        time.sleep(0.01)


def test_replay_returns_the_buffered_batches_from_a_sequence_number_then_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub = KVEventPublisher(bind_host="127.0.0.1", topic="kv", buffer_steps=3)
    try:
        for ts in range(5):
            pub.publish([STORED], ts=float(ts))
        wait_sent(pub, 5)
        frames = replay(ctx, pub.endpoints.replay, 3)
        assert [(topic, seq) for topic, seq, _ in frames] == [(b"kv", 3), (b"kv", 4)]
        assert decode_batch(frames[0][2]).ts == 3.0
        # The buffer keeps the last 3 batches: from 0 the replay starts at 2 (a visible gap).
        assert [seq for _, seq, _ in replay(ctx, pub.endpoints.replay, 0)] == [2, 3, 4]
        assert replay(ctx, pub.endpoints.replay, 9) == []
        assert pub.metrics.value("pdserve_kv_events_publisher_replays_total", outcome="served") == 3
    finally:
        pub.close()


def test_a_malformed_replay_request_is_counted_and_the_endpoint_keeps_serving(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher
) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.endpoints.replay)
    dealer.send_multipart((b"", b"\x01\x02"))  # not 8 bytes
    publisher.publish([STORED])
    wait_sent(publisher, 1)
    assert [seq for _, seq, _ in replay(ctx, publisher.endpoints.replay, 0)] == [0]
    assert (
        publisher.metrics.value("pdserve_kv_events_publisher_replays_total", outcome="malformed")
        == 1
    )
    dealer.close(0)


class _StalledPublisher(KVEventPublisher):
    """Its thread stops in its first send until released: the queue behind it fills."""

    def __init__(self, **kwargs: object) -> None:
        self.release = threading.Event()
        self.sending = threading.Event()
        super().__init__(**kwargs)  # type: ignore[arg-type]

    def _send(self, seq: int, batch: EventBatch) -> None:
        self.sending.set()
        assert self.release.wait(WAIT_MS / 1000)
        super()._send(seq, batch)


def test_a_full_queue_drops_and_counts_without_blocking_and_subscribers_see_the_gap(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub = _StalledPublisher(bind_host="127.0.0.1", max_queue=2)
    try:
        assert pub.publish([STORED])  # seq 0: the thread takes it and stalls
        assert pub.sending.wait(WAIT_MS / 1000)
        accepted = [pub.publish([STORED]) for _ in range(5)]  # seqs 1..5: 2 fit
        assert accepted == [True, True, False, False, False]
        assert pub.metrics.value("pdserve_kv_events_publisher_dropped_batches_total") == 3
        pub.release.set()
        wait_sent(pub, 3)
        # The dropped batches' numbers are spent: the next batch is 6, after a visible gap.
        assert pub.publish([REMOVED])
        wait_sent(pub, 4)
        assert [seq for _, seq, _ in replay(ctx, pub.endpoints.replay, 0)] == [0, 1, 2, 6]
    finally:
        pub.release.set()
        pub.close()


def test_close_sends_what_is_queued_then_refuses(
    ctx: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher
) -> None:
    sub = subscribe(ctx, publisher)
    publisher.publish([REMOVED], ts=7.0)
    publisher.close()
    _, _, payload = receive(sub)
    assert decode_batch(payload).ts == 7.0
    assert not publisher.publish([STORED])
    publisher.close()  # idempotent


def test_bound_endpoints_and_their_advertised_form() -> None:
    pub = KVEventPublisher()  # every interface
    try:
        assert pub.endpoints.events.startswith("tcp://*:")
        port = pub.endpoints.events.rpartition(":")[2]
        assert advertised(pub.endpoints.events, "engine-7") == f"tcp://engine-7:{port}"
    finally:
        pub.close()
    assert advertised("tcp://0.0.0.0:5", "::1") == "tcp://[::1]:5"
    assert advertised("tcp://10.0.0.2:5", "engine-7") == "tcp://10.0.0.2:5"
    first, second = ports_to_bind_later(2)
    assert first != second
