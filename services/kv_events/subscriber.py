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
``EventSink.dropped``. What one engine can make the router hold and compute is bounded:

- libzmq refuses a frame above :data:`MAX_FRAME_BYTES` by closing the connection unread (its
  monitor reports a plain disconnect: counted as ``stale("disconnected")``, then the reconnect
  replays or loses the batch), and queues at most :data:`SUB_RCVHWM` messages on the
  subscription and :data:`REPLAY_RCVHWM` on a replay; a replay is read in rounds (a round
  the queue could not take whole ends early and the next asks again from the next sequence
  number), so a long replay needs no deep queue;
- every message (live or replayed) is charged its payload plus :data:`MESSAGE_COST_BYTES`
  against a per-engine budget of ``max_bytes_per_s`` (bursts up to ``burst_bytes``); past it
  messages are dropped (``flood``) and the stream is lost (``stale("flood", lost=True)``) until
  the budget has refilled whole, so a flooding engine costs the router a bounded share of CPU;
- a payload above :data:`INLINE_DECODE_BYTES` is decoded in a worker thread, and the loop
  runs other tasks between any two messages, so no batch holds the router's event loop.

The resulting worst case in bytes is in docs/kv-events.md ("Bounds of a subscription").
No vLLM import: only its wire format.
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
SUB_RCVHWM = 64
"""Messages queued on the subscription at most (libzmq counts messages, not bytes). Past it the
publisher drops (its own queue first): a gap, which the replay fills."""
REPLAY_RCVHWM = 64
"""Replayed messages queued at most. vLLM's ROUTER sends its whole buffer at once and drops
what the connection cannot take; the rest comes in the next round."""
MAX_REPLAY_MESSAGES = 200_000
"""Replayed batches read per replay at most, all rounds together (vLLM buffers 10,000)."""
MAX_REPLAY_ROUNDS = 64
"""Replay requests per replay at most (vLLM's 10,000 batches take about ten)."""
REPLAY_ROUND_IDLE_S = 0.25
"""A replay round that brought batches and then nothing for this long lost its tail to a full
queue (the publisher sends all at once): the next round asks again from the next batch."""
REDIAL_S = 1.0
"""How long a disconnected subscription waits for libzmq's own reconnect before it dials again
(libzmq gives up on a connection that broke the protocol, e.g. with an oversized frame)."""
MESSAGE_COST_BYTES = 512
"""What a message costs the budget besides its payload (so empty ones flood too)."""
MAX_BYTES_PER_S = 2 << 20
"""One engine's sustained budget: about 350K tokens per second of ``BlockStored`` (an engine
computes tens of thousands), some 10% of a core to decode."""
BURST_BYTES = 32 << 20
"""One engine's burst: a replay of vLLM's 10,000 batches of up to ~3 KiB each, or 32 steps
of the largest payload."""
INLINE_DECODE_BYTES = 64 << 10
"""Payloads up to this size decode on the event loop (well under a millisecond); larger ones
in a worker thread."""
_SEQ = 8


