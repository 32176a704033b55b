"""An engine host survives a Redis restart that lost its registration (no persistence): it
registers again under a new generation, republishes, turns READY and keeps serving; a stream in
flight across the restart finishes. A takeover by another process stays fatal (see
test_stub_host.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole, EngineState
from services.engines.backend import DecodeRequest, FinishReason, SamplingParams
from services.engines.stub import StubBackend, StubOptions
from services.serving.client import EngineClient
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

LEASE_TTL_S = 5.0
HEARTBEAT_S = 0.5
WAIT_S = 120.0
"""Bound of every wait on an event: generous, so that a loaded machine delays, never fails."""


def sample(host_registry: object, name: str, **labels: str) -> float:
    value = host_registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return 0.0 if value is None else float(value)


async def ready_generation(cp: RedisControlPlane, engine_id: str) -> int | None:
    view = await cp.get_engine(engine_id)
    return view.generation if view is not None and view.state is EngineState.READY else None


async def test_stub_engine_host_registers_again_and_serves_after_redis_restart(
    namespace: str,
) -> None:
    with LocalRedisServer() as server:
        cp_settings = ControlPlaneSettings(
            redis=RedisSettings(url=server.url, retry_attempts=3, retry_backoff_s=0.05),
            namespace=namespace,
            lease_ttl_s=LEASE_TTL_S,
            heartbeat_interval_s=HEARTBEAT_S,
            resync_interval_s=0.3,
        )
        settings = service_settings(cp_settings)
        cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
        try:
            async with (
                hosted(
                    settings, StubBackend(), engine_id="prefill-r", role=EngineRole.PREFILL
                ) as pre,
                hosted(
                    settings,
                    StubBackend(StubOptions(token_delay_s=0.02)),
                    engine_id="decode-r",
                    role=EngineRole.DECODE,
                ) as dec,
            ):
                before = {
                    "prefill-r": pre.endpoints.generation,
                    "decode-r": dec.endpoints.generation,
                }
                decode_client = EngineClient(dec.endpoints.grpc)
                prefill_client = EngineClient(pre.endpoints.grpc)
                stream = decode_client.decode(
                    DecodeRequest("in-flight", (1, 2, 3), SamplingParams(max_tokens=100))
                )
                first_delta = await anext(stream)

                await asyncio.to_thread(server.restart)
                deadline = time.monotonic() + WAIT_S
                assert await cp.get_engine("prefill-r") is None, "the restart lost every key"

                after: dict[str, int | None] = dict.fromkeys(before)
                while any(after[e] is None or after[e] == before[e] for e in before):
                    assert time.monotonic() < deadline, f"not READY again: {after}"
                    await asyncio.sleep(0.05)
                    for engine_id in before:
                        after[engine_id] = await ready_generation(cp, engine_id)
                assert all(after[e] > before[e] for e in before)  # type: ignore[operator]
                assert not pre.task.done() and not dec.task.done(), "no host may exit"

                # The stream in flight across the restart finished normally.
                rest = [delta async for delta in stream]
                tokens = [t for d in [first_delta, *rest] for t in d.token_ids]
                assert len(tokens) == 100
                assert rest[-1].finish_reason is FinishReason.LENGTH

                # Health SERVING again; new handles carry the new generation.
                deadline = time.monotonic() + WAIT_S
                while not await prefill_client.health():
                    assert time.monotonic() < deadline, "health never SERVING again"
                    await asyncio.sleep(0.05)
                result = await prefill_client.prefill(
                    "after", (4, 5, 6), SamplingParams(max_tokens=4)
                )
                assert result.kv_handle is not None
                assert result.kv_handle.generation == after["prefill-r"]
                assert pre.host.endpoints is not None
                assert pre.host.endpoints.generation == after["prefill-r"]
                # The decode engine's producer gate accepts the new handle.
                deltas = [
                    d
                    async for d in decode_client.decode(
                        DecodeRequest(
                            "after",
                            (4, 5, 6),
                            SamplingParams(max_tokens=4),
                            kv_handle=result.kv_handle,
                            first_token_id=result.first_token_id,
                        )
                    )
                ]
                assert deltas[-1].finish_reason is FinishReason.LENGTH

                for running, role in ((pre, "prefill"), (dec, "decode")):
                    registry = running.host.registry
                    labels = {"engine": running.host.engine_id, "role": role}
                    assert sample(registry, "pdserve_engine_reregistrations_total", **labels) == 1
                    assert (
                        sample(
                            registry,
                            "pdserve_engine_heartbeat_failures_total",
                            reason="engine_not_found",
                            **labels,
                        )
                        >= 1
                    )
                await decode_client.close()
                await prefill_client.close()
            # The clean stop deregistered the new generations.
            assert await pre.exit_code() == 0 and await dec.exit_code() == 0
            assert await cp.get_engine("prefill-r") is None
            assert await cp.get_engine("decode-r") is None
        finally:
            await cp.close()


async def test_heartbeats_failing_while_redis_is_down_are_counted_and_the_host_serves_on(
    namespace: str,
) -> None:
    with LocalRedisServer() as server:
        cp_settings = ControlPlaneSettings(
            redis=RedisSettings(url=server.url, retry_attempts=2, retry_backoff_s=0.02),
            namespace=namespace,
            lease_ttl_s=LEASE_TTL_S,
            heartbeat_interval_s=HEARTBEAT_S,
            resync_interval_s=0.3,
        )
        settings = service_settings(cp_settings)
        async with hosted(
            settings, StubBackend(), engine_id="decode-r", role=EngineRole.DECODE
        ) as dec:
            registry = dec.host.registry
            labels = {"engine": "decode-r", "role": "decode", "reason": "unavailable"}
            await asyncio.to_thread(server.kill)
            try:
                deadline = time.monotonic() + WAIT_S
                while sample(registry, "pdserve_engine_heartbeat_failures_total", **labels) < 2:
                    assert time.monotonic() < deadline, "heartbeat failures not counted"
                    await asyncio.sleep(0.05)
                assert not dec.task.done(), "a Redis outage must not stop the host"
                client = EngineClient(dec.endpoints.grpc)
                deltas = [
                    d
                    async for d in client.decode(
                        DecodeRequest("during-outage", (1, 2), SamplingParams(max_tokens=3))
                    )
                ]
                assert deltas[-1].finish_reason is FinishReason.LENGTH
                await client.close()
            finally:
                await asyncio.to_thread(server.start)
            # Redis is back empty: the host registers again.
            cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
            try:
                deadline = time.monotonic() + WAIT_S
                while await ready_generation(cp, "decode-r") is None:
                    assert time.monotonic() < deadline, "not READY again after the outage"
                    await asyncio.sleep(0.05)
            finally:
                await cp.close()
        assert await dec.exit_code() == 0
