"""The stacks and the load of ``pdserve bench goodput`` (:mod:`services.bench.goodput`): a
``pdserve up`` per layout (:func:`start_stack`), an open-loop client of Poisson arrivals of
streamed completions (:func:`open_loop`), each request's :class:`Outcome` against the
:class:`Slo`, the engine processes sampled while it runs, and the figures of a run
(:func:`figures_of`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import children_with_arg
from services.bench.soak import percentiles_ms
from services.bench.sse import StreamFailed, completion_events
from services.bench.up_stack import wait_endpoints
from services.supervision import DetachedProcess

SAMPLE_S = 0.5
"""How often the engine processes are counted while a load runs (``sample=True``)."""


@dataclass
class Outcome:
    scheduled_s: float
    sent_s: float = 0.0
    ok: bool = False
    ttft_s: float | None = None
    itl_s: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Slo:
    ttft_s: float
    itl_s: float

    def met(self, outcome: Outcome) -> bool:
        return (
            outcome.ok
            and outcome.ttft_s is not None
            and outcome.ttft_s <= self.ttft_s
            and (outcome.itl_s is None or outcome.itl_s <= self.itl_s)
        )


@dataclass
class Stack:
    up: DetachedProcess
    work_dir: Path
    router: str = ""
    model: str = ""
    max_model_len: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)


def start_stack(
    args: argparse.Namespace,
    work_dir: Path,
    prefill: int,
    decode: int,
    extra: list[str] | None = None,
    *,
    engine: str = "sim",
) -> Stack:
    work_dir.mkdir(parents=True, exist_ok=True)
    layout = (
        ["--colocated", "--decode-replicas", str(decode)]
        if prefill == 0
        else ["--prefill-replicas", str(prefill), "--decode-replicas", str(decode)]
    )
    up = DetachedProcess.pdserve_up(
        work_dir,
        "--engine", engine,
        *(("--sim-profile", str(args.profile)) if engine == "sim" else ()),
        "--port", "0", *layout, *(extra or []),
    )  # fmt: skip
    stack = Stack(up, work_dir)
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
        stack.router = str(endpoints["router"])
        reply = httpx.get(f"{stack.router}/v1/models", timeout=30)
        served = reply.json()["data"][0]
        stack.model = str(served["id"])
        stack.max_model_len = int(served.get("max_model_len") or 0)
    except BaseException:
        up.stop()  # a stack that never became ready is not left running
        raise
    return stack


async def open_loop(
    args: argparse.Namespace,
    stack: Stack,
    phases: list[tuple[float, float]],
    *,
    sample: bool = False,
) -> list[Outcome]:
    rng = random.Random(args.seed)
    schedule: list[float] = []
    start_of_phase = 0.0
    for rate, seconds in phases:
        at = start_of_phase
        while True:
            at += rng.expovariate(rate)
            if at >= start_of_phase + seconds:
                break
            schedule.append(at)
        start_of_phase += seconds
    prompt = [rng.randrange(32, 256) for _ in range(args.input_tokens)]
    # Idle connections expire before the router's keep-alive (uvicorn: 5 s) closes them, so a
    # request never races a server-side close (an httpx ReadError, not the router's doing).
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=stack.router, limits=limits) as client:
        begin = time.perf_counter()
        sampler = asyncio.create_task(_sample_engines(stack, begin)) if sample else None

        async def one(number: int, at: float) -> Outcome:
            outcome = Outcome(scheduled_s=at)
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            outcome.sent_s = time.perf_counter() - begin
            await _stream(client, stack.model, unshared(prompt, number), args, outcome)
            return outcome

        try:
            return list(await asyncio.gather(*(one(n, at) for n, at in enumerate(schedule))))
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                stack.samples.append((time.perf_counter() - begin, _engine_count(stack)))


def unshared(prompt: list[int], number: int) -> list[int]:
    """``prompt`` with its first two tokens naming request ``number`` (ids 32-255, as the
    prompt's): no two of 50,176 requests share a block, so no engine's prefix cache finds
    any of it and every prompt is computed, as this benchmark measures."""
    return [32 + number // 224 % 224, 32 + number % 224, *prompt[2:]][: len(prompt)]


async def _sample_engines(stack: Stack, begin: float) -> None:
    while True:
        stack.samples.append((time.perf_counter() - begin, _engine_count(stack)))
        await asyncio.sleep(SAMPLE_S)


def _engine_count(stack: Stack) -> int:
    """Engine hosts ``pdserve up`` runs now: started, READY or draining (an engine holds its
    GPU from its start to its exit, whether or not it serves)."""
    return len(children_with_arg(stack.up.pid, "--engine-id"))


async def _stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    args: argparse.Namespace,
    outcome: Outcome,
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first = last = None
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, timeout=args.request_timeout_s
        ) as reply:
            async for event in completion_events(reply):
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
                        outcome.tokens += 1
    except StreamFailed as exc:
        outcome.error = str(exc)
        return
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return
    if first is None or last is None:
        outcome.error = "no token"
        return
    outcome.ok = True
    outcome.ttft_s = first - sent
    if outcome.tokens > 1:
        outcome.itl_s = (last - first) / (outcome.tokens - 1)


def figures_of(outcomes: list[Outcome], slo: Slo, window_s: float) -> dict[str, Any]:
    met = [outcome for outcome in outcomes if slo.met(outcome)]
    done = [outcome for outcome in outcomes if outcome.ok]
    lateness = [max(0.0, o.sent_s - o.scheduled_s) for o in outcomes]
    errors = [o.error for o in outcomes if not o.ok]
    return {
        "requests": len(outcomes),
        "errors": len(errors),
        "first_errors": errors[:3],
        "goodput": round(len(met) / window_s, 3),
        "slo_attainment": round(len(met) / len(outcomes), 4) if outcomes else None,
        "ttft_ms": percentiles_ms([o.ttft_s for o in done if o.ttft_s is not None]),
        "itl_ms": percentiles_ms([o.itl_s for o in done if o.itl_s is not None]),
        "client": {"send_lateness_ms": percentiles_ms(lateness)},
    }
