"""The benchmarks' reader of a streamed completion's events."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.bench.sse import StreamFailed, completion_events


def _events(status: int, body: str) -> list[dict[str, object]]:
    reply = httpx.Response(status, content=body.encode())

    async def read() -> list[dict[str, object]]:
        return [event async for event in completion_events(reply)]

    return asyncio.run(read())


def test_events_until_done_skipping_other_lines() -> None:
    body = (
        'data: {"choices": [{"text": "a"}]}\n\n: keep-alive\n\n'
        'data: {"usage": {}}\n\ndata: [DONE]\n\ndata: {"late": true}\n\n'
    )
    assert _events(200, body) == [{"choices": [{"text": "a"}]}, {"usage": {}}]


def test_an_error_status_or_event_fails_the_stream() -> None:
    with pytest.raises(StreamFailed, match="HTTP 503"):
        _events(503, '{"error": {"message": "no engine"}}')
    with pytest.raises(StreamFailed, match="decode failed"):
        _events(200, 'data: {"choices": []}\n\ndata: {"error": {"message": "decode failed"}}\n\n')
