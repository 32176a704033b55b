"""The router bench's load generator parses what routers answer, and its CPU accounting reads
/proc for a process tree."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from services.bench import loadgen
from services.bench.procs import cpu_seconds, descendants


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_responses_with_content_length_and_chunked_bodies_are_read_whole() -> None:
    reader = _reader(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
        b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n"
    )
    assert await loadgen.read_response(reader) == (200, b"hello")
    assert await loadgen.read_response(reader) == (503, b"abcde")


async def test_a_response_without_a_length_is_an_error() -> None:
    with pytest.raises(loadgen.HTTPError):
        await loadgen.read_response(_reader(b"HTTP/1.1 200 OK\r\n\r\nbody"))


def test_the_request_is_a_keep_alive_json_post() -> None:
    host, port, request = loadgen.encode_request("http://127.0.0.1:8080/v1/completions", b"{}")
    assert (host, port) == ("127.0.0.1", 8080)
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"content-length: 2\r\n" in request and request.endswith(b"\r\n\r\n{}")


async def test_a_closed_loop_against_the_instant_server_counts_every_answer() -> None:
    server = asyncio.ensure_future(loadgen.serve_instant(port := _free_port()))
    try:
        await asyncio.sleep(0.2)
        now = time.time()
        result = await loadgen.run(f"http://127.0.0.1:{port}/x", b"{}", 3, now, now + 0.3)
    finally:
        server.cancel()
    assert result["errors"] == 0, result["first_error"]
    assert result["completed"] == len(result["latencies_us"]) > 0


def test_cpu_time_of_a_process_tree_includes_its_children() -> None:
    # The grandchild burns 0.3 s of CPU, then stays alive (a dead process counts nothing).
    busy = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\ntime.sleep(60)"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and cpu_seconds(descendants(parent.pid)) < 0.3:
            time.sleep(0.05)
        tree = descendants(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        assert cpu_seconds(tree) >= 0.3
        assert cpu_seconds([os.getpid()]) > 0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def _free_port() -> int:
    from services.control_plane.local_redis import free_port  # noqa: PLC0415

    return free_port()


def test_cpu_seconds_resolves_less_than_a_clock_tick() -> None:
    """2 ms of CPU show as at least 2 ms (``/proc``'s utime + stime count 10 ms ticks, so a
    fast router's CPU over a short window read 0 there)."""
    before = cpu_seconds([os.getpid()])
    own = time.process_time()
    while time.process_time() - own < 0.002:
        pass
    assert cpu_seconds([os.getpid()]) - before >= 0.002
