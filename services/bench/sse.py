"""Server-sent events as the benchmarks' (and the tests') clients read them.

A line of an event stream ends at CR, LF or CRLF and nowhere else (the HTML standard's
"Server-sent events", "Parsing an event stream"). httpx's ``aiter_lines`` splits as
``str.splitlines`` does, also at U+0085, U+2028, U+2029, form feeds and the like, which a
completion's text may hold (the simulated engines' byte-level texts do): a JSON event cut there
no longer parses. :class:`EventStreamDecoder` is the standard's parser as a sans-IO core (text
in, the data of each dispatched event out); :func:`event_data` and :func:`iter_event_data` read
a response with it. :func:`stream_routed` is the routing benchmarks' one streamed completion.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import httpx

_LINE_END = re.compile("\r\n|\r|\n")

MAX_EVENT_CHARS = 16 * 1024 * 1024
"""Bound on one event (its data and the line being read) held while it is incomplete."""


class StreamFailed(Exception):
    """A streamed completion answered with an error: its status, or an error event."""


class EventTooLarge(StreamFailed):
    """An event (or one line of it) grew past the decoder's bound before it ended."""


class EventStreamDecoder:
    """The standard's event-stream parser over text fed in pieces of any size.

    Only ``data`` matters here: :meth:`feed` returns the data of each event dispatched (a blank
    line ends an event; its ``data`` lines joined with LF), ``event``, ``id`` and ``retry``
    fields and comments (lines starting with a colon) are read and dropped. An event the stream
    ends in the middle of is discarded, as the standard says."""

    def __init__(self, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self._max = max_event_chars
        self._line = ""
        self._data: list[str] = []
        self._data_chars = 0
        self._after_cr = False
        self._started = False

    def feed(self, text: str) -> list[str]:
        """The data of every event that ``text`` completes; :class:`EventTooLarge` past the
        bound."""
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        dispatched: list[str] = []
        if self._after_cr and text:
            # A CR that ended the last piece ended its line; an LF right after it is the same
            # line end (CRLF), not a blank line.
            self._after_cr = False
            text = text.removeprefix("\n")
        *lines, rest = _LINE_END.split(text)
        if lines:
            self._after_cr = text.endswith("\r")
            lines[0] = self._line + lines[0]
            self._line = ""
            for line in lines:
                self._line_ended(line, dispatched)
        self._line += rest
        if len(self._line) + self._data_chars > self._max:
            raise EventTooLarge(f"an event of more than {self._max} characters")
        return dispatched

    def _line_ended(self, line: str, dispatched: list[str]) -> None:
        if not line:
            if self._data:
                dispatched.append("\n".join(self._data))
            self._data = []
            self._data_chars = 0
            return
        if line.startswith(":"):
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_chars += len(value) + 1
            if self._data_chars > self._max:
                raise EventTooLarge(f"an event of more than {self._max} characters")


async def event_data(reply: httpx.Response) -> AsyncIterator[str]:
    """The data of each event of ``reply``'s stream, as the standard splits it."""
    decoder = EventStreamDecoder()
    async for text in reply.aiter_text():
        for data in decoder.feed(text):
            yield data


def iter_event_data(reply: httpx.Response) -> Iterator[str]:
    """:func:`event_data` for a synchronous client's response."""
    decoder = EventStreamDecoder()
    for text in reply.iter_text():
        yield from decoder.feed(text)


def json_events(body: str) -> list[Any]:
    """The JSON data of every event of a whole stream's ``body`` (``[DONE]`` left out)."""
    return [json.loads(data) for data in EventStreamDecoder().feed(body) if data != "[DONE]"]


async def completion_events(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of ``reply``'s server-sent events until ``[DONE]``;
    :class:`StreamFailed` for a status other than 200 or an ``error`` event (the first 300
    characters of either)."""
    if reply.status_code != 200:
        raise StreamFailed(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
    async for data in event_data(reply):
        if data == "[DONE]":
            return
        event: dict[str, Any] = json.loads(data)
        if "error" in event:
            raise StreamFailed(str(event["error"])[:300])
        yield event


def cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion's usage (0 when the router
    reports no details: ``--enable-prompt-tokens-details`` off)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class RoutedRecord(Protocol):
    """What :func:`stream_routed` records of one completion (a benchmark's per-request
    result)."""

    ok: bool
    error: str | None
    ttft_s: float | None
    cached_tokens: int
    prefill_engine: str | None
    decode_engine: str | None
    path: str | None


async def stream_routed(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float,
    record: RoutedRecord,
) -> list[float]:
    """One greedy streamed completion of exactly ``max_tokens`` tokens through the router,
    recorded in ``record``: the engines and path the router answered with (its
    ``x-pdserve-*`` headers), the TTFT from the client, the usage's cached tokens (``ok`` once
    the usage came) or the error. Returns when each event with text came
    (``time.perf_counter``), for the gaps between them. Never raises for the stream's errors."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    texts: list[float] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as reply:
            record.prefill_engine = reply.headers.get("x-pdserve-prefill-engine")
            record.decode_engine = reply.headers.get("x-pdserve-decode-engine")
            record.path = reply.headers.get("x-pdserve-execution-path")
            async for event in completion_events(reply):
                if any(choice.get("text") for choice in event.get("choices", [])):
                    texts.append(time.perf_counter())
                    if record.ttft_s is None:
                        record.ttft_s = texts[0] - sent
                usage = event.get("usage")
                if usage:
                    record.cached_tokens = cached_tokens(usage)
                    record.ok = True
    except StreamFailed as exc:
        record.error = str(exc)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if not record.ok and record.error is None:
        record.error = "stream ended without usage"
    return texts
