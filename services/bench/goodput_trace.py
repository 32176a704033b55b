"""``pdserve bench goodput --trace FILE``: the planner's cached-share effect, on a trace.

One stack (``pdserve up --engine sim``, fixed pools ``--trace-fleet P:D``, placement from the
engines' KV events), the trace replayed through it as ``pdserve bench trace`` replays it
(:mod:`services.bench.trace`, at ``--trace-time-scale``), and two ``pdserve planner`` processes
reading that router every ``--planner-interval-s`` at the same SLOs (``--ttft-ms`` and
``--itl-ms`` times ``--planner-headroom``, as the step run's planner): one sizes the prefill
pool for the part of each prompt its engine did not hold (the router's
``pdserve_router_cached_tokens{pool="prefill"}``, the planner's default), the other as if every
prompt token were computed (``--no-cached-tokens``). Same load, same run, side by side; the
planners decide only (neither starts an engine), so both see the one fleet.

Figures (JSON): per planner, over the intervals in which requests arrived, the prefill engines
it needs (``needed``, before its bounds: mean and peak), the cached tokens a request it read
and its prefill correction (observed over expected TTFT); the headline
``prefill_engines_saved``: the blind planner's mean need less the cache-aware one's (and
``prefill_need_ratio``, cache-aware over blind). The replay's own figures say what the fixed
fleet served: cached share of the trace's reusable tokens, TTFT, goodput at the SLOs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from services.bench.routing import SETTINGS
from services.bench.trace import SHIPPED_TRACE, load_workload, replay_figures
from services.bench.trace_file import BLOCK_TOKENS, oracle_tokens
from services.bench.up_stack import wait_endpoints
from services.engines.sim.profile import load_profile
from services.serving.ready import READY_PREFIX, pdserve_argv
from services.supervision import DetachedProcess

PLANNERS = {"cached": ("--cached-tokens",), "blind": ("--no-cached-tokens",)}
"""Planner name -> its flag: the cached share read, or every prompt token computed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"replay this Mooncake-format trace under two planners, with and without the "
        f"cached share (e.g. {SHIPPED_TRACE.name}, shipped)",
    )
    parser.add_argument("--trace-fleet", default="4:2", help="the trace stack's P:D engines")
    parser.add_argument(
        "--trace-time-scale", type=float, default=0.25, help="wall seconds per trace second"
    )
    parser.add_argument("--trace-max-requests", type=int, default=None)
    parser.add_argument("--trace-max-output-tokens", type=int, default=32)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The trace run (see the module docstring)."""
    profile = load_profile(str(args.profile))
    prefill, sep, decode = str(args.trace_fleet).partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1:
        raise SystemExit(f"pdserve bench goodput: --trace-fleet wants P:D, got {args.trace_fleet}")
    replay_args = argparse.Namespace(
        trace=args.trace,
        kv_blocks=None,
        block_tokens=BLOCK_TOKENS,
        max_requests=args.trace_max_requests,
        time_scale=args.trace_time_scale,
        max_output_tokens=args.trace_max_output_tokens,
        ttft_slo_ms=args.ttft_ms,
        itl_slo_ms=args.itl_ms,
        request_timeout_s=args.request_timeout_s,
    )
    workload = load_workload(replay_args, profile)
    oracle = oracle_tokens(
        workload.requests,
        int(prefill),
        profile.kv_cache.num_blocks * profile.kv_cache.block_size,
        engine_block=profile.kv_cache.block_size,
        block_tokens=BLOCK_TOKENS,
    )
    work_dir = root / "trace"
    work_dir.mkdir(parents=True, exist_ok=True)
    router_args, _ = SETTINGS["precise"]
    up = DetachedProcess.pdserve_up(
        work_dir,
        "--engine", "sim", "--sim-profile", str(args.profile),
        "--prefill-replicas", prefill, "--decode-replicas", decode,
        *(f"--router-arg={arg}" for arg in router_args),
        "--frontend-arg=--enable-prompt-tokens-details",
    )  # fmt: skip
    planners: dict[str, DetachedProcess] = {}
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
        router = str(endpoints["router"])
        for name, flags in PLANNERS.items():
            planners[name] = _planner(args, router, work_dir / f"planner-{name}.out", flags)
        for process in planners.values():
            _wait_ready(process, args.ready_timeout_s)
        replayed = replay_figures(replay_args, router, workload, oracle)
        # One more interval, so the last arrivals are in both planners' figures.
        time.sleep(args.planner_interval_s * 1.5)
    finally:
        for process in planners.values():
            process.stop()
        up.stop()
    records = {name: _records(process.output()) for name, process in planners.items()}
    figures = {name: planner_figures(lines) for name, lines in records.items()}
    return {
        "setup": {
            "trace": str(args.trace),
            "fleet": str(args.trace_fleet),
            "time_scale": args.trace_time_scale,
            "requests": len(workload.requests),
            "planner_ttft_ms": args.ttft_ms * args.planner_headroom,
            "planner_itl_ms": args.itl_ms * args.planner_headroom,
            "planner_interval_s": args.planner_interval_s,
        },
        "replay": replayed,
        "planners": figures,
        **cached_share_effect(figures["cached"], figures["blind"]),
    }


def _planner(
    args: argparse.Namespace, router: str, output: Path, flags: tuple[str, ...]
) -> DetachedProcess:
    argv = pdserve_argv(
        "planner", "--router-url", router, "--profile", str(args.profile),
        f"--ttft-ms={args.ttft_ms * args.planner_headroom}",
        f"--itl-ms={args.itl_ms * args.planner_headroom}",
        f"--interval-s={args.planner_interval_s}",
        f"--stabilization-intervals={args.planner_stabilization}",
        "--prefill-max=64", "--decode-max=64", "--metrics-port=0", *flags,
    )  # fmt: skip
    return DetachedProcess(argv, output, {**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_ready(process: DetachedProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while READY_PREFIX not in process.output():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pdserve planner did not start:\n{process.output()[-2000:]}")
        time.sleep(0.2)


def _records(output: str) -> list[dict[str, Any]]:
    """The planner's JSON lines (one per interval; its ready line and logs skipped)."""
    records = []
    for line in output.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


def planner_figures(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One planner's figures over the intervals in which requests arrived (an idle interval
    sizes for no load, whatever the planner reads)."""
    busy = [r for r in records if r.get("observed", {}).get("rate_rps", 0) > 0]
    needed = [int(r["prefill"]["needed"]) for r in busy]
    cached = [float(r["predicted"]["cached_tokens"]) for r in busy if "predicted" in r]
    correction = [float(r["prefill"]["correction"]) for r in busy]

    def mean(values: list[float] | list[int]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    return {
        "intervals": len(busy),
        "prefill_needed_mean": mean(needed),
        "prefill_needed_peak": max(needed, default=None),
        "cached_tokens_mean": mean(cached),
        "prefill_correction_mean": mean(correction),
        "decode_needed_mean": mean([int(r["decode"]["needed"]) for r in busy]),
    }


def cached_share_effect(cached: dict[str, Any], blind: dict[str, Any]) -> dict[str, Any]:
    """The headline: prefill engines the cached share saves in the planner's sizing."""
    with_cache, without = cached["prefill_needed_mean"], blind["prefill_needed_mean"]
    if with_cache is None or without is None:
        return {"prefill_engines_saved": None, "prefill_need_ratio": None}
    return {
        "prefill_engines_saved": round(without - with_cache, 3),
        "prefill_need_ratio": round(with_cache / without, 3) if without else None,
    }
