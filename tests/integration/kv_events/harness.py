"""Test helpers for KV-event streams: a recording sink, bound ports and a TCP proxy that can
cut or freeze the connection between a subscriber and a publisher."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.kv_events.events import EventBatch

WAIT_S = 30.0
kv_events: Any = None


def bound_port(sock: Any) -> int:
    """The port a ZMQ socket bound to ``tcp://host:*`` got."""
    import zmq  # noqa: PLC0415 - only tests that publish pay for it

    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Publisher:
    """vLLM's real publisher (``vllm.distributed.kv_events``, imported when first built) bound
    on fresh ports; batch ``i`` of :meth:`stored` stores block ``i``."""

    def __init__(self, buffer_steps: int = 10_000) -> None:
        global kv_events  # noqa: PLW0603 - vLLM imports slowly: only tests that publish pay
        if kv_events is None:
            kv_events = importlib.import_module("vllm.distributed.kv_events")
        # ZMQ picks the ports as it binds (``:*``): a port picked before the bind can be taken
        # by another process in between (a parallel test worker's connection did, in CI).
        self.pub: Any = kv_events.ZmqEventPublisher(
            0,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            buffer_steps=buffer_steps,
        )
        self.port = bound_port(self.pub._pub)
        self.replay_port = bound_port(self.pub._replay)
        self.count = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def stored(self, n: int = 1) -> None:
        """Publish ``n`` batches, batch ``i`` storing block ``i`` (4 tokens ``i``)."""
        for _ in range(n):
            i = self.count
            self.count += 1
            event = kv_events.BlockStored(
                block_hashes=[i],
                parent_block_hash=None,
                token_ids=[i] * 4,
                block_size=4,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
            self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[event]))

    def raw(self, events: list[Any]) -> None:
        self.count += 1
        self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=events))

    def shutdown(self) -> None:
        self.pub.shutdown()

    def blocks(
        self, tokens: Sequence[int], hashes: Sequence[int], parent: int | None = None
    ) -> None:
        """One batch storing ``tokens`` as blocks of 4 under the engine's ``hashes``."""
        self.raw(
            [
                kv_events.BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=parent,
                    token_ids=list(tokens),
                    block_size=4,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                )
            ]
        )

    def removed(self, hashes: Sequence[int]) -> None:
        """One batch removing the engine's ``hashes``."""
        self.raw([kv_events.BlockRemoved(block_hashes=list(hashes), medium="CPU")])


class RecordingSink:
    """An :class:`~services.kv_events.subscriber.EventSink` that keeps everything."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, EventBatch]] = []
        self.drops: list[str] = []
        self.log: list[tuple[object, ...]] = []

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.applied]

    def apply(self, seq: int, batch: EventBatch) -> None:
        self.applied.append((seq, batch))
        self.log.append(("apply", seq))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)

    def stale(self, reason: str, *, lost: bool) -> None:
        self.log.append(("stale", reason, lost))

    def resumed(self) -> None:
        self.log.append(("resumed",))

    def events(self, kind: str) -> list[tuple[object, ...]]:
        return [entry for entry in self.log if entry[0] == kind]


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; :meth:`cut` drops every connection
    and stops listening, :meth:`restore` listens again, :meth:`freeze` stops forwarding bytes
    while keeping the connections open (a hung peer)."""

    def __init__(self, target: int) -> None:
        self._target = target
        self.port = 0  # the first :meth:`restore` takes a free one; later ones rebind it
        self._server: asyncio.Server | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in self._transports:
            transport.abort()  # type: ignore[attr-defined]
        self._transports.clear()

    def freeze(self) -> None:
        self._thawed.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.transport.abort()
            return
        self._transports += [writer.transport, up_writer.transport]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                await self._thawed.wait()
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    async def close(self) -> None:
        self._thawed.set()
        await self.cut()
