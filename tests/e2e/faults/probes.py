"""Probes for fault-injection tests: rank processes of an engine, /metrics samples, load of an
engine's block pool, and bounded waits that fail with what they waited for."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.control_plane.wire import EngineLoad
from services.serving.client.grpc_aio import GrpcAioEngineClient


def rank_pids(engine_pid: int) -> list[int]:
    """The rank processes of the engine service ``engine_pid`` (its children, minus
    multiprocessing's resource tracker), oldest first."""
    pids: list[int] = []
    for task in Path(f"/proc/{engine_pid}/task").iterdir():
        with contextlib.suppress(OSError):
            pids.extend(int(pid) for pid in (task / "children").read_text().split())
    ranks = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
    return ranks


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` at ``url`` whose labels include ``labels``
    (0 when there is none); the page is read with prometheus_client's own parser."""
    text = httpx.get(url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
        and all(sample.labels.get(key) == value for key, value in labels.items())
    )


async def load_of(grpc_target: str) -> EngineLoad:
    client = GrpcAioEngineClient(grpc_target)
    try:
        return await client.get_load(timeout_s=5)
    finally:
        await client.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took, or AssertionError naming ``what``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - started
