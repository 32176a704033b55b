"""``pdserve bench router --huge-prompt-mb N``: do huge prompts hold up small requests?

One pdserve router (its front end, vLLM's, over the generated tiny checkpoint's tokenizer) in
front of a stub prefill and a stub decode engine. One client sends small completions one at a
time for ``--latency-s`` (the quiet run); then the same again while a second client sends one
prompt of N MB every second. The figure is the ratio of the small requests' p99 (and p50)
under the huge prompts to the quiet run's: measured in one run on one machine, it holds where
an absolute time does not (issue 36's goal: p99 within 2x).

The router runs with ``max_request_body_bytes`` raised to fit the huge body (with the default
it is refused 413 before it is parsed); each huge prompt is tokenized by the front end (vLLM's
renderer, off the event loop) and refused for its length (400), as against a real engine. The
huge requests' statuses and durations are reported beside the ratio. The huge prompts go from a
thread of their own, encoded once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import start, stop
from services.bench.router_load import Placement, wait_http
from services.bench.stats import percentiles
from services.config import ControlPlaneSettings
from services.engines.reference.tiny_model import make_tiny_model
from services.serving.ready import pdserve_argv
from services.supervision import ChildProcess

HUGE_INTERVAL_S = 1.0
SMALL_BODY = {"prompt": "Tell me something short.", "max_tokens": 4, "temperature": 0}
TINY_VOCAB = 384
"""The generated tiny checkpoint's vocabulary (``pdserve make-tiny-model``)."""


async def bench_huge_prompts(
    huge_mb: float,
    latency_s: float,
    settings: ControlPlaneSettings,
    placement: Placement,
    log_dir: Path,
) -> dict[str, Any]:
    """Start the router and stubs, measure both runs, stop them; the JSON section."""
    model = make_tiny_model(log_dir / "huge-tiny-model")
    cp = ["--redis", settings.redis.url, "--namespace", settings.namespace]
    huge_bytes = int(huge_mb * 2**20)
    services: list[ChildProcess] = []
    try:
        for role in ("prefill", "decode"):
            argv = pdserve_argv(
                role, *cp, "--engine", "stub", "--engine-id", f"huge-{role}",
                "--listen", "127.0.0.1:0", "--stub-vocab-size", str(TINY_VOCAB),
            )  # fmt: skip
            services.append(
                await start(
                    f"huge-{role}", argv, log_dir, cores=placement.others, wait_ready_line=True
                )
            )
        router_argv = pdserve_argv(
            "router", *cp, "--port", "0", "--policy", "least_loaded",
            "--tokenizer", str(model), "--served-model-name", "stub",
        )  # fmt: skip
        router = await start(
            "huge-router",
            router_argv,
            log_dir,
            cores=placement.router,
            wait_ready_line=True,
            env={"PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES": str(2 * huge_bytes)},
        )
        services.append(router)
        assert router.announced is not None
        url = str(router.announced["url"])
        await wait_http(f"{url}/health", service=router)
        return await _measure(url, huge_bytes, latency_s)
    finally:
        for service in reversed(services):
            await stop(service)


async def _measure(url: str, huge_bytes: int, latency_s: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as small:
        model = (await small.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, **SMALL_BODY}
        await _small_run(small, body, 1.0)  # warm-up
        quiet = await _small_run(small, body, latency_s)
        words = "hello world, this is a rather long prompt. "
        text = (words * (huge_bytes // len(words) + 1))[:huge_bytes]
        # Encoded once, sent from a thread with its own client: the small client's loop never
        # waits on encoding or writing megabytes (the load generator is not the bottleneck).
        payload = json.dumps({"model": model, "prompt": text, "max_tokens": 1}).encode()
        outcomes: list[tuple[int, float]] = []
        stop = threading.Event()
        sender = threading.Thread(target=_send_huge, args=(url, payload, outcomes, stop))
        sender.start()
        try:
            await asyncio.sleep(HUGE_INTERVAL_S / 2)  # the first huge prompt is in
            loaded = await _small_run(small, body, latency_s)
        finally:
            stop.set()
            await asyncio.to_thread(sender.join)
    quiet_p = _figures(quiet)
    loaded_p = _figures(loaded)
    statuses: dict[str, int] = {}
    for status, _ in outcomes:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "huge_prompt_bytes": huge_bytes,
        "huge_every_s": HUGE_INTERVAL_S,
        "small_quiet_ms": quiet_p,
        "small_under_huge_ms": loaded_p,
        "p50_ratio": _ratio(loaded_p["p50"], quiet_p["p50"]),
        "p99_ratio": _ratio(loaded_p["p99"], quiet_p["p99"]),
        "huge_requests": {
            "answered": len(outcomes),
            "statuses": statuses,
            "seconds_p50": percentiles([s for _, s in outcomes], [50])[0] if outcomes else None,
        },
    }


async def _small_run(
    client: httpx.AsyncClient, body: dict[str, Any], seconds: float
) -> list[float]:
    """Latencies (ms) of small completions one at a time for ``seconds``; an error fails."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        reply = await client.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"a small request failed: {reply.status_code} {reply.text}")
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def _send_huge(
    url: str, payload: bytes, outcomes: list[tuple[int, float]], stop: threading.Event
) -> None:
    """One huge prompt every :data:`HUGE_INTERVAL_S` (the next one at once when one took
    longer), until ``stop``."""
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            started = time.perf_counter()
            reply = client.post(
                "/v1/completions", content=payload, headers={"content-type": "application/json"}
            )
            elapsed = time.perf_counter() - started
            outcomes.append((reply.status_code, elapsed))
            stop.wait(max(0.0, HUGE_INTERVAL_S - elapsed))


def _figures(latencies: list[float]) -> dict[str, Any]:
    p50, p99 = percentiles(latencies, [50, 99])
    return {"requests": len(latencies), "p50": round(p50, 3), "p99": round(p99, 3)}


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 2) if base else None
