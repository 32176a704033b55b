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
import contextlib
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.procs import children_with_arg, cpu_seconds, descendants
from services.bench.routing import SETTINGS, blind_to_the_cache
from services.bench.routing import _kv_bytes as kv_bytes
from services.bench.soak import percentiles_ms, wait_endpoints
from services.bench.sse import StreamFailed, cached_tokens, completion_events
from services.bench.trace_file import (
    BLOCK_TOKENS,
    Prompts,
    TraceError,
    TraceRequest,
    oracle_tokens,
    read_trace,
    reusable_tokens,
)
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
    parser.add_argument("--router", default=None, help="replay through this running router")
    parser.add_argument(
        "--prefill-engines", type=int, default=1, help="with --router: the oracle's fleet"
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")


@dataclass
class Sent:
    """One trace request's result."""

    index: int
    prompt_tokens: int
    reusable_tokens: int
    oracle_tokens: int = 0
    scheduled_s: float = 0.0
    lag_s: float = 0.0
    """How late it was sent against the trace's clock."""
    ok: bool = False
    cached_tokens: int = 0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prefill_engine: str | None = None
    decode_engine: str | None = None
    path: str | None = None
    error: str | None = None


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
        with contextlib.ExitStack() as stack:
            root: Path = args.work_dir or Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-trace-"))
            )
            for prefill, decode in fleets:
                oracle = _oracle(workload, prefill, capacity, profile, args)
                for policy in policies:
                    name = f"{policy}/{prefill}:{decode}"
                    work_dir = root / f"{policy}-{prefill}-{decode}"
                    results[name] = _run_setting(
                        args, policy, prefill, decode, work_dir, workload, oracle
                    )
    report = {
        "workload": _workload_figures(args, workload, capacity),
        "settings": results,
        "comparison": _comparison(results),
    }
    if args.plot is not None:
        _plot(results, args.plot)
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


def _run_setting(
    args: argparse.Namespace,
    policy: str,
    prefill: int,
    decode: int,
    work_dir: Path,
    workload: Workload,
    oracle: list[int],
) -> dict[str, Any]:
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
        router_pids = [
            pid for parent in children_with_arg(up.pid, "router") for pid in descendants(parent)
        ]
        engine_pids = [
            int(engine["pid"]) for engine in endpoints["engines"].values() if engine.get("pid")
        ]
        figures = replay_figures(
            args, str(endpoints["router"]), workload, oracle, router_pids, engine_pids, endpoints
        )
        figures["fleet"] = {"prefill": prefill, "decode": decode}
        return figures
    finally:
        up.stop()


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
    model = str(httpx.get(f"{router}/v1/models", timeout=30).json()["data"][0]["id"])
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
    figures["ttft_phases_mean_ms"] = _phase_means(phases_before, ttft_phases(routers))
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
            await _complete(client, model, prompt, max_tokens, args, result)

        await asyncio.gather(*(one(result) for result in results))
    return results


