"""``pdserve bench router``: the router's own cost, next to vllm-router, in the same run.

Two systems, each a router in front of one instant prefill and one instant decode engine:

- **pdserve**: ``pdserve router`` (subprocess) over the control plane (embedded Redis) and two
  ``pdserve prefill|decode --engine stub`` engines (gRPC, no model: tokens are instant);
- **vllm-router**: ``vllm-router --vllm-pd-disaggregation`` (the Rust router from PyPI) over
  two minimal OpenAI-compatible HTTP stubs served by this module (:func:`stub_app`), which
  answer instantly as a vLLM prefill (``max_tokens=1``, ``kv_transfer_params`` back) and a
  vLLM decode would.

Figures, per system:

- ``added_latency_ms``: p50/p99 of a request through the router minus the p50 of the same
  engine calls made directly by the client (prefill then decode: gRPC ``EngineClient`` for
  pdserve, HTTP for the stubs), one request at a time;
- ``load``: for each concurrency, a closed loop of that many clients for ``--duration-s``:
  completed requests/s, p50/p99 latency, errors; ``max_sustained_rps`` is the highest rate at a
  concurrency with no error.

The load generator is this process (``httpx``, one event loop), the same for both systems, and
everything shares this machine's cores: the figures compare the routers under equal
conditions; they are not what either reaches on dedicated hardware. ``machine`` says what ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.bench.stats import percentiles
from services.config import ControlPlaneSettings
from services.control_plane.local_redis import LocalRedisServer, free_port
from services.engines.backend import DecodeRequest, SamplingParams
from services.serving.ready import parse_ready_line, pdserve_argv

PROMPT = "Hello, world! The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 4
START_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 20

Send = Callable[[], Awaitable[None]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=3.0, help="measured seconds per concurrency"
    )
    parser.add_argument(
        "--latency-requests", type=int, default=200, help="sequential requests for latency"
    )
    parser.add_argument(
        "--skip-vllm-router", action="store_true", help="measure pdserve only (no reference)"
    )


# -- the HTTP stub engines behind vllm-router -----------------------------------------------------


def stub_app(role: str) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app answering like an instant vLLM prefill or decode server: ``/health``,
    ``/v1/models`` and (chat) completions with ``max_tokens`` tokens and, for a prefill,
    ``kv_transfer_params``. Raw ASGI (no framework) so the stub costs as little as possible."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if scope["method"] == "POST" and path.startswith("/v1/"):
            payload = _stub_completion(role, path, json.loads(body or b"{}"))
        elif path == "/v1/models":
            payload = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
        else:
            payload = {"status": "ok"}
        data = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return app


def _stub_completion(role: str, path: str, request: dict[str, Any]) -> dict[str, Any]:
    count = int(request.get("max_tokens") or request.get("max_completion_tokens") or 1)
    text = "".join(f" t{i}" for i in range(count))
    chat = path.endswith("/chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.get("model", "stub"),
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": count, "total_tokens": 8 + count},
    }
    if role == "prefill":
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0, 1],
            "remote_engine_id": "stub-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
    return body


def _serve_stub(role: str, port: int) -> None:
    import uvicorn  # noqa: PLC0415 - only the stub subprocess needs it

    uvicorn.run(stub_app(role), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- processes ------------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    process: asyncio.subprocess.Process
    log_path: Path
    """Its stderr."""
    announced: dict[str, Any] | None = None

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return "\n".join(f"    {line}" for line in text.splitlines()[-lines:])
        return "    (no log)"


async def _start(
    name: str, argv: Sequence[str], log_dir: Path, *, wait_ready_line: bool
) -> Service:
    """Start ``argv`` (its own process group; stderr to ``log_dir/<name>.log``); with
    ``wait_ready_line``, wait up to ``START_TIMEOUT_S`` for its ``PDSERVE_READY`` line."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE if wait_ready_line else asyncio.subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    service = Service(name, process, log_path)
    if not wait_ready_line:
        return service
    with contextlib.suppress(TimeoutError):
        service.announced = await asyncio.wait_for(_ready_line(process), START_TIMEOUT_S)
    if service.announced is None:
        await service.stop()
        raise RuntimeError(
            f"{name} did not announce itself within {START_TIMEOUT_S}s (exit status "
            f"{process.returncode}); the end of its stderr ({log_path}):\n{service.log_tail()}"
        )
    return service


