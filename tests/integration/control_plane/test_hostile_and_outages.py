"""Hostile or stale values in Redis, Redis down and Redis restarting: clear errors, no crash."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace

import msgpack
import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import (
    ControlPlaneMetrics,
    ControlPlaneUnavailable,
    EngineNotReady,
    EngineState,
    RedisControlPlane,
)
from services.control_plane.aggregation import rank_field
from services.control_plane.local_redis import LocalRedisServer, free_port
from services.control_plane.synthetic import synthetic_records, synthetic_spec
from services.control_plane.wire import encode
from services.topology import Range
from tests.conftest import counter_value

pytestmark = pytest.mark.integration


async def _ready(cp: RedisControlPlane, engine_id: str):  # type: ignore[no-untyped-def]
    engine = await cp.register(synthetic_spec(engine_id, pp_size=2, tp_size=2))
    await cp.publish_handshakes(engine, list(synthetic_records(engine).values()))
    return engine


HOSTILE = {
    "huge": b"\x00" * (5 * 1024 * 1024),
    "truncated": None,  # filled in per test from a real record
    "wrong_version": msgpack.packb({"v": 99, "k": "handshake", "d": {}}),
    "garbage": b"\xde\xad\xbe\xef",
}


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("huge", "oversized"),
        ("truncated", "malformed"),
        ("wrong_version", "wrong_version"),
        ("garbage", "malformed"),
        ("overlapping_layers", "layer_overlap"),
        ("outside_regions", "geometry"),
    ],
)
async def test_hostile_record_written_behind_our_back_is_rejected_on_read(
    control_plane: RedisControlPlane, metrics: ControlPlaneMetrics, kind: str, reason: str
) -> None:
    engine = await _ready(control_plane, "victim")
    records = synthetic_records(engine)
    value = HOSTILE.get(kind)
    if kind == "truncated":
        value = encode(records[(1, 0)])[:-7]
    elif kind == "overlapping_layers":
        value = encode(
            replace(
                records[(1, 0)],
                layers=Range(2, 8),
                region_base_addrs=tuple((i + 1) << 32 for i in range(12)),
            )
        )
    elif kind == "outside_regions":
        value = encode(replace(records[(1, 0)], region_base_addrs=(0, -1)))
    assert value is not None
    key = control_plane.keys.handshakes("victim", engine.generation)
    await control_plane.connection.client.hset(key, rank_field(1, 0), value)

    with pytest.raises(EngineNotReady) as caught:
        await control_plane.get_topology("victim")
    assert any(p.startswith(reason) for p in caught.value.problems), caught.value.problems
    inspection = await control_plane.inspect("victim")
    assert inspection is not None and inspection.aggregation is not None
    assert inspection.aggregation.state is EngineState.INVALID
    assert (
        counter_value(metrics, "pdserve_control_plane_records_rejected_total", reason=reason) >= 1
    )


async def test_hostile_engine_record_and_event_do_not_break_readers_or_watchers(
    control_plane: RedisControlPlane, metrics: ControlPlaneMetrics
) -> None:
    await _ready(control_plane, "good")
    bad = await control_plane.register(synthetic_spec("bad"))
    client = control_plane.connection.client
    await client.set(control_plane.keys.engine("bad"), b"\x93\x01\x02")
    async with control_plane.watch() as watcher:
        await client.publish(control_plane.keys.events, b"not an event")
        await client.publish(control_plane.keys.events, b"\x00" * 100)
        views = {v.engine_id: v for v in await control_plane.list_engines()}
        assert views["good"].ready
        assert views["bad"].record is None and views["bad"].problems
        assert views["bad"].state is None
        await asyncio.sleep(0.5)
        assert watcher.snapshot["good"].ready
    assert bad.generation > 0
    assert (
        counter_value(metrics, "pdserve_control_plane_records_rejected_total", reason="malformed")
        >= 2
    )


async def test_unreachable_redis_fails_with_a_clear_error_after_retries() -> None:
    metrics = ControlPlaneMetrics()
    settings = ControlPlaneSettings(
        redis=RedisSettings(
            url=f"redis://127.0.0.1:{free_port()}/0", retry_attempts=2, retry_backoff_s=0.01
        )
    )
    cp = RedisControlPlane(settings, metrics)
    try:
        with pytest.raises(ControlPlaneUnavailable, match="Redis unreachable while trying to list"):
            await cp.list_engines()
    finally:
        await cp.close()
    assert (
        counter_value(
            metrics, "pdserve_control_plane_redis_retries_total", operation="list_engines"
        )
        == 2
    )
    assert (
        counter_value(metrics, "pdserve_control_plane_redis_errors_total", operation="list_engines")
        == 1
    )


async def test_wrong_password_is_reported_as_an_auth_failure_without_retries() -> None:
    with LocalRedisServer(password="s3cret-pass") as server:
        settings = ControlPlaneSettings(
            redis=RedisSettings(url=server.url, password="wrong", retry_attempts=3)  # type: ignore[arg-type]
        )
        cp = RedisControlPlane(settings, ControlPlaneMetrics())
        try:
            with pytest.raises(ControlPlaneUnavailable) as caught:
                await cp.list_engines()
            assert caught.value.reason == "auth"
            assert "s3cret" not in str(caught.value) and "wrong" not in str(caught.value)
        finally:
            await cp.close()
        good = RedisControlPlane(
            ControlPlaneSettings(redis=RedisSettings(url=server.url, password="s3cret-pass")),  # type: ignore[arg-type]
            ControlPlaneMetrics(),
        )
        try:
            await _ready(good, "authed")
            assert [v.engine_id for v in await good.list_engines()] == ["authed"]
        finally:
            await good.close()


async def test_redis_restart_is_survived_by_clients_and_watchers(namespace: str) -> None:
    with LocalRedisServer() as server:
        settings = ControlPlaneSettings(
            redis=RedisSettings(url=server.url, retry_attempts=20, retry_backoff_s=0.05),
            namespace=namespace,
            resync_interval_s=0.3,
        )
        metrics = ControlPlaneMetrics()
        cp = RedisControlPlane(settings, metrics)
        try:
            first = await _ready(cp, "before")
            async with cp.watch() as watcher:
                await watcher.wait_for("before", EngineState.READY, within_s=5)
                server.kill()
                restart = asyncio.get_running_loop().run_in_executor(None, server.start)
                # Redis lost everything (no persistence): the engine re-registers, as its host
                # does when a heartbeat answers EngineNotFound; scripts are loaded again.
                await restart
                engine = await _ready(cp, "before")
                assert engine.generation > first.generation, "a generation is never reused"
                await watcher.wait_for(
                    "before", EngineState.READY, within_s=10, generation=engine.generation
                )
            assert (
                counter_value(
                    metrics, "pdserve_control_plane_watch_resyncs_total", cause="reconnect"
                )
                >= 1
            )
        finally:
            await cp.close()


def test_status_cli_shows_grid_and_reasons(redis_server: LocalRedisServer, namespace: str) -> None:
    # Nobody heartbeats these engines: the lease must outlast the CLI's start on a busy machine.
    settings = ControlPlaneSettings(
        redis=RedisSettings(url=redis_server.url),
        namespace=namespace,
        lease_ttl_s=300,
        heartbeat_interval_s=60,
    )

    async def prepare() -> None:
        cp = RedisControlPlane(settings, ControlPlaneMetrics())
        try:
            await _ready(cp, "ready-one")
            half = await cp.register(synthetic_spec("half", pp_size=2, tp_size=2))
            await cp.publish_handshakes(half, [synthetic_records(half)[(0, 0)]])
            broken = await cp.register(synthetic_spec("broken", pp_size=1, tp_size=2))
            records = synthetic_records(broken)
            await cp.publish_handshakes(broken, [records[(0, 0)]])
            await cp.connection.client.hset(
                cp.keys.handshakes("broken", broken.generation), "0:1", b"junk"
            )
        finally:
            await cp.close()

    asyncio.run(prepare())
    command = [
        sys.executable,
        "-m",
        "services.cli.main",
        "status",
        "--redis",
        redis_server.url,
        "--namespace",
        namespace,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    report = json.loads(
        subprocess.run(
            [*command, "--json"], capture_output=True, check=True, env=env, timeout=60
        ).stdout
    )
    engines = {e["engine_id"]: e for e in report["engines"]}
    assert engines["ready-one"]["state"] == "ready"
    assert set(engines["ready-one"]["grid"].values()) == {"ok"}
    assert engines["half"]["state"] == "pending"
    assert engines["half"]["grid"] == {
        "0:0": "ok",
        "0:1": "missing",
        "1:0": "missing",
        "1:1": "missing",
    }
    assert engines["broken"]["verdict"] == "invalid"
    assert engines["broken"]["grid"]["0:1"] == "malformed"
    table = subprocess.run(
        command, capture_output=True, check=True, text=True, env=env, timeout=60
    ).stdout
    assert "waiting for ranks 0:1, 1:0, 1:1" in table
    assert "READY" in table and "! malformed" in table


def test_status_cli_with_redis_down_prints_a_clear_error() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "status",
            "--redis",
            f"redis://127.0.0.1:{free_port()}/0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PDSERVE_CONTROL_PLANE__REDIS__RETRY_ATTEMPTS": "1"},
    )
    assert result.returncode == 2
    assert "Redis unreachable" in result.stderr
    assert "Traceback" not in result.stderr