async def _complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    args: argparse.Namespace,
    result: Sent,
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, timeout=args.request_timeout_s
        ) as reply:
            result.prefill_engine = reply.headers.get("x-pdserve-prefill-engine")
            result.decode_engine = reply.headers.get("x-pdserve-decode-engine")
            result.path = reply.headers.get("x-pdserve-execution-path")
            async for event in completion_events(reply):
                if any(choice.get("text") for choice in event.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - sent
                    else:
                        result.itls_s.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    result.cached_tokens = cached_tokens(usage)
                    result.ok = True
    except StreamFailed as exc:
        result.error = str(exc)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if not result.ok and result.error is None:
        result.error = "stream ended without usage"


def summarize(sent: list[Sent], args: argparse.Namespace, elapsed_s: float) -> dict[str, Any]:
    """A setting's figures (see the module docstring)."""
    done = [s for s in sent if s.ok]
    reusable = sum(s.reusable_tokens for s in done)
    oracle = sum(s.oracle_tokens for s in done)
    cached = sum(min(s.cached_tokens, s.prompt_tokens) for s in done)
    prompt = sum(s.prompt_tokens for s in done)
    ttft_slo, itl_slo = args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000

    def met(s: Sent) -> bool:
        itl = sum(s.itls_s) / len(s.itls_s) if s.itls_s else 0.0
        return s.ttft_s is not None and s.ttft_s <= ttft_slo and itl <= itl_slo

    good = sum(met(s) for s in done)
    span_s = max((s.scheduled_s for s in sent), default=0.0) or elapsed_s
    errors = [s.error for s in sent if not s.ok]

    def share(part: int, whole: int) -> float | None:
        return round(part / whole, 4) if whole else None

    return {
        "requests": len(sent),
        "errors": len(errors),
        "first_errors": errors[:3],
        "problems": blind_to_the_cache(reusable, cached),
        "elapsed_s": round(elapsed_s, 2),
        "prompt_tokens": prompt,
        "reusable_tokens": reusable,
        "cached_tokens": cached,
        "oracle_tokens": oracle,
        "cached_share": share(cached, reusable),
        "oracle_share": share(oracle, reusable),
        "cached_share_of_oracle": share(cached, oracle),
        "local_runs": sum(s.path == "local" for s in done),
        "ttft_ms": percentiles_ms([s.ttft_s for s in done if s.ttft_s is not None]),
        "itl_ms": percentiles_ms([itl for s in done for itl in s.itls_s]),
        "goodput_per_s": round(good / span_s, 3) if span_s else None,
        "within_slo_share": share(good, len(sent)),
        "send_lag_ms": percentiles_ms([s.lag_s for s in sent]),
        "prefill_engines": len({s.prefill_engine for s in done if s.prefill_engine}),
    }


def ttft_phases(urls: list[str]) -> dict[str, tuple[float, float]]:
    """``phase -> (sum s, count)`` of the routers' ``pdserve_router_ttft_phase_seconds``:
    where a disaggregated request's first token waited (prefill, KV hand-off, the decode
    engine's first token)."""
    phases: dict[str, tuple[float, float]] = {}
    for url in urls:
        text = httpx.get(url, timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name != "pdserve_router_ttft_phase_seconds":
                continue
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                total, count = phases.get(phase, (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    phases[phase] = (total + sample.value, count)
                elif sample.name.endswith("_count"):
                    phases[phase] = (total, count + sample.value)
    return phases


def _phase_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    means: dict[str, float | None] = {}
    for phase, (total, count) in after.items():
        old_total, old_count = before.get(phase, (0.0, 0.0))
        done = count - old_count
        means[phase] = round((total - old_total) / done * 1000, 2) if done > 0 else None
    return means


def _comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Per fleet: each setting's cached share, its ratio to round-robin's and to the oracle's,
    and its TTFT p50 beside the approximate policy's."""
    rows: dict[str, Any] = {}
    for name, figures in results.items():
        fleet = name.partition("/")[2]
        if not fleet:
            continue
        base = results.get(f"round_robin/{fleet}", {})
        approximate = results.get(f"approximate/{fleet}", {})
        share, base_share = figures.get("cached_share"), base.get("cached_share")
        rows[name] = {
            "cached_share": share,
            "cached_share_of_oracle": figures.get("cached_share_of_oracle"),
            "over_round_robin": round(share / base_share, 2) if share and base_share else None,
            "ttft_p50_ms": figures["ttft_ms"]["p50"],
            "approximate_ttft_p50_ms": approximate.get("ttft_ms", {}).get("p50"),
        }
    return rows


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (shares, ttfts) = plt.subplots(1, 2, figsize=(10, 4))
    by_policy: dict[str, list[tuple[int, Any]]] = {}
    for name, figures in results.items():
        policy = name.partition("/")[0]
        engines = figures.get("fleet", {}).get("prefill", 0)
        by_policy.setdefault(policy, []).append((engines, figures))
    for policy, points in sorted(by_policy.items()):
        points.sort(key=lambda point: point[0])
        xs = [x for x, _ in points]
        shares.plot(xs, [f["cached_share"] or 0 for _, f in points], marker="o", label=policy)
        ttfts.plot(xs, [f["ttft_ms"]["p50"] or 0 for _, f in points], marker="o", label=policy)
    oracle = sorted(by_policy.get(next(iter(by_policy), ""), []), key=lambda point: point[0])
    if oracle:
        xs = [x for x, _ in oracle]
        shares.plot(xs, [f["oracle_share"] or 0 for _, f in oracle], "k--", label="oracle")
    shares.set(xlabel="prefill engines", ylabel="cached share of reusable tokens", ylim=(0, 1.05))
    ttfts.set(xlabel="prefill engines", ylabel="TTFT p50 (ms)")
    shares.legend()
    ttfts.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