async def _ready_line(process: asyncio.subprocess.Process) -> dict[str, Any] | None:
    """The payload of the process's ready line; ``None`` if its stdout ends first."""
    assert process.stdout is not None
    while line := await process.stdout.readline():
        announced = parse_ready_line(line.decode(errors="replace"))
        if announced is not None:
            return announced
    return None


async def _wait_http(url: str, method: str = "GET", body: Any = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                response = await client.request(method, url, json=body)
                if response.status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {START_TIMEOUT_S}s")


# -- measuring ------------------------------------------------------------------------------------


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    p50, p99 = percentiles(samples, (50, 99))
    return {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3}


async def _sequential(send: Send, count: int) -> list[float]:
    for _ in range(min(20, count)):  # warm connections and caches
        await send()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await send()
        samples.append(time.perf_counter() - started)
    return samples


async def _closed_loop(send: Send, concurrency: int, duration_s: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    stop_at = 0.0

    async def client() -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                await send()
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)

    stop_at = time.perf_counter() + min(1.0, duration_s / 3)  # warm-up
    await asyncio.gather(*(client() for _ in range(concurrency)))
    latencies.clear()
    errors = 0
    started = time.perf_counter()
    stop_at = started + duration_s
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests_per_s": len(latencies) / elapsed,
        "errors": errors,
        **_percentiles(latencies),
    }


