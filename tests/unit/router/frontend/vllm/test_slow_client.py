"""A client that stops reading a stream: the decode engine still starts at once (it pulls the
KV the prefill engine holds on a lease), and the rest of the stream waits on the client
(backpressure: the router does not read the engine's tokens ahead of it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from services.control_plane.wire import EngineRole
from services.router.main import create_app
from tests.unit.router.fakes import MODEL, FakeEngine, FakeFactory, prepared, text_of

BOUND_S = 60.0
FIRST_ID = 300
"""Decode token ``i`` has id ``FIRST_ID + i``: whole words (``" t<id>"``) to detokenize."""


class CountingEngine(FakeEngine):
    """A fake whose decode stream records how many deltas the router read from it."""

    read: int = 0

    async def decode(self, request: Any, *, timeout_s: float | None = None) -> Any:
        async for delta in super().decode(request, timeout_s=timeout_s):
            self.read += 1
            yield delta


class CountingFactory(FakeFactory):
    def connect(self, record: Any) -> Any:
        engine = CountingEngine(record.engine_id, first_output_id=FIRST_ID)
        return self.engines.setdefault(record.engine_id, engine)


async def until(predicate: Any, what: str) -> None:
    for _ in range(int(BOUND_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within {BOUND_S} s")


async def test_a_client_that_stops_reading_holds_the_stream_not_the_hand_off() -> None:
    factory = CountingFactory()
    rt = prepared(factory, ("p0", EngineRole.PREFILL), ("d0", EngineRole.DECODE))
    app = create_app(rt.settings, runtime=rt)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 40, "stream": True}
    reading = asyncio.Event()  # the client reads again
    sent: list[dict[str, Any]] = []

    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode()}
        await asyncio.Event().wait()  # the client never hangs up
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await reading.wait()  # a full socket: uvicorn's send waits for the client

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000), "state": {},
        "headers": [(b"host", b"router"), (b"content-type", b"application/json")],
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        call = asyncio.create_task(app(scope, receive, send))
        decode = factory.engines["d0"]
        assert isinstance(decode, CountingEngine)
        # The client has not read the first event, yet the decode engine got its request.
        await until(lambda: bool(decode.decodes), "the decode engine's request")
        await until(lambda: decode.read > 0, "the decode engine's first token")
        for _ in range(20):
            await asyncio.sleep(0.01)
        held = decode.read
        # The router reads no further ahead of a stalled client than what it holds for it.
        assert held <= 3, held
        assert not call.done()
        reading.set()
        await asyncio.wait_for(call, BOUND_S)
    assert decode.read == 39  # every token after the prefill's, once the client read on
    assert sent[0]["status"] == 200
    events = [
        json.loads(line[len(b"data: ") :])
        for message in sent[1:]
        for line in message.get("body", b"").split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    text = "".join(choice["text"] for event in events for choice in event["choices"])
    assert text == text_of(7, *range(FIRST_ID + 1, FIRST_ID + 40))
