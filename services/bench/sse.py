"""The events of a streamed completion as the benchmarks' clients read them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


class StreamFailed(Exception):
    """A streamed completion answered with an error: its status, or an error event."""


async def completion_events(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of ``reply``'s server-sent events until ``[DONE]``;
    :class:`StreamFailed` for a status other than 200 or an ``error`` event (the first 300
    characters of either)."""
    if reply.status_code != 200:
        raise StreamFailed(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
    async for line in reply.aiter_lines():
        if line == "data: [DONE]":
            return
        if not line.startswith("data: "):
            continue
        event: dict[str, Any] = json.loads(line[len("data: ") :])
        if "error" in event:
            raise StreamFailed(str(event["error"])[:300])
        yield event
