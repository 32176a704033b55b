"""``pdserve bench peers``: pdserve against vLLM's own PD stack, on the same engines and load,
one stack after the other in one run.

The stacks (:mod:`services.bench.peer_stacks`), over the same checkpoint (default: the
generated tiny one), the same vLLM engine settings (dtype, block size, KV cache bytes, model
length, eager) and the same layout (one prefill, one decode engine; their PP x TP):

- ``peer``: two ``vllm serve`` with vLLM's NixlConnector behind ``vllm-router
  --vllm-pd-disaggregation`` (round robin); ``peer_kv_events``: the same with vllm-router's
  ``kv_aware`` prefill policy over the prefill server's KV events (``--pd-kv-events``);
- ``pdserve_push`` / ``pdserve_pull``: ``pdserve up --engine vllm`` in each transfer mode.

Each gets the same seeded load (:mod:`services.bench.peer_load`): a rate sweep of completions
of mixed prompt lengths, multi-turn chats over shared system prompts (both open-loop), and a
concurrency sweep of streamed chats. Per phase: TTFT, ITL and end-to-end p50/p99, throughput,
goodput at ``--ttft-slo-ms`` / ``--itl-slo-ms``, and **CPU seconds per request summed over
every process of the stack** (routers, API servers, engine hosts, engine cores and workers,
Redis, ``pdserve up``), read from each process's CPU clock before and after the phase, with
the same figure per process (``cpu_ms_per_request_by_process``: where the difference comes
from). Completions sent one at a time at the two ``--streamed-tokens`` lengths give the CPU
one more streamed token costs each process (``cpu_ms_per_extra_token``). Per stack:
peak RSS of all its processes together (sampled every 0.5 s), and its KV-transfer counters
(transfers, failed, expired: every transfer should succeed and none expire). Greedy outputs:
each stack's token ids per request against the first stack's and against a colocated ``vllm
serve`` given the same request bodies (``--no-colocated``: not run).

A stack that cannot start (``vllm-router`` missing, a port taken, a layout the peer does not
support) is reported with its reason and the bench goes on. Every process started is stopped
(its whole process group) when its stack is done, when the bench fails, and on Ctrl-C; each
is also started to die with the bench's process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.peer_load import Outcome, Slo, Workload, output_agreement, outputs, send
from services.bench.peer_phases import comparison, per_extra_token, run_workloads, table
from services.bench.peer_stacks import (
    PDSERVE_STACKS,
    STACKS,
    EngineSettings,
    Layout,
    colocated_server_argv,
    pdserve_up_args,
    peer_refusal,
    peer_server_argv,
    peer_server_env,
    process_labels,
    rss_mib,
    transfer_counts,
    vllm_router_argv,
    vllm_router_binary,
)
from services.bench.procs import load_average, start, stop
from services.bench.router_load import wait_http
from services.control_plane.local_redis import free_port
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.vllm.options import read_model_config
from services.engines.vllm.platform import shared_cpu_bindings
from services.supervision import ChildProcess, DetachedProcess
from services.supervision.child import ChildExited

START_TIMEOUT_S = 600.0
"""Bound of one stack's start (vLLM's import and model load: minutes on a loaded machine)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny checkpoint")
    parser.add_argument(
        "--stacks", default=",".join(STACKS), help=f"comma-separated, in order: {STACKS}"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    for side in ("prefill", "decode"):
        for size in ("pp", "tp"):
            parser.add_argument(f"--{side}-{size}", type=int, default=1)
    parser.add_argument("--rates", default="1,2,4", help="requests/s of the rate sweep")
    parser.add_argument("--requests-per-rate", type=int, default=16)
    parser.add_argument("--prompt-words", default="8,32,96", help="mixed prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=16, help="generated per request")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=40)
    parser.add_argument("--user-words", type=int, default=8)
    parser.add_argument("--chat-rate", type=float, default=1.0, help="conversations started/s")
    parser.add_argument("--concurrency", default="1,4", help="streamed chats at a time")
    parser.add_argument("--requests-per-concurrency", type=int, default=12)
    parser.add_argument(
        "--streamed-tokens",
        default="4,64",
        help="two max_tokens of completions sent one at a time: the CPU one more streamed "
        "token costs each process (per_extra_token; empty: not measured)",
    )
    parser.add_argument("--streamed-requests", type=int, default=10)
    parser.add_argument("--ttft-slo-ms", type=float, default=500.0)
    parser.add_argument("--itl-slo-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--no-colocated", action="store_true", help="no colocated reference")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")


@dataclass
class Running:
    """A started stack: its URL, its process roots (label -> pid) and its metrics URLs."""

    name: str
    url: str
    roots: dict[str, int]
    metrics: list[str]
    children: list[ChildProcess] = field(default_factory=list)
    up: DetachedProcess | None = None

    def pids(self) -> dict[int, str]:
        return process_labels(self.roots)

    async def stop(self) -> None:
        for child in reversed(self.children):
            await stop(child)
        if self.up is not None:
            await asyncio.to_thread(self.up.stop)


@dataclass(frozen=True)
class Setup:
    model: Path
    served_model: str
    settings: EngineSettings
    layout: Layout
    log_dir: Path


async def _start_peer(setup: Setup, name: str) -> Running:
    refusal = peer_refusal(setup.layout)
    if refusal is not None:
        raise StackUnavailable(refusal)
    binary = vllm_router_binary()
    if binary is None:
        raise StackUnavailable("vllm-router is not installed (pip install vllm-router==0.1.17)")
    layout = setup.layout
    bindings = shared_cpu_bindings(layout.world_sizes(), sorted(os.sched_getaffinity(0)))
    running = Running(name, "", {}, [])
    kv_events = name == "peer_kv_events"
    try:
        urls: dict[str, str] = {}
        events_port = free_port() if kv_events else None
        for role, binding, (pp, tp) in zip(
            ("prefill", "decode"),
            bindings,
            ((layout.prefill_pp, layout.prefill_tp), (layout.decode_pp, layout.decode_tp)),
            strict=True,
        ):
            port = free_port()
            argv = peer_server_argv(
                setup.model, setup.served_model, port, setup.settings, pp=pp, tp=tp,
                kv_events_port=events_port if role == "prefill" else None,
            )  # fmt: skip
            env = peer_server_env(binding, free_port())
            server = await start(f"{name}-{role}", argv, setup.log_dir, env=env)
            running.children.append(server)
            running.roots[f"{role}/api-server"] = server.pid
            urls[role] = f"http://127.0.0.1:{port}"
        for role, server in zip(("prefill", "decode"), running.children, strict=True):
            await wait_http(f"{urls[role]}/health", service=server, timeout_s=START_TIMEOUT_S)
        running.metrics = [f"{urls[role]}/metrics" for role in ("prefill", "decode")]
        port = free_port()
        argv = vllm_router_argv(
            binary, urls["prefill"], urls["decode"], port,
            kv_events=f"tcp://127.0.0.1:{events_port}" if events_port else None,
            block_size=setup.settings.block_size,
        )  # fmt: skip
        router = await start(f"{name}-vllm-router", argv, setup.log_dir)
        running.children.append(router)
        running.roots["vllm-router"] = router.pid
        running.url = f"http://127.0.0.1:{port}"
        await wait_http(f"{running.url}/v1/models", service=router, timeout_s=120.0)
    except BaseException:
        await running.stop()
        raise
    return running


async def _start_pdserve(setup: Setup, transfer_mode: str) -> Running:
    work = setup.log_dir / f"pdserve-{transfer_mode}"
    args = pdserve_up_args(setup.model, setup.settings, setup.layout, transfer_mode)
    up = DetachedProcess.pdserve_up(
        work, *args, "--ready-timeout-s", str(START_TIMEOUT_S), "--no-restart"
    )
    running = Running(f"pdserve_{transfer_mode}", "", {"up": up.pid}, [], up=up)
    try:
        path = work / "endpoints.json"
        try:
            await asyncio.to_thread(up.wait_for_file, path, START_TIMEOUT_S)
        except (ChildExited, TimeoutError) as exc:
            tail = up.output()[-1500:]
            raise StackUnavailable(f"pdserve up did not start ({exc}): {tail}") from None
        endpoints = json.loads(path.read_text())
        running.url = str(endpoints["router"])
        running.metrics = [str(url) for url in endpoints.get("metrics", {}).values()]
    except BaseException:
        await running.stop()
        raise
    return running


class StackUnavailable(Exception):
    """A stack that cannot run here, and why."""


async def _start(name: str, setup: Setup) -> Running:
    if name in PDSERVE_STACKS:
        return await _start_pdserve(setup, name.removeprefix("pdserve_"))
    return await _start_peer(setup, name)


async def _sample_rss(running: Running, peak: list[float], stop_event: asyncio.Event) -> None:
    while not stop_event.is_set():
        peak[0] = max(peak[0], rss_mib(list(running.pids())))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), 0.5)


