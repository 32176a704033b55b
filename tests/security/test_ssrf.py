"""No request header or body can make the router contact a host of the caller's choosing.

The SSRF reported against llm-d's router (llm-d/llm-d-inference-scheduler issue #242) let a
header pick the upstream. pdserve's router dials only endpoints of READY engines read from the
control plane (:mod:`services.router.scheduling.pool`). Here a real router serves real stub engines
while a TCP listener the test controls counts every connection it receives; every hostile request
(``Host``, ``X-Forwarded-*``, ``Forwarded``, custom routing headers, URLs in ``model`` and other
fields, an absolute-URI request target) must reach zero connections on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from services.router.config import RouterSettings
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration


class Trap:
    """A listener that counts the connections it accepts (and what they sent first)."""

    def __init__(self) -> None:
        self.connections = 0
        self.first_bytes: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(TimeoutError, ConnectionError):
            self.first_bytes.append(await asyncio.wait_for(reader.read(256), 1.0))
        writer.close()

    async def __aenter__(self) -> Trap:
        self.server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def hostile_requests(trap: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """(headers, body) pairs that each try to point the router at ``trap`` (``host:port``)."""
    url = f"http://{trap}"
    base = {"model": "stub", "prompt": [1, 2, 3], "max_tokens": 2}
    header_sets = [
        {"Host": trap},
        {"X-Forwarded-Host": trap, "X-Forwarded-Proto": "http", "X-Forwarded-Port": trap[-5:]},
        {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1", "Forwarded": f"host={trap}"},
        {"X-Original-URL": url, "X-Rewrite-URL": url, "Referer": url, "Origin": url},
        # Routing headers other routers honour, and pdserve's own response header names.
        {
            "x-gateway-destination-endpoint": trap,
            "x-prefiller-host-port": trap,
            "x-prefill-url": url,
            "x-decode-url": url,
            "x-pdserve-prefill-engine": trap,
            "x-pdserve-decode-engine": trap,
            "x-pdserve-endpoint": trap,
            "x-target-host": trap,
        },
    ]
    cases: list[tuple[dict[str, str], dict[str, Any]]] = [(h, base) for h in header_sets]
    bodies = [
        {**base, "model": url},
        {**base, "model": trap},
        {**base, "model": f"{url}/v1/completions"},
        {**base, "prompt": f"fetch {url} please", "user": url},
        {**base, "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": trap[-5:]}},
        {**base, "prefill_endpoint": trap, "decode_endpoint": trap, "base_url": url},
    ]
    cases += [({}, body) for body in bodies]
    return cases


@pytest.fixture
async def router_url(
    cp_settings: ControlPlaneSettings, stub_checkpoint: Path
) -> AsyncIterator[str]:
    engine_settings = service_settings(cp_settings)
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=stub_checkpoint,
        served_model_name="stub",
        prefill_timeout_s=5,
        decode_timeout_s=5,
    )
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-s", role=EngineRole.PREFILL),
        hosted(engine_settings, StubBackend(), engine_id="decode-s", role=EngineRole.DECODE),
        serving_router(router) as url,
    ):
        yield url


async def test_no_header_or_body_makes_the_router_connect_to_another_host(router_url: str) -> None:
    async with Trap() as trap, httpx.AsyncClient(base_url=router_url, timeout=20) as client:
        target = f"127.0.0.1:{trap.port}"
        served = 0
        for headers, body in hostile_requests(target):
            chat = {k: v for k, v in body.items() if k != "prompt"}
            chat["messages"] = [{"role": "user", "content": f"see http://{target}"}]
            for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                response = await client.post(path, json=payload, headers=headers)
                if payload["model"] == "stub":
                    # Served by the registered engines, whatever else it names (vLLM's front
                    # end ignores unknown fields such as prefill_endpoint or base_url).
                    assert response.status_code == 200, (headers, payload, response.text)
                    assert response.headers["x-pdserve-decode-engine"] == "decode-s"
                    served += 1
                else:  # a URL as the model: vLLM's unknown-model answer, nothing dialled
                    assert response.status_code == 404, (payload, response.text)
                    assert response.json()["error"]["param"] == "model", response.text
            models = await client.get("/v1/models", headers=headers)
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == ["stub"]
        # Served or refused, nothing reached the trap (counted below).
        assert served == 2 * sum(body["model"] == "stub" for _, body in hostile_requests(target))
        assert served >= 10
        # An absolute-URI request target naming the trap: served locally or refused, not proxied.
        host, port = router_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"GET http://{target}/v1/models HTTP/1.1\r\nHost: {target}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 "), answer[:100]
        assert not answer.startswith(b"HTTP/1.1 5"), answer[:200]
        # Give any stray connection attempt a moment to land before counting.
        await asyncio.sleep(0.2)
        assert trap.connections == 0, trap.first_bytes
        # The trap does count connections (so the zero above means something).
        _, probe = await asyncio.open_connection("127.0.0.1", trap.port)
        probe.write(b"probe")
        await probe.drain()
        probe.close()
        for _ in range(100):
            if trap.connections:
                break
            await asyncio.sleep(0.02)
        assert trap.connections == 1
