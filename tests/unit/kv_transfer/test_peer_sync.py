"""PeerSync over a scripted control plane and watcher: failed pre-warms are retried."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry

from services.control_plane import ControlPlaneError
from services.control_plane.aggregation import EngineTopology
from services.control_plane.base import EngineView
from services.control_plane.watch import EngineChange
from services.control_plane.wire import EngineState, EngineStatus
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.peer_sync import PeerSync
from tests.unit.kv_transfer.test_consumer_producer import consumer_side, topology


class FlakyControlPlane:
    """``get_topology`` fails ``failures`` times, then answers."""

    def __init__(self, topology: EngineTopology, failures: int) -> None:
        self.topology = topology
        self.failures = failures
        self.calls = 0

    async def get_topology(self, engine_id: str) -> EngineTopology:
        self.calls += 1
        if self.calls <= self.failures:
            raise ControlPlaneError("not reachable", reason="unavailable")
        return self.topology


class QuietWatcher:
    """A snapshot that never changes: nothing but the retries can connect the producer."""

    def __init__(self, view: EngineView) -> None:
        self.snapshot = {view.engine_id: view}

    def __aiter__(self) -> AsyncIterator[EngineChange]:
        return self

    async def __anext__(self) -> EngineChange:
        await asyncio.Event().wait()
        raise StopAsyncIteration


async def test_follow_retries_a_failed_prewarm_from_the_snapshot() -> None:
    consumer, _, _ = consumer_side()
    ready = topology(1)
    status = EngineStatus("prefill-0", 1, EngineState.READY, (), 1, 0)
    view = EngineView("prefill-0", ready.engine, status, None)
    control_plane = FlakyControlPlane(ready, failures=2)
    metrics = KVTransferMetrics(CollectorRegistry())
    sync = PeerSync(
        consumer,
        control_plane,  # type: ignore[arg-type]
        compat_hash="h",
        metrics=metrics,
        retry_interval_s=0.01,
    )
    watcher: Any = QuietWatcher(view)
    following = asyncio.create_task(sync.follow(watcher))
    try:
        for _ in range(500):
            if consumer.connected("prefill-0") is not None:
                break
            await asyncio.sleep(0.01)
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
    assert consumer.connected("prefill-0") == 1
    assert control_plane.calls == 3
    failures = metrics.registry.get_sample_value(
        "pdserve_kv_transfer_prewarm_failures_total",
        {"producer_engine": "prefill-0", "reason": "unavailable"},
    )
    assert failures == 2