async def _bench_stack(
    name: str, setup: Setup, load: Workload, slo: Slo
) -> tuple[dict[str, Any], list[Outcome]]:
    started = time.perf_counter()
    try:
        running = await _start(name, setup)
    except (StackUnavailable, RuntimeError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:3000]}, []
    try:
        start_s = time.perf_counter() - started
        transfers_before = await asyncio.to_thread(transfer_counts, running.metrics)
        peak = [0.0]
        done = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(running, peak, done))
        try:
            phases, outcomes = await run_workloads(running.url, running.pids, load, slo)
        except (RuntimeError, httpx.HTTPError) as exc:
            # A stack that started and then failed (its warm-up, a metrics read) is reported
            # as one that could not run; the next stack still runs.
            return {"error": f"{type(exc).__name__} under load: {exc}"[:3000]}, []
        finally:
            done.set()
            await sampler
        transfers_after = await asyncio.to_thread(transfer_counts, running.metrics)
        labels = sorted(set(running.pids().values()))
    finally:
        await running.stop()
    return {
        "start_s": round(start_s, 1),
        "url": running.url,
        "processes": labels,
        "peak_rss_mib": round(peak[0], 1),
        "kv_transfers": {
            key: transfers_after.get(key, 0.0) - transfers_before.get(key, 0.0)
            for key in sorted(set(transfers_after) | set(transfers_before))
        },
        "phases": phases,
        "cpu_ms_per_extra_token": per_extra_token(phases, load.streamed_tokens),
    }, outcomes


