"""``pdserve bench soak``: sustained load through the whole PD stack, with nothing lost.

Starts ``pdserve up`` (subprocess: embedded Redis, prefill and decode engines, router; the
reference engine on the tiny checkpoint by default, ``--engine stub`` for a quick run), sends
``--warmup`` requests, samples the RSS of every process of the stack from ``/proc``, then runs
``--requests`` streaming completions from ``--concurrency`` concurrent clients with mixed
prompt lengths, samples RSS again and stops the stack.

Figures (JSON):

- ``errors``: requests that did not end with a finish reason, their usage and ``[DONE]``
  (HTTP error, error event, truncated stream, client timeout); must be zero.
  ``error_samples`` shows a few.
- ``client_timeouts``: requests that hit the client-side bound (``--request-timeout-s``); a
  hang shows up here, never as a stuck benchmark.
- ``ttft_ms`` / ``itl_ms``: client-side p50/p90/p99 of time to first token and of the gaps
  between streamed chunks that carry text (a chunk is one token unless the engine held text
  back: an incomplete UTF-8 character, a possible stop string).
- ``requests_per_s``, ``tokens_per_s`` over the measured phase (tokens as the router's
  ``usage.completion_tokens`` counts them, asked for with ``stream_options.include_usage``);
  ``paths``: how the router ran the requests (``x-pdserve-execution-path``).
- ``memory``: each process's RSS (MiB) before and after the measured phase, and the total
  growth. Rank processes are named ``<engine>/rank-<pid>``.

The load generator shares the machine with the stack: the figures compare runs on the same
machine, not what the stack reaches on dedicated hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import descendants
from services.bench.sse import event_data
from services.bench.stats import percentiles
from services.bench.up_stack import served_model, wait_endpoints, work_root
from services.supervision import DetachedProcess

#: Prompt lengths in words, cycled through. The tiny model's context is 512 tokens and a word
#: of these prompts is about 3 tokens, so the longest (~400 tokens) plus ``--max-tokens`` fits:
#: every request generates exactly ``--max-tokens`` (160 words sometimes reached the context,
#: and the engine ends a request at the context limit with ``length``).
DEFAULT_PROMPT_WORDS = (6, 24, 64, 128)
_SENTENCE = (
    "the prefill reads whole prompt at once and decode streams tokens one by one while blocks "
    "move between engines over the data plane under a lease"
)
_WORDS = tuple(_SENTENCE.split())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("reference", "stub"), default="reference")
    parser.add_argument("--requests", type=int, default=2000, help="measured requests")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent clients")
    parser.add_argument("--warmup", type=int, default=64, help="requests before measuring")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    parser.add_argument(
        "--prompt-words",
        default=",".join(str(n) for n in DEFAULT_PROMPT_WORDS),
        help="comma-separated prompt lengths in words, cycled through",
    )
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--prefill-pp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: tiny)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    sent_at: float | None = None
    """``time.perf_counter()`` when the request was sent (a stream's token times are this plus
    the TTFT plus the gaps)."""
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0
    path: str | None = None
    error: str | None = None
    timed_out: bool = False


def run(args: argparse.Namespace) -> dict[str, Any]:
    with work_root(args.work_dir, "soak") as work_dir:
        return _run_in(args, work_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _run_in(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    up = start_up(work_dir, args)
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
        lengths = [int(n) for n in str(args.prompt_words).split(",") if n.strip()]
        model = served_model(str(endpoints["router"]))
        asyncio.run(_load(args, endpoints, model, lengths, args.warmup, seed=1))
        before = process_rss(up.pid, endpoints)
        started = time.perf_counter()
        outcomes = asyncio.run(_load(args, endpoints, model, lengths, args.requests, seed=2))
        elapsed = time.perf_counter() - started
        after = process_rss(up.pid, endpoints)
    finally:
        status = up.stop()
    return summarize(args, outcomes, elapsed, before, after, status)


def start_up(work_dir: Path, args: argparse.Namespace) -> DetachedProcess:
    """``pdserve up`` in a session of its own (its output in ``<work_dir>/up.out``)."""
    return DetachedProcess.pdserve_up(
        work_dir,
        "--engine",
        args.engine,
        "--prefill-pp",
        str(args.prefill_pp),
        "--decode-tp",
        str(args.decode_tp),
        *(["--model", str(args.model)] if args.model is not None else []),
    )


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def process_rss(up_pid: int, endpoints: dict[str, Any]) -> dict[str, float]:
    """RSS (MiB) of every process of the stack, named by role."""
    names = {int(e["pid"]): name for name, e in endpoints.get("engines", {}).items() if e["pid"]}
    result: dict[str, float] = {}
    for pid in descendants(up_pid):
        rss = rss_mib(pid)
        if rss is None:
            continue
        result[_process_name(pid, up_pid, names)] = round(rss, 1)
    return result


def _process_name(pid: int, up_pid: int, engines: dict[int, str]) -> str:
    if pid == up_pid:
        return "up"
    if pid in engines:
        return engines[pid]
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if "redis-server" in cmdline:
            return "redis"
        if " router" in cmdline:
            return "router"
        if "resource_tracker" in cmdline:
            return f"{engines.get(parent, parent)}/resource-tracker-{pid}"
        if parent in engines:
            return f"{engines[parent]}/rank-{pid}"
    return f"pid-{pid}"


def make_prompt(index: int, words: int, rng: random.Random) -> str:
    """A distinct prompt of about ``words`` words (distinct, so prefix caching does not make
    every request a cache hit)."""
    body = " ".join(rng.choice(_WORDS) for _ in range(max(words - 2, 1)))
    return f"request {index} {body}"


async def _load(
    args: argparse.Namespace,
    endpoints: dict[str, Any],
    model: str,
    lengths: list[int],
    count: int,
    *,
    seed: int,
) -> list[Outcome]:
    rng = random.Random(seed)
    prompts = [make_prompt(i, lengths[i % len(lengths)], rng) for i in range(count)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=str(endpoints["router"]), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                outcomes.append(
                    await stream_completion(
                        client, model, prompt, args.max_tokens, args.request_timeout_s
                    )
                )

        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, count))))
    return outcomes


async def stream_completion(
    client: httpx.AsyncClient,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    timeout_s: float,
) -> Outcome:
    """One streaming completion (a text prompt or token ids), timed from the client; never
    raises, never exceeds ``timeout_s`` (a hang is an error with ``timed_out``)."""
    try:
        return await asyncio.wait_for(
            _stream(client, model, prompt, max_tokens, timeout_s), timeout_s
        )
    except TimeoutError:
        return Outcome(ok=False, error=f"client timeout after {timeout_s}s", timed_out=True)
    except httpx.HTTPError as exc:
        return Outcome(ok=False, error=f"{type(exc).__name__}: {exc}")


async def _stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    timeout_s: float,
) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    outcome = Outcome(ok=False, sent_at=sent)
    last: float | None = None
    finished = done = False
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as reply:
        outcome.path = reply.headers.get("x-pdserve-execution-path")
        if reply.status_code != 200:
            outcome.error = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
            return outcome
        async for data in event_data(reply):
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                outcome.error = str(event["error"])[:300]
                return outcome
            if event.get("usage"):
                # The router's count of generated tokens (a text chunk may hold several, or
                # none while an incomplete character or a possible stop string is held back).
                outcome.tokens = int(event["usage"]["completion_tokens"])
            for choice in event.get("choices", []):
                now = time.perf_counter()
                # (a first chunk without text but with the finish still ends the TTFT: a
                # single token whose text is held back, an incomplete character)
                if choice.get("text") or (last is None and choice.get("finish_reason")):
                    if last is None:
                        outcome.ttft_s = now - sent
                    else:
                        outcome.itls_s.append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    finished = True
    outcome.ok = finished and done and outcome.tokens > 0
    if not outcome.ok:
        missing = "a finish reason" if not finished else "[DONE]" if not done else "its usage"
        outcome.error = f"stream ended without {missing}"
    return outcome


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    p50, p90, p99 = (round(value * 1000, 2) for value in percentiles(values, (50, 90, 99)))
    return {"p50": p50, "p90": p90, "p99": p99, "count": len(values)}


def summarize(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    elapsed_s: float,
    before: dict[str, float],
    after: dict[str, float],
    up_status: int,
) -> dict[str, Any]:
    errors = [o for o in outcomes if not o.ok]
    paths: dict[str, int] = {}
    for outcome in outcomes:
        paths[outcome.path or "none"] = paths.get(outcome.path or "none", 0) + 1
    growth = {
        name: round(after[name] - before[name], 1) for name in sorted(before) if name in after
    }
    tokens = sum(o.tokens for o in outcomes)
    return {
        "engine": args.engine,
        "requests": len(outcomes),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "errors": len(errors),
        "client_timeouts": sum(o.timed_out for o in outcomes),
        "error_samples": sorted({o.error or "" for o in errors})[:5],
        "duration_s": round(elapsed_s, 2),
        "requests_per_s": round(len(outcomes) / elapsed_s, 2) if elapsed_s else None,
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s else None,
        "ttft_ms": percentiles_ms([o.ttft_s for o in outcomes if o.ttft_s is not None]),
        "itl_ms": percentiles_ms([itl for o in outcomes for itl in o.itls_s]),
        "paths": paths,
        "memory": {
            "rss_before_mib": before,
            "rss_after_mib": after,
            "rss_growth_mib": growth,
            "total_growth_mib": round(sum(after.values()) - sum(before.values()), 1),
            "processes_gone": sorted(set(before) - set(after)),
        },
        "up_exit_status": up_status,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