def _http_sender(client: httpx.AsyncClient, url: str) -> Send:
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}

    async def send() -> None:
        response = await client.post(url, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")

    return send


async def _measure(
    router_send: Send, direct_send: Send, args: argparse.Namespace
) -> dict[str, Any]:
    direct = await _sequential(direct_send, args.latency_requests)
    routed = await _sequential(router_send, args.latency_requests)
    (direct_p50,) = percentiles(direct, (50,))
    added = [sample - direct_p50 for sample in routed]
    load = [
        await _closed_loop(router_send, int(level), args.duration_s)
        for level in args.concurrency.split(",")
        if level.strip()
    ]
    clean = [entry["requests_per_s"] for entry in load if entry["errors"] == 0]
    return {
        "direct_latency_ms": _percentiles(direct),
        "router_latency_ms": _percentiles(routed),
        "added_latency_ms": _percentiles(added),
        "load": load,
        "max_sustained_rps": max(clean) if clean else 0.0,
    }


async def _bench_pdserve(
    args: argparse.Namespace, settings: ControlPlaneSettings, log_dir: Path
) -> dict[str, Any]:
    # Imported here: the gRPC client is only needed for the direct baseline.
    from services.serving.client import EngineClient  # noqa: PLC0415

    cp = ["--redis", settings.redis.url, "--namespace", settings.namespace]
    services: list[Service] = []
    try:
        for role in ("prefill", "decode"):
            services.append(
                await _start(
                    role,
                    pdserve_argv(
                        role,
                        *cp,
                        "--engine",
                        "stub",
                        "--engine-id",
                        f"bench-{role}",
                        "--listen",
                        "127.0.0.1:0",
                    ),
                    log_dir,
                    wait_ready_line=True,
                )
            )
        router = await _start(
            "router",
            pdserve_argv("router", *cp, "--port", "0", "--policy", "least_loaded"),
            log_dir,
            wait_ready_line=True,
        )
        services.append(router)
        assert router.announced is not None
        url = str(router.announced["url"])
        await _wait_http(f"{url}/health")
        prefill = EngineClient(str((services[0].announced or {})["grpc"]))
        decode = EngineClient(str((services[1].announced or {})["grpc"]))
        tokens = [1 + (byte % 250) for byte in PROMPT.encode()]
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

        async def direct() -> None:
            request_id = uuid.uuid4().hex
            result = await prefill.prefill(request_id, tokens, sampling)
            request = DecodeRequest(
                request_id, tuple(tokens), sampling, result.kv_handle, result.first_token_id
            )
            async for _ in decode.decode(request):
                pass

        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            result = await _measure(_http_sender(client, f"{url}/v1/completions"), direct, args)
        await prefill.close()
        await decode.close()
        return result
    finally:
        for service in reversed(services):
            await service.stop()


def _vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable (next to this Python first, then on ``PATH``)."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


async def _bench_vllm_router(
    args: argparse.Namespace, binary: str, log_dir: Path
) -> dict[str, Any]:
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    services: list[Service] = []
    try:
        for role in ("prefill", "decode"):
            argv = [
                sys.executable,
                "-m",
                "services.bench.router",
                "--serve-stub",
                role,
                str(ports[role]),
            ]
            services.append(await _start(f"stub-{role}", argv, log_dir, wait_ready_line=False))
        for role in ("prefill", "decode"):
            await _wait_http(f"http://127.0.0.1:{ports[role]}/health")
        prefill_url = f"http://127.0.0.1:{ports['prefill']}"
        decode_url = f"http://127.0.0.1:{ports['decode']}"
        router_argv = [
            binary, "--vllm-pd-disaggregation",
            "--prefill", prefill_url, "--decode", decode_url,
            "--host", "127.0.0.1", "--port", str(ports["router"]),
            "--policy", "round_robin", "--log-level", "warning",
        ]  # fmt: skip
        services.append(await _start("vllm-router", router_argv, log_dir, wait_ready_line=False))
        url = f"http://127.0.0.1:{ports['router']}"
        body = {"model": "stub", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        await _wait_http(f"{url}/v1/completions", "POST", body)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            prefill_send = _http_sender(client, f"{prefill_url}/v1/completions")
            decode_send = _http_sender(client, f"{decode_url}/v1/completions")

            async def direct() -> None:
                await prefill_send()
                await decode_send()

            return await _measure(_http_sender(client, f"{url}/v1/completions"), direct, args)
    finally:
        for service in reversed(services):
            await service.stop()


def run(args: argparse.Namespace, settings: ControlPlaneSettings) -> dict[str, Any]:
    local: LocalRedisServer | None = None
    if args.redis is None:
        local = LocalRedisServer().start()
        settings = settings.model_copy(
            update={"redis": settings.redis.model_copy(update={"url": local.url})}
        )
    settings = settings.model_copy(update={"namespace": f"bench-{uuid.uuid4().hex[:8]}"})
    # Every child's stderr; kept when the run fails (errors name the files), removed after.
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    try:
        pdserve = asyncio.run(_bench_pdserve(args, settings, log_dir))
        binary = _vllm_router_binary()
        reference: dict[str, Any]
        if args.skip_vllm_router:
            reference = {"skipped": True}
        elif binary is None:
            reference = {"error": "vllm-router is not installed: pip install -e '.[bench]'"}
        else:
            reference = asyncio.run(_bench_vllm_router(args, binary, log_dir))
        shutil.rmtree(log_dir, ignore_errors=True)
    finally:
        if local is not None:
            local.stop()
    result: dict[str, Any] = {
        "benchmark": "router",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "request": {"endpoint": "/v1/completions", "max_tokens": MAX_TOKENS, "stream": False},
        "pdserve": pdserve,
        "vllm_router": reference,
    }
    if "added_latency_ms" in reference:
        result["comparison"] = {
            "added_p50_ms": {
                "pdserve": pdserve["added_latency_ms"]["p50_ms"],
                "vllm_router": reference["added_latency_ms"]["p50_ms"],
            },
            "added_p50_no_worse": pdserve["added_latency_ms"]["p50_ms"]
            <= reference["added_latency_ms"]["p50_ms"],
            "rps_ratio": pdserve["max_sustained_rps"] / reference["max_sustained_rps"]
            if reference["max_sustained_rps"]
            else None,
        }
    return result


if __name__ == "__main__":  # python -m services.bench.router --serve-stub ROLE PORT
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-stub":
        _serve_stub(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m services.bench.router --serve-stub prefill|decode PORT")
