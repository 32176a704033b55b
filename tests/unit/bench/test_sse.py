"""The benchmarks' reader of a streamed completion's events."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.bench.sse import (
    EventStreamDecoder,
    EventTooLarge,
    StreamFailed,
    cached_tokens,
    completion_events,
    iter_event_data,
    json_events,
)


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


def test_a_text_holding_unicode_line_separators_is_one_line() -> None:
    """U+0085, U+2028 and U+2029 end a line for ``str.splitlines`` (and httpx's
    ``aiter_lines``), never in an event stream: the event's JSON arrives whole."""
    text = "a\u0085b\u2028c\u2029d\x0be\x0cf\x1cg"
    event = json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
    assert "\u0085" in event and "\u2028" in event  # raw, as a server writes them
    body = f"data: {event}\n\ndata: [DONE]\n\n"
    assert _events(200, body) == [{"choices": [{"text": text}]}]


def _fed(pieces: list[str], **bounds: int) -> list[str]:
    decoder = EventStreamDecoder(**bounds)
    return [data for piece in pieces for data in decoder.feed(piece)]


def test_lines_end_at_cr_lf_or_crlf_even_split_across_pieces() -> None:
    stream = "data: a\r\rdata: b\r\n\r\ndata: c\n\ndata:d\ndata\n\n: comment\nid: 7\nevent: x\n\n"
    expected = ["a", "b", "c", "d\n"]
    assert _fed([stream]) == expected
    # Every split point, a CRLF cut between its CR and its LF included.
    for cut in range(len(stream) + 1):
        assert _fed([stream[:cut], stream[cut:]]) == expected, cut
    assert _fed(list(stream)) == expected
    # A leading byte-order mark is dropped; an event the stream ends inside is not dispatched.
    assert _fed(["\ufeffdata: x\n\ndata: unfinished\n"]) == ["x"]


def test_an_event_past_the_bound_fails_the_stream() -> None:
    decoder = EventStreamDecoder(max_event_chars=10)
    assert decoder.feed("data: 12345\n\n") == ["12345"]
    with pytest.raises(EventTooLarge):
        decoder.feed("data: 123456\ndata: 12345")  # two lines of one event
    with pytest.raises(EventTooLarge):
        EventStreamDecoder(max_event_chars=10).feed("data: " + "x" * 20)  # one unended line


def test_a_synchronous_response_reads_the_same() -> None:
    reply = httpx.Response(200, content='data: {"t": "\u2028"}\r\n\r\n'.encode())
    assert list(iter_event_data(reply)) == ['{"t": "\u2028"}']


def test_a_whole_bodys_json_events() -> None:
    body = 'event: x\ndata: {"a": "\u2028\u0085"}\n\ndata: [DONE]\n\n'
    assert json_events(body) == [{"a": "\u2028\u0085"}]


def test_cached_tokens_read_from_usage_details_or_zero() -> None:
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert cached_tokens({"prompt_tokens_details": None}) == 0
    assert cached_tokens({"prompt_tokens": 3}) == 0
