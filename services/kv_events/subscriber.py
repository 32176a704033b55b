"""One engine's KV-event stream, followed over ZMQ (asyncio; pyzmq's ``zmq.asyncio``).

The wire is vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``):

- a PUB socket sends every batch as three frames ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian counter from 0, ``payload`` msgpack (:func:`~services.kv_events.events.decode_batch`);
- an optional ROUTER replay endpoint keeps the last batches: a DEALER sends ``[b"", start_seq]``
  and receives ``[b"", topic, seq, payload]`` for every buffered ``seq >= start_seq``, then the
  end marker ``[b"", b"", -1, b""]``.

:class:`EventSubscriber` keeps the next sequence number it expects. On start and on every
reconnect it replays from there; a message past it (a gap: the SUB queue overflowed, or the
subscription raced the first batches) replays the missing ones; older or repeated ones are
dropped (``duplicate``). What it cannot get back is reported to the :class:`EventSink`, never
raised:

- ``stale(reason, lost=False)``: the publisher is unreachable (disconnected, or silent past
  the ZMTP heartbeat timeout, which libzmq turns into a disconnect); the events of the outage
  are still to be replayed. ``resumed()`` follows a reconnect whose replay filled the gap.
- ``stale(reason, lost=True)``: events are gone for good (a gap the replay could not fill, no
  replay endpoint, the replay went ``replay_timeout_s`` without a message): the sink must forget
  what it knew of the engine, since it may have missed removals. The stream goes on from the
  next batch, and ``resumed()`` follows once one is applied (what the sink learns from then
  on is a subset of the engine's cache, which is safe to use).

A stream that starts mid-way (a router started after the engine, the engine's replay buffer
already past 0) is not a loss: the sink knew nothing of the engine yet. A publisher whose
sequence numbers start again from 0 is a new one: it must come with a new engine generation
(the endpoints are part of the generation's record, and each generation gets its own
subscriber); within one subscriber its batches would be dropped as ``duplicate``.

Peers are not trusted: frames other than three, a sequence number that is not 8 bytes, and
payloads that do not decode or are too large are dropped, each counted by ``reason`` through
``EventSink.dropped``; libzmq refuses frames above :data:`MAX_FRAME_BYTES` (by dropping the
connection) and queues at most ``rcvhwm`` messages. No vLLM import: only its wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.kv_events.events import (
    END_OF_REPLAY_SEQ,
    MAX_PAYLOAD_BYTES,
    EventBatch,
    EventDecodeError,
    decode_batch,
)

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 1024
"""libzmq's ``MAXMSGSIZE`` on both sockets: a larger frame closes the connection unread (a
payload between :data:`MAX_PAYLOAD_BYTES` and this is read and dropped as ``oversized``)."""
MAX_REPLAY_MESSAGES = 200_000
"""Replayed batches read per request at most (vLLM buffers 10,000 by default)."""
REPLAY_RCVHWM = 12_000
"""Replayed batches queued in the replay socket (vLLM keeps 10,000 by default)."""
_SEQ = 8


class EventSink(Protocol):
    """What a subscriber reports to (the router's KV index feed). Called on the event loop."""

    def apply(self, seq: int, batch: EventBatch) -> None:
        """The next batch, in sequence order, each once."""

    def dropped(self, reason: str) -> None:
        """A message was not applied (``frames``, ``seq``, ``duplicate``, or a
        :class:`~services.kv_events.events.EventDecodeError` reason)."""

    def stale(self, reason: str, *, lost: bool) -> None:
        """The stream is not complete: see the module docstring (``disconnected``, ``gap``,
        ``no_replay``, ``replay_timeout``; ``endpoint``: an address libzmq cannot parse, and
        ``failed``: the subscriber itself failed (logged), both for good)."""

    def resumed(self) -> None:
        """The stream is consistent again after :meth:`stale`."""


class EventSubscriber:
    """Follows one engine's publisher until :meth:`close`; see the module docstring."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        sink: EventSink,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        heartbeat_s: float = 5.0,
        rcvhwm: int = 1024,
        topic: bytes = b"",
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._sink = sink
        self._context = context or zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._heartbeat_ms = max(1, int(heartbeat_s * 1000))
        self._rcvhwm = rcvhwm
        self._topic = topic
        self.next_seq: int | None = None
        """The sequence number expected next; ``None`` until the first batch."""
        self._stale = False
        self._lost = False
        self._task: asyncio.Task[None] | None = None
        self._replaying = asyncio.Lock()
        self.replays = 0
        """Replay requests sent (for tests and logs)."""

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def start(self) -> None:
        """Run :meth:`run` as a task of the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.run(), name=f"pdserve-kv-events-{self._endpoint}"
            )

    async def close(self) -> None:
        """Stop following (cancels the task; sockets closed without lingering)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Subscribe, replay, apply, until cancelled. Errors of one message never end it."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        monitoring = asyncio.get_running_loop().create_task(self._watch(monitor))
        try:
            sub.connect(self._endpoint)
            await self._replay(first=True)
            while True:
                frames = await sub.recv_multipart()
                await self._received(frames)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EINVAL, zmq.EPROTONOSUPPORT):
                # An endpoint libzmq cannot parse: this engine's events are never read.
                logger.warning("KV events of %s: cannot connect (%s)", self._endpoint, exc)
                self._lose("endpoint")
            else:
                logger.exception("KV events of %s: subscriber failed", self._endpoint)
                self._lose("failed")
        except Exception:
            logger.exception("KV events of %s: subscriber failed", self._endpoint)
            self._lose("failed")
        finally:
            monitoring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitoring
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Connection changes: a disconnect marks the engine stale; the connection after one
        replays what the outage missed."""
        first = True
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if not self._stale:
                    self._stale = True
                    self._sink.stale("disconnected", lost=False)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if first:
                    first = False
                    continue
                if self._stale and not self._lost:
                    await self._replay(first=False, reconnect=True)
                    if self._stale and not self._lost:
                        self._stale = False
                        self._sink.resumed()

    async def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._sink.dropped("frames")
            return
        _, seq_bytes, payload = frames
        if len(seq_bytes) != _SEQ:
            self._sink.dropped("seq")
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:
            self._sink.dropped("seq")
            return
        if self.next_seq is not None and seq > self.next_seq:
            await self._replay(first=False)
            if self.next_seq is not None and seq > self.next_seq:
                # The replay could not reach this message: the events between are gone.
                self._lose("gap" if self._replay_endpoint else "no_replay")
                self.next_seq = seq
        self._take(seq, payload)

    def _take(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            self._sink.dropped("duplicate")
            return
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._sink.dropped(exc.reason)
            return
        self._sink.apply(seq, batch)
        if self._lost:
            self._lost = False
            self._stale = False
            self._sink.resumed()

    def _lose(self, reason: str) -> None:
        self._lost = True
        self._stale = True
        self._sink.stale(reason, lost=True)

    async def _replay(self, *, first: bool, reconnect: bool = False) -> None:
        """Ask the replay endpoint for every batch from ``next_seq`` on (from 0 at start) and
        apply them, one replay at a time. At start, an unanswered or absent replay is no loss
        (nothing was known yet; the batches before the first one read are simply unknown)."""
        async with self._replaying:
            await self._replay_locked(first=first, reconnect=reconnect)

    async def _replay_locked(self, *, first: bool, reconnect: bool) -> None:
        start = self.next_seq if self.next_seq is not None else 0
        if not self._replay_endpoint:
            if reconnect and self.next_seq is not None:
                # A reconnect without replay: whatever was published meanwhile is gone.
                self._lose("no_replay")
            return
        self.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # vLLM's ROUTER sends the whole buffer in one loop and drops what the pipe cannot take:
        # room for its default buffer, else the replay comes back with a gap (a loss).
        dealer.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(_SEQ, "big")])
            for _ in range(MAX_REPLAY_MESSAGES):
                # A bound on each wait, not on the whole replay (10,000 batches take seconds).
                if not await dealer.poll(self._replay_timeout_s * 1000):
                    if not first:
                        logger.warning(
                            "KV events of %s: replay from %d unanswered in %.1f s",
                            self._endpoint,
                            start,
                            self._replay_timeout_s,
                        )
                        self._lose("replay_timeout")
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != _SEQ:
                    self._sink.dropped("frames")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY_SEQ:
                    return
                if seq < 0:
                    self._sink.dropped("seq")
                    continue
                if self.next_seq is not None and seq > self.next_seq:
                    self._lose("gap")  # the replay buffer no longer reaches back to it
                self._take(seq, frames[3])
        finally:
            dealer.close(linger=0)