class EventSink(Protocol):
    """What a subscriber reports to (the router's KV index feed). Called on the event loop."""

    def apply(self, seq: int, batch: EventBatch) -> None:
        """The next batch, in sequence order, each once."""

    def dropped(self, reason: str) -> None:
        """A message was not applied (``frames``, ``seq``, ``duplicate``, ``flood``, or a
        :class:`~services.kv_events.events.EventDecodeError` reason)."""

    def stale(self, reason: str, *, lost: bool) -> None:
        """The stream is not complete: see the module docstring (``disconnected``, ``gap``,
        ``no_replay``, ``replay_timeout``, ``replay_rounds``, ``flood``; ``endpoint``: an
        address libzmq cannot parse, and ``failed``: the subscriber itself failed (logged),
        both for good)."""

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
        rcvhwm: int = SUB_RCVHWM,
        topic: bytes = b"",
        max_bytes_per_s: float = MAX_BYTES_PER_S,
        burst_bytes: int = BURST_BYTES,
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
        self._taking = asyncio.Lock()
        self._rate = max_bytes_per_s
        self._burst = float(burst_bytes)
        self._credit = float(burst_bytes)
        self._credit_at: float | None = None
        self._flooded = False
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
        monitoring = asyncio.get_running_loop().create_task(self._watch(monitor, sub))
        try:
            sub.connect(self._endpoint)
            await self._replay(first=True)
            while True:
                frames = await sub.recv_multipart()
                await self._received(frames)
                # A ready message's future is already done: without this, a flood would never
                # let the loop run anything else.
                await asyncio.sleep(0)
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

    async def _watch(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket) -> None:
        """Connection changes: a disconnect marks the engine stale; the connection after one
        replays what the outage missed."""
        first = True
        redial: asyncio.Task[None] | None = None
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if not self._stale:
                    self._stale = True
                    self._sink.stale("disconnected", lost=False)
                if redial is None or redial.done():
                    redial = asyncio.get_running_loop().create_task(self._redial(sub))
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if redial is not None:
                    redial.cancel()
                if first:
                    first = False
                    continue
                if self._stale and not self._lost:
                    await self._replay(first=False, reconnect=True)
                    if self._stale and not self._lost:
                        self._stale = False
                        self._sink.resumed()

    async def _redial(self, sub: zmq.asyncio.Socket) -> None:
        """libzmq reconnects after a lost connection but not after a protocol error (a frame
        over MAXMSGSIZE among them): still disconnected after a while, connect again."""
        while True:
            await asyncio.sleep(REDIAL_S)
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(self._endpoint)
            sub.connect(self._endpoint)

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
        await self._take(seq, payload)

    async def _take(self, seq: int, payload: bytes) -> bool:
        """Decode and apply one batch in order; ``False``: over the budget (``flood``)."""
        async with self._taking:  # a replay and the subscription never interleave a batch
            if self.next_seq is not None and seq < self.next_seq:
                self._sink.dropped("duplicate")
                return True
            self.next_seq = seq + 1
            entering = not self._flooded
            if not self._admit(len(payload)):
                self._sink.dropped("flood")
                if entering:
                    logger.warning(
                        "KV events of %s: over %d bytes/s, dropped until the budget refills",
                        self._endpoint,
                        int(self._rate),
                    )
                    self._lose("flood")
                return False
            try:
                if len(payload) > INLINE_DECODE_BYTES:
                    batch = await asyncio.to_thread(decode_batch, payload)
                else:
                    batch = decode_batch(payload)
            except EventDecodeError as exc:
                self._sink.dropped(exc.reason)
                return True
            self._sink.apply(seq, batch)
            if self._lost:
                self._lost = False
                self._stale = False
                self._sink.resumed()
            return True

    def _admit(self, size: int) -> bool:
        """Charge one message to the budget (a token bucket on the loop's clock). Once over,
        nothing is admitted until the bucket is full again."""
        now = asyncio.get_running_loop().time()
        if self._credit_at is not None:
            elapsed = max(0.0, now - self._credit_at)
            self._credit = min(self._burst, self._credit + elapsed * self._rate)
        self._credit_at = now
        if self._flooded:
            if self._credit < self._burst:
                return False
            self._flooded = False
        cost = size + MESSAGE_COST_BYTES
        if cost > self._credit:
            self._flooded = True
            return False
        self._credit -= cost
        return True

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
        if not self._replay_endpoint:
            if reconnect and self.next_seq is not None:
                # A reconnect without replay: whatever was published meanwhile is gone.
                self._lose("no_replay")
            return
        budget = MAX_REPLAY_MESSAGES
        for _ in range(MAX_REPLAY_ROUNDS):
            if budget <= 0:
                break
            start = self.next_seq if self.next_seq is not None else 0
            read, finished = await self._replay_round(start, first=first, budget=budget)
            if finished:
                return
            if read == 0:
                if not first:
                    logger.warning(
                        "KV events of %s: replay from %d unanswered in %.1f s",
                        self._endpoint,
                        start,
                        self._replay_timeout_s,
                    )
                    self._lose("replay_timeout")
                return
            budget -= read
        self._lose("replay_rounds")  # not at the end after MAX_REPLAY_ROUNDS or _MESSAGES

    async def _replay_round(self, start: int, *, first: bool, budget: int) -> tuple[int, bool]:
        """One replay request from ``start``: the batches read, and whether it ended (the end
        marker, a loss, the budget) rather than lost its tail to a full queue."""
        self.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        read = 0
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(_SEQ, "big")])
            for _ in range(budget):
                # A bound on each wait, not on the whole replay (10,000 batches take seconds);
                # once batches came, a pause means the publisher dropped the rest.
                wait_s = self._replay_timeout_s if read == 0 else REPLAY_ROUND_IDLE_S
                if not await dealer.poll(wait_s * 1000):
                    return read, read == 0 and first
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != _SEQ:
                    self._sink.dropped("frames")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY_SEQ:
                    return read, True
                if seq < 0:
                    self._sink.dropped("seq")
                    continue
                if self.next_seq is not None and seq > self.next_seq:
                    if read > 0:
                        return read, False  # dropped in transit: ask again from next_seq
                    self._lose("gap")  # the replay buffer no longer reaches back to it
                read += 1
                if not await self._take(seq, frames[3]):
                    return read, True  # over budget: the rest is lost (counted as flood)
                await asyncio.sleep(0)
            return read, False
        finally:
            dealer.close(linger=0)
