"""Engine servers accept the router's keepalive pings on idle channels.

With gRPC's default server policy, a client pinging without calls in flight is answered with
GOAWAY ``too_many_pings`` after a few pings, and the idle channel drops (state leaves READY).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.serving.client.grpc_aio import channel_options, server_options

pytestmark = pytest.mark.integration

FAST_PINGS = [
    *[opt for opt in channel_options(1 << 20) if opt[0] != "grpc.keepalive_time_ms"],
    ("grpc.keepalive_time_ms", 500),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging while idle
]


async def _idle_channel_stays_ready(options: list[tuple[str, object]]) -> bool:
    server = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=FAST_PINGS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            for _ in range(40):  # 4 s idle: 8 pings
                await asyncio.sleep(0.1)
                if channel.get_state() is not grpc.ChannelConnectivity.READY:
                    return False
            return True
    finally:
        await server.stop(None)


async def test_engine_server_options_keep_idle_pinging_channels_open() -> None:
    assert await _idle_channel_stays_ready(server_options(1 << 20))


async def test_default_server_policy_drops_them() -> None:
    # The control: proves the check above can fail.
    assert not await _idle_channel_stays_ready(channel_options(1 << 20))
