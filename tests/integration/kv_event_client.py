"""A minimal KV-event client for tests: what a router does with an engine record's endpoints
(SUB from now on; the replay endpoint for what came before the SUB joined), decoded with
:func:`~services.kv_events.events.decode_batch`. Blocking: run it in a thread."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from services.control_plane.wire import EngineRecord
from services.kv_events.events import END_OF_REPLAY_SEQ, EventBatch, KVEvent, decode_batch

WAIT_MS = 60_000


class EventClient:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], record: EngineRecord) -> None:
        assert record.kv_events_endpoint and record.kv_events_replay_endpoint, record
        self._context = context
        self._record = record
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(record.kv_events_endpoint)
        self.batches: dict[int, EventBatch] = {}
        self.live: set[int] = set()
        """Sequence numbers that came over the SUB socket (not replayed)."""

    def receive_until(self, done: Callable[[list[KVEvent]], bool]) -> None:
        """Receive until ``done(events)`` holds (every batch so far, in sequence order); a SUB
        that joined after the first batches fetches them from the replay endpoint."""
        while not done(self.events()):
            assert self.sub.poll(WAIT_MS), f"no KV events in {WAIT_MS} ms: {self.events()}"
            _, seq, payload = self.sub.recv_multipart()
            number = int.from_bytes(seq, "big")
            self.batches[number] = decode_batch(payload)
            self.live.add(number)
            if min(self.batches) > 0:
                self.replay(0)

    def replay(self, start: int) -> None:
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(self._record.kv_events_replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert dealer.poll(WAIT_MS), "the replay did not end"
                _, _, seq, payload = dealer.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_OF_REPLAY_SEQ:
                    return
                self.batches.setdefault(number, decode_batch(payload))
        finally:
            dealer.close(0)

    def events(self) -> list[KVEvent]:
        return [event for seq in sorted(self.batches) for event in self.batches[seq].events]

    def close(self) -> None:
        self.sub.close(0)


def has(kind: type, count: int) -> Callable[[list[KVEvent]], bool]:
    """``receive_until``'s condition: at least ``count`` events of ``kind``."""
    return lambda events: sum(isinstance(e, kind) for e in events) >= count