async def _colocated(setup: Setup, bodies: Sequence[Outcome], timeout_s: float) -> dict[str, Any]:
    """Greedy outputs of a colocated ``vllm serve`` for the same request bodies."""
    port = free_port()
    argv = colocated_server_argv(setup.model, setup.served_model, port, setup.settings)
    server = await start("colocated", argv, setup.log_dir)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"{url}/health", service=server, timeout_s=START_TIMEOUT_S)
        semaphore = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=url) as client:

            async def one(outcome: Outcome) -> Outcome:
                async with semaphore:
                    return await send(client, outcome.path, outcome.body, outcome.key, timeout_s)

            replies = await asyncio.gather(*(one(o) for o in bodies))
        return {"outputs": outputs(replies), "errors": sum(not r.ok for r in replies)}
    finally:
        await stop(server)


async def _run(args: argparse.Namespace, setup: Setup, load: Workload) -> dict[str, Any]:
    slo = Slo(args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    names = [name.strip() for name in str(args.stacks).split(",") if name.strip()]
    unknown = sorted(set(names) - set(STACKS))
    if unknown:
        raise SystemExit(f"unknown stacks {unknown}; choose from {STACKS}")
    results: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[Outcome]] = {}
    for name in names:
        results[name], answers[name] = await _bench_stack(name, setup, load, slo)
    agreement: dict[str, Any] = {}
    ran = [name for name in names if answers[name]]
    if ran:
        first = ran[0]
        agreement["reference_stack"] = first
        for name in ran[1:]:
            agreement[f"{name}_vs_{first}"] = output_agreement(
                outputs(answers[name]), outputs(answers[first])
            )
        if not args.no_colocated:
            try:
                colocated = await _colocated(setup, answers[first], load.timeout_s)
            except (RuntimeError, OSError) as exc:
                agreement["colocated"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            else:
                agreement["colocated_errors"] = colocated["errors"]
                for name in ran:
                    agreement[f"{name}_vs_colocated"] = output_agreement(
                        outputs(answers[name]), colocated["outputs"]
                    )
    return {"stacks": results, "greedy_outputs": agreement}


def _list(text: str, kind: type[float] | type[int]) -> tuple[Any, ...]:
    return tuple(kind(part) for part in str(text).split(",") if part.strip())


def run(args: argparse.Namespace) -> dict[str, Any]:
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-peers-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or make_tiny_model(work_dir / "tiny-model")
    config = read_model_config(model)
    settings = EngineSettings(
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=args.max_model_len or int(config.get("max_position_embeddings", 2048)),
    )
    layout = Layout(args.prefill_pp, args.prefill_tp, args.decode_pp, args.decode_tp)
    setup = Setup(Path(model).resolve(), Path(model).resolve().name, settings, layout, work_dir)
    load = Workload(
        model=setup.served_model,
        rates=_list(args.rates, float),
        requests_per_rate=args.requests_per_rate,
        prompt_words=_list(args.prompt_words, int),
        max_tokens=args.max_tokens,
        conversations=args.conversations,
        turns=args.turns,
        system_prompts=args.system_prompts,
        system_words=args.system_words,
        user_words=args.user_words,
        chat_rate=args.chat_rate,
        concurrency=_list(args.concurrency, int),
        requests_per_concurrency=args.requests_per_concurrency,
        seed=args.seed,
        timeout_s=args.request_timeout_s,
        streamed_tokens=_list(args.streamed_tokens, int),
        streamed_requests=args.streamed_requests,
    )
    load_before = load_average()
    measured = asyncio.run(_run(args, setup, load))
    result = {
        "benchmark": "peers",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "setup": {
            "model": str(setup.model),
            "engine_settings": vars(settings) | {"max_num_seqs": "vLLM's default (both)"},
            "layout": layout.describe(),
            "slo": {"ttft_ms": args.ttft_slo_ms, "itl_ms": args.itl_slo_ms},
            "workload": {k: v for k, v in vars(load).items() if k != "model"},
        },
        **measured,
    }
    result["comparison"] = comparison(result["stacks"])
    result["table"] = table(result["stacks"], result["greedy_outputs"])
    sys.stderr.write("\n".join(result["table"]) + "\n")
    if args.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    return result
