"""The control plane through Redis Sentinel (``redis+sentinel://``, issue 49): a real master, a
real replica and a real sentinel; the master is SIGKILLed under streamed load, the sentinel
promotes the replica, and the engine hosts and the router, all on the sentinel URL, ride it
out: no failed request, the registrations READY on the new master, no host restarted."""

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
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from tests.integration.services.conftest import hosted, service_settings
from tests.integration.services.routed_load import StreamingLoad, routed, wait_until

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


async def test_requests_and_registrations_ride_out_a_sentinel_failover(
    sentinel_group: tuple[LocalRedisServer, LocalRedisServer, LocalRedisServer], namespace: str
) -> None:
    """1P+1D and a router, all through the sentinel URL, 4 clients streaming: the master is
    SIGKILLed, the replica promoted; no request fails, the engines stay READY (their heartbeats
    reach the new master past a lease) and no host exits."""
    master, replica, sentinel = sentinel_group
    cp_settings = ControlPlaneSettings(
        redis=RedisSettings(
            url=f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}",
            retry_attempts=3,
            retry_backoff_s=0.1,
            retry_backoff_max_s=0.5,
        ),
        namespace=namespace,
        lease_ttl_s=2.0,
        heartbeat_interval_s=0.5,
        resync_interval_s=0.3,
    )
    settings = service_settings(cp_settings)
    cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
    try:
        async with (
            hosted(settings, StubBackend(), engine_id="p1", role=EngineRole.PREFILL) as pre,
            hosted(settings, StubBackend(), engine_id="d1", role=EngineRole.DECODE) as dec,
            routed(cp_settings) as (_, http),
        ):
            async with StreamingLoad(http) as load:
                await wait_until(lambda: len(load.done) >= 8, "requests before the failover")
                await asyncio.to_thread(master.kill)
                promoted = redis.Redis(port=replica.port)
                deadline = time.monotonic() + WAIT_S
                while (await asyncio.to_thread(promoted.info, "replication"))["role"] != "master":
                    assert time.monotonic() < deadline, "the sentinel never promoted the replica"
                    await asyncio.sleep(0.1)
                promoted.close()
                promoted_at = time.monotonic()
                # Past a lease: READY now means the heartbeats reached the new master.
                await asyncio.sleep(cp_settings.lease_ttl_s + 0.5)
                await wait_until(
                    lambda: load.served_since(promoted_at) >= 8, "requests after the failover"
                )
            assert load.failures == []
            for engine_id in ("p1", "d1"):
                view = await cp.get_engine(engine_id)
                assert view is not None and view.ready, view
            assert not pre.task.done() and not dec.task.done(), "no host may exit"
        assert await cp.get_engine("d1") is None  # deregistered on the new master
    finally:
        await cp.close()
