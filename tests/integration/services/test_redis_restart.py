"""An engine host survives a Redis restart that lost its registration (no persistence): it
registers again under a new generation, republishes, turns READY and keeps serving; a stream in
flight across the restart finishes. A takeover by another process stays fatal (see
test_stub_host.py). A router (in process, real HTTP through its ASGI app, real gRPC to the
hosts) serves through a Redis outage longer than the lease and the producer-view staleness bound
without a failed request, and answers 503 (never 404) once no engine is left (issue 49)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole, EngineState
from services.engines.requests import DecodeRequest, FinishReason, SamplingParams
from services.engines.stub import StubBackend, StubOptions
from services.router.runtime import RouterRuntime
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.integration.services.conftest import hosted, service_settings
from tests.integration.services.routed_load import (
    STUB_MODEL,
    StreamingLoad,
    routed,
    wait_until,
)

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
                decode_client = GrpcAioEngineClient(dec.endpoints.grpc)
                prefill_client = GrpcAioEngineClient(pre.endpoints.grpc)
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
                client = GrpcAioEngineClient(dec.endpoints.grpc)
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


def router_sample(rt: RouterRuntime, name: str, **labels: str) -> float:
    return sample(rt.metrics.registry, name, **labels)


async def test_a_router_serves_through_a_redis_outage_longer_than_the_lease_and_the_bound(
    namespace: str,
) -> None:
    """1P+1D and 4 clients streaming in a loop; Redis SIGKILLed for longer than the lease TTL
    and the decode engine's producer-view staleness bound, then started again empty: no request
    fails, the router's view stays (and says how stale it is), the engines register again at
    new generations and the router takes those, no host restarts. Then both engines stop: a
    503 naming the cause, not the 404 "model does not exist" of before."""
    lease_ttl_s, max_stale_s = 1.5, 1.0
    outage_s = 2 * lease_ttl_s
    with LocalRedisServer() as server:
        cp_settings = ControlPlaneSettings(
            redis=RedisSettings(
                url=server.url, retry_attempts=1, retry_backoff_s=0.05, retry_backoff_max_s=0.3
            ),
            namespace=namespace,
            lease_ttl_s=lease_ttl_s,
            heartbeat_interval_s=0.5,
            resync_interval_s=0.3,
        )
        settings = service_settings(cp_settings, producer_view_max_stale_s=max_stale_s)
        async with (
            hosted(settings, StubBackend(), engine_id="p1", role=EngineRole.PREFILL) as pre,
            hosted(
                settings,
                StubBackend(StubOptions(token_delay_s=0.005)),
                engine_id="d1",
                role=EngineRole.DECODE,
            ) as dec,
            # Generous: a loaded machine may take long to register again; the expiry is
            # tests/unit/router/scheduling/test_outage_holdover.py's.
            routed(cp_settings, control_plane_holdover_s=WAIT_S) as (rt, http),
        ):
            before = {s.engine_id: s.record.generation for s in rt.pool.slots()}

            def new_pair() -> bool:
                now = {s.engine_id: s.record.generation for s in rt.pool.slots()}
                return now.keys() == before.keys() and all(now[e] > before[e] for e in before)

            async with StreamingLoad(http) as load:
                await wait_until(lambda: len(load.done) >= 8, "requests before the outage")
                await asyncio.to_thread(server.kill)
                killed_at = time.monotonic()
                await wait_until(
                    lambda: (
                        rt.pool.control_plane_unreachable_s() > outage_s
                        and load.served_since(killed_at) >= 8
                    ),
                    "an outage longer than the lease, requests served in it",
                )
                health = await http.get("/health")
                assert health.status_code == 200, health.text
                assert health.json()["control_plane"]["reachable"] is False
                assert health.json()["control_plane"]["unreachable_s"] >= outage_s
                unreachable = "pdserve_router_control_plane_unreachable_seconds"
                assert router_sample(rt, unreachable) > outage_s
                await asyncio.to_thread(server.start)  # back, empty
                restarted_at = time.monotonic()
                await wait_until(new_pair, "both engines READY at new generations")
                assert rt.pool.held() == []
                assert rt.pool.control_plane_unreachable_s() == 0
                await wait_until(
                    lambda: load.served_since(restarted_at) >= 8, "requests after the outage"
                )
            assert load.failures == []
            assert not pre.task.done() and not dec.task.done(), "no host may restart"
            for running in (pre, dec):
                labels = {"engine": running.host.engine_id, "role": running.host.role.value}
                registry = running.host.registry
                # (more than once when a loaded machine starves a 1.5 s lease)
                assert sample(registry, "pdserve_engine_reregistrations_total", **labels) >= 1
            # The decode engine checked producers while Redis was down, from the views it
            # remembered (a refusal, had the view been stale when the outage began, runs the
            # request on the decode engine alone: counted, not failed).
            checked = [
                sample(
                    dec.host.registry,
                    "pdserve_engine_producer_check_fallbacks_total",
                    engine="d1",
                    role="decode",
                    outcome=outcome,
                )
                for outcome in ("last_known", "refused")
            ]
            assert sum(checked) >= 1

            # No engine left: the served model is answered 503 naming the cause.
            pre.stop.set()
            dec.stop.set()
            assert await pre.exit_code() == 0 and await dec.exit_code() == 0
            await wait_until(lambda: not rt.pool.slots(), "the pool to empty")
            answer = await http.post(
                "/v1/completions", json={"model": STUB_MODEL, "prompt": "a", "max_tokens": 2}
            )
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["message"] == (
                f"no engine registered in the control plane serves '{STUB_MODEL}'"
            )
            assert (await http.get("/health")).status_code == 503
