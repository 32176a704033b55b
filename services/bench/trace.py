"""``pdserve bench trace FILE``: a production trace (Mooncake's FAST'25 format) replayed through
``pdserve up --engine sim``, per fleet size and routing setting, side by side in one run.

The trace (:mod:`services.bench.trace_file`): each request is sent at its ``timestamp`` (times
``--time-scale``) as a token-id prompt built from its ``hash_ids`` (equal ids, equal blocks),
asking for ``min(output_length, --max-output-tokens)`` tokens, streamed. Fleets
(``--fleets 4:2,8:4``: prefill:decode engines of ``--sim-profile``, ``--kv-blocks`` each if
given) times settings (``--policies``, as ``pdserve bench routing``'s: ``round_robin``,
``approximate``, ``precise``), each on a fresh stack. ``--router URL`` replays once through a
running router instead (its own policy; ``--prefill-engines`` sizes the oracle).

Figures per setting (JSON): requests, errors, skipped trace lines; **cached share**: the
engines' ``usage.prompt_tokens_details.cached_tokens`` over the trace's reusable tokens (the
ceiling of a never-evicting cache, computed by the bench), beside the **offline oracle**'s
share with the fleet's real capacities and ``cached_share_of_oracle``; TTFT and ITL p50/p99;
goodput (requests within ``--ttft-slo-ms`` and ``--itl-slo-ms`` per second of the trace and
their share); KV bytes moved (the decode engines' ``pdserve_kv_transfer_bytes_total``); the
router's CPU per request and the engines' CPU; how late requests were sent against the
trace's clock (the client keeping up); where the first token waited (the routers' mean
``pdserve_router_ttft_phase_seconds`` per phase: prefill, KV hand-off, the decode engine's
first token; the client's TTFT less their sum is the router and the network). A workload
with reuse whose answers report no cached token at all is a ``problem`` (``bench routing``'s
check). ``--plot`` draws the cached share and TTFT p50 against fleet size per setting (PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import children_with_arg, cpu_seconds, descendants
from services.bench.routing import SETTINGS
from services.bench.routing_figures import kv_bytes
from services.bench.sse import stream_routed
from services.bench.trace_figures import (
    Sent,
    comparison,
    phase_means,
    plot,
    summarize,
    ttft_phases,
)
from services.bench.trace_file import (
    BLOCK_TOKENS,
    Prompts,
    TraceError,
    TraceRequest,
    oracle_tokens,
    read_trace,
    reusable_tokens,
)
from services.bench.up_stack import served_model, wait_endpoints, work_root
from services.engines.sim.profile import DEFAULT_PROFILE, SimProfile, load_profile
from services.supervision import DetachedProcess

SHIPPED_TRACE = Path(__file__).parent / "traces" / "synthetic_conversations.jsonl"
"""A small synthetic conversation trace in Mooncake's format (tests, a first run)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        type=Path,
        help=f"a trace in Mooncake's JSON-lines format (a small synthetic one: {SHIPPED_TRACE})",
    )
    parser.add_argument("--fleets", default="2:1", help="prefill:decode engines, comma-separated")
    parser.add_argument("--policies", default=",".join(SETTINGS), help="comma-separated settings")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per trace second (0.5 replays twice as fast)",
    )
    parser.add_argument("--max-output-tokens", type=int, default=32, help="cap per request")
    parser.add_argument("--max-requests", type=int, default=None, help="the trace's first N")
    parser.add_argument("--sim-profile", default=DEFAULT_PROFILE)
    parser.add_argument(
        "--kv-blocks", type=int, default=None, help="every engine's KV blocks (default: profile)"
    )
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="per hash id")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=100.0)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the figures")
    parser.add_argument(
        "--together",
        action="store_true",
        help="start every setting's stack of a fleet first, then replay through all at once "
        "(a loaded machine's noise falls on each alike; the engines and routers share it)",
    )
    parser.add_argument("--router", default=None, help="replay through this running router")
    parser.add_argument(
        "--prefill-engines", type=int, default=1, help="with --router: the oracle's fleet"
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")


@dataclass(frozen=True)
class Workload:
    """The valid trace requests, their prompts and the ceiling's tokens."""

    requests: list[TraceRequest]
    prompts: list[list[int]]
    reusable: list[int]
    skipped: int
    first_skipped: str | None


def load_workload(args: argparse.Namespace, profile: SimProfile) -> Workload:
    """Read and check the trace before anything starts (SystemExit naming what is wrong)."""
    # An engine whose KV pool is smaller than the model's context takes no longer prompt.
    pool = (args.kv_blocks or profile.kv_cache.num_blocks) * profile.kv_cache.block_size
    try:
        trace = read_trace(
            args.trace,
            max_model_len=min(profile.model.max_model_len, pool),
            block_tokens=args.block_tokens,
            limit=args.max_requests,
        )
    except TraceError as exc:
        raise SystemExit(f"pdserve bench trace: {exc}") from None
    prompts = Prompts(profile.model.vocab_size, args.block_tokens)
    return Workload(
        trace.requests,
        [prompts.prompt(request) for request in trace.requests],
        reusable_tokens(
            trace.requests,
            engine_block=profile.kv_cache.block_size,
            block_tokens=args.block_tokens,
        ),
        trace.skipped,
        trace.first_skipped,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = load_profile(args.sim_profile)
    policies = [name for name in str(args.policies).split(",") if name]
    unknown = [name for name in policies if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"pdserve bench trace: unknown setting(s) {unknown}; known: {SETTINGS}")
    fleets = _fleets(str(args.fleets))
    workload = load_workload(args, profile)
    capacity = (args.kv_blocks or profile.kv_cache.num_blocks) * profile.kv_cache.block_size
    results: dict[str, Any] = {}
    if args.router is not None:
        oracle = _oracle(workload, args.prefill_engines, capacity, profile, args)
        results["router"] = replay_figures(args, str(args.router), workload, oracle)
    else:
        with work_root(args.work_dir, "trace") as root:
            for prefill, decode in fleets:
                oracle = _oracle(workload, prefill, capacity, profile, args)
                results.update(_run_fleet(args, policies, prefill, decode, root, workload, oracle))
    report = {
        "workload": _workload_figures(args, workload, capacity),
        "settings": results,
        "comparison": comparison(results),
    }
    if args.plot is not None:
        plot(results, args.plot)
    return report


def _fleets(text: str) -> list[tuple[int, int]]:
    fleets = []
    for item in text.split(","):
        prefill, sep, decode = item.partition(":")
        if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1:
            raise SystemExit(f"pdserve bench trace: --fleets wants PREFILL:DECODE, got {item!r}")
        fleets.append((int(prefill), int(decode)))
    return fleets


def _oracle(
    workload: Workload, engines: int, capacity: int, profile: SimProfile, args: argparse.Namespace
) -> list[int]:
    return oracle_tokens(
        workload.requests,
        engines,
        capacity,
        engine_block=profile.kv_cache.block_size,
        block_tokens=args.block_tokens,
    )


def _workload_figures(
    args: argparse.Namespace, workload: Workload, capacity_tokens: int
) -> dict[str, Any]:
    requests = workload.requests
    prompt = sum(r.input_length for r in requests)
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    return {
        "trace": str(args.trace),
        "requests": len(requests),
        "skipped_lines": workload.skipped,
        "first_skipped": workload.first_skipped,
        "span_s": round(span_s, 2),
        "time_scale": args.time_scale,
        "prompt_tokens": prompt,
        "reusable_tokens": sum(workload.reusable),
        "reusable_share_of_prompt": round(sum(workload.reusable) / prompt, 4),
        "engine_capacity_tokens": capacity_tokens,
        "max_output_tokens": args.max_output_tokens,
        "sim_profile": args.sim_profile,
    }


@dataclass
class _Stack:
    """One setting's running stack."""

    up: DetachedProcess
    prefill: int
    decode: int
    endpoints: dict[str, Any]
    router_pids: list[int]
    engine_pids: list[int]


def _start(
    args: argparse.Namespace, policy: str, prefill: int, decode: int, work_dir: Path
) -> _Stack:
    router_args, _ = SETTINGS[policy]
    work_dir.mkdir(parents=True, exist_ok=True)
    up = DetachedProcess.pdserve_up(
        work_dir,
        "--engine", "sim", "--sim-profile", str(args.sim_profile), "--port", "0",
        "--prefill-replicas", str(prefill), "--decode-replicas", str(decode),
        *(f"--router-arg={arg}" for arg in router_args),
        # vLLM's front end reports cached tokens only with this flag, as vLLM's server does.
        "--frontend-arg=--enable-prompt-tokens-details",
        *((f"--engine-arg=--num-kv-blocks={args.kv_blocks}",) if args.kv_blocks else ()),
    )  # fmt: skip
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
    except BaseException:
        up.stop()
        raise
    router_pids = [
        pid for parent in children_with_arg(up.pid, "router") for pid in descendants(parent)
    ]
    engine_pids = [
        int(engine["pid"]) for engine in endpoints["engines"].values() if engine.get("pid")
    ]
    return _Stack(up, prefill, decode, endpoints, router_pids, engine_pids)


def _replay_on(
    args: argparse.Namespace, stack: _Stack, workload: Workload, oracle: list[int]
) -> dict[str, Any]:
    endpoints = stack.endpoints
    figures = replay_figures(
        args, str(endpoints["router"]), workload, oracle, stack.router_pids, stack.engine_pids,
        endpoints,
    )  # fmt: skip
    figures["fleet"] = {"prefill": stack.prefill, "decode": stack.decode}
    return figures


def _run_fleet(
    args: argparse.Namespace,
    policies: list[str],
    prefill: int,
    decode: int,
    root: Path,
    workload: Workload,
    oracle: list[int],
) -> dict[str, Any]:
    """Every setting on this fleet: one after the other, or with ``--together`` all stacks
    started first and the trace replayed through each at once (the machine's load, whatever
    it is, falls on every setting alike)."""
    results: dict[str, Any] = {}
    if not args.together:
        for policy in policies:
            stack = _start(args, policy, prefill, decode, root / f"{policy}-{prefill}-{decode}")
            try:
                results[f"{policy}/{prefill}:{decode}"] = _replay_on(args, stack, workload, oracle)
            finally:
                stack.up.stop()
        return results
    stacks: dict[str, _Stack] = {}
    try:
        for policy in policies:
            work_dir = root / f"{policy}-{prefill}-{decode}"
            stacks[f"{policy}/{prefill}:{decode}"] = _start(args, policy, prefill, decode, work_dir)
        with ThreadPoolExecutor(len(stacks)) as pool:
            futures = {
                name: pool.submit(_replay_on, args, stack, workload, oracle)
                for name, stack in stacks.items()
            }
            return {name: future.result() for name, future in futures.items()}
    finally:
        for stack in stacks.values():
            stack.up.stop()


def replay_figures(
    args: argparse.Namespace,
    router: str,
    workload: Workload,
    oracle: list[int],
    router_pids: Sequence[int] = (),
    engine_pids: Sequence[int] = (),
    endpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay the workload through ``router`` and summarize (CPU of the pids given)."""
    model = served_model(router)
    urls: dict[str, str] = (endpoints or {}).get("metrics", {})
    metrics = [str(url) for name, url in urls.items() if not name.startswith("router")]
    routers = [str(url) for name, url in urls.items() if name.startswith("router")]
    moved_before, phases_before = kv_bytes(metrics), ttft_phases(routers)
    router_before, engines_before = cpu_seconds(router_pids), cpu_seconds(engine_pids)
    started = time.perf_counter()
    sent = asyncio.run(replay(args, router, model, workload, oracle))
    elapsed = time.perf_counter() - started
    figures = summarize(sent, args, elapsed)
    figures["kv_bytes_moved"] = kv_bytes(metrics) - moved_before if metrics else None
    figures["ttft_phases_mean_ms"] = phase_means(phases_before, ttft_phases(routers))
    done = figures["requests"] - figures["errors"]
    if router_pids and done:
        used = cpu_seconds(router_pids) - router_before
        figures["router_cpu_ms_per_request"] = round(used * 1000 / done, 2)
    if engine_pids:
        figures["engines_cpu_s"] = round(cpu_seconds(engine_pids) - engines_before, 2)
    return figures


async def replay(
    args: argparse.Namespace, router: str, model: str, workload: Workload, oracle: list[int]
) -> list[Sent]:
    """Send every request at its time (scaled) and stream its answer."""
    requests = workload.requests
    first_ms = requests[0].timestamp_ms
    results = [
        Sent(i, r.input_length, workload.reusable[i], oracle[i]) for i, r in enumerate(requests)
    ]
    # Idle connections expire before the router's keep-alive closes them.
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=router, limits=limits) as client:
        begin = time.perf_counter()

        async def one(result: Sent) -> None:
            request = requests[result.index]
            result.scheduled_s = (request.timestamp_ms - first_ms) / 1000 * args.time_scale
            await asyncio.sleep(max(0.0, begin + result.scheduled_s - time.perf_counter()))
            result.lag_s = time.perf_counter() - begin - result.scheduled_s
            max_tokens = max(1, min(request.output_length, args.max_output_tokens))
            prompt = workload.prompts[result.index]
            texts = await stream_routed(
                client, model, prompt, max_tokens, args.request_timeout_s, result
            )
            result.itls_s = [later - at for at, later in itertools.pairwise(texts)]

        await asyncio.gather(*(one(result) for result in results))
    return results
