"""A router in process over in-process engine hosts, and streamed load through it: for tests
of faults under load that need no ``pdserve up`` stack (real Redis, real gRPC, real HTTP through
the router's ASGI app; the client counts every request that did not end with ``[DONE]`` and no
error as failed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import httpx

from services.config import ControlPlaneSettings
from services.router.config import RouterSettings
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import checkpoint

STUB_MODEL = "stub"
"""The model the stub engines register (the router serves the synthetic checkpoint as it)."""

WAIT_S = 120.0
"""Bound of every wait on an event: generous, so that a loaded machine delays, never fails."""


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def routed(
    cp_settings: ControlPlaneSettings, **overrides: object
) -> AsyncIterator[tuple[RouterRuntime, httpx.AsyncClient]]:
    """The router app following ``cp_settings``'s control plane (its lifespan run: the real
    runtime, gRPC to the engines), once it has a READY pair, and an HTTP client of it."""
    settings = RouterSettings.model_validate(
        {
            "policy": "least_loaded",
            "tokenizer": checkpoint(),
            "served_model_name": STUB_MODEL,
            "control_plane": cp_settings,
            **overrides,
        }
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        runtime: RouterRuntime = app.state.runtime
        await wait_until(runtime.scheduler.ready, "the router's READY pair")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", timeout=WAIT_S
        ) as client:
            yield runtime, client


class StreamingLoad:
    """``clients`` loops of streamed completions through ``http`` while the block runs."""

    def __init__(self, http: httpx.AsyncClient, clients: int = 4) -> None:
        self._http = http
        self._count = clients
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.done: list[float] = []
        """When each complete answer ended (``time.monotonic()``)."""
        self.failures: list[str] = []

    def served_since(self, moment: float) -> int:
        return sum(ended > moment for ended in self.done)

    async def __aenter__(self) -> StreamingLoad:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self._count)]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self) -> None:
        body = {"model": STUB_MODEL, "prompt": "hello there", "max_tokens": 6, "stream": True}
        while not self._stop.is_set():
            try:
                async with self._http.stream("POST", "/v1/completions", json=body) as answer:
                    text = (await answer.aread()).decode()
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                continue
            complete = text.endswith("data: [DONE]\n\n") and '"error"' not in text
            if answer.status_code == 200 and complete:
                self.done.append(time.monotonic())
            else:
                self.failures.append(f"{answer.status_code}: {text[-300:]}")
