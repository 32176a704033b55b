"""The control plane through Redis Sentinel (``redis+sentinel://``, issue 49): a real master, a
real replica and a real sentinel; the master is SIGKILLed, the sentinel promotes the replica,
and an engine host registered through the sentinel URL keeps its registration READY (its
heartbeats reach the new master) without restarting; a reader through the same URL sees it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from services.config import ControlPlaneSettings, RedisSettings
from services.config.control_plane import SentinelTarget, parse_sentinel_url
from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole, EngineState
from services.engines.stub import StubBackend
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

SERVICE = "pdserve"
WAIT_S = 120.0


def test_sentinel_urls_parse_and_bad_ones_are_refused_naming_why() -> None:
    assert parse_sentinel_url("redis+sentinel://u:p%40ss@h1:26379,[::1]:26380/mymaster/2") == (
        SentinelTarget((("h1", 26379), ("::1", 26380)), "mymaster", 2, "u", "p@ss")
    )
    settings = RedisSettings(url="redis+sentinel://h1:26379/mymaster")
    assert settings.sentinel == SentinelTarget((("h1", 26379),), "mymaster")
    assert RedisSettings(url="redis://h:1/0").sentinel is None
    for url, why in (
        ("redis+sentinel://h1/mymaster", "not host:port"),
        ("redis+sentinel://h1:26379", "/service_name"),
        ("redis+sentinel://h1:26379/m/x", "not a number"),
        ("redis+sentinel://h1:26379/m?db=1", "no query"),
    ):
        with pytest.raises(ValueError, match=why):
            RedisSettings(url=url)


@pytest.fixture
def sentinel_group() -> Iterator[tuple[LocalRedisServer, LocalRedisServer, LocalRedisServer]]:
    """A master, its replica and one sentinel watching them (quorum 1, 0.3 s to call the master
    down)."""
    with LocalRedisServer() as master:
        replica = LocalRedisServer(extra_args=("--replicaof", "127.0.0.1", str(master.port)))
        sentinel = LocalRedisServer(
            config=(
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1",
                f"sentinel down-after-milliseconds {SERVICE} 300",
                f"sentinel failover-timeout {SERVICE} 5000",
            ),
            extra_args=("--sentinel",),
        )
        with replica, sentinel:
            probe = redis.Redis(port=sentinel.port)
            deadline = time.monotonic() + WAIT_S
            while not probe.sentinel_slaves(SERVICE):  # type: ignore[no-untyped-call]
                assert time.monotonic() < deadline, "the sentinel never saw the replica"
                time.sleep(0.1)
            probe.close()
            yield master, replica, sentinel


async def test_an_engine_stays_ready_through_a_sentinel_failover(
    sentinel_group: tuple[LocalRedisServer, LocalRedisServer, LocalRedisServer], namespace: str
) -> None:
    master, replica, sentinel = sentinel_group
    cp_settings = ControlPlaneSettings(
        redis=RedisSettings(
            url=f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}",
            retry_attempts=3,
            retry_backoff_s=0.1,
            retry_backoff_max_s=0.5,
        ),
        namespace=namespace,
        lease_ttl_s=5.0,
        heartbeat_interval_s=0.5,
        resync_interval_s=0.3,
    )
    cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
    try:
        async with hosted(
            service_settings(cp_settings), StubBackend(), engine_id="d1", role=EngineRole.DECODE
        ) as dec:
            view = await cp.get_engine("d1")
            assert view is not None and view.state is EngineState.READY
            await asyncio.to_thread(master.kill)
            promoted = redis.Redis(port=replica.port)
            deadline = time.monotonic() + WAIT_S
            while (await asyncio.to_thread(promoted.info, "replication"))["role"] != "master":
                assert time.monotonic() < deadline, "the sentinel never promoted the replica"
                await asyncio.sleep(0.1)
            promoted.close()
            # Longer than the lease: READY now means the heartbeats reached the new master.
            await asyncio.sleep(cp_settings.lease_ttl_s + 1)
            deadline = time.monotonic() + WAIT_S
            while (view := await cp.get_engine("d1")) is None or not view.ready:
                assert time.monotonic() < deadline, f"d1 not READY after the failover: {view}"
                await asyncio.sleep(0.1)
            assert not dec.task.done(), "the host must not exit"
        assert await dec.exit_code() == 0
        assert await cp.get_engine("d1") is None  # deregistered on the new master
    finally:
        await cp.close()
