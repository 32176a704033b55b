"""``pdserve bench <name>``: run one benchmark and print its JSON figures.

Benchmarks pull torch, NIXL or the reference engine, which the other commands do not need, so
their modules are imported only when one is run: ``pdserve bench NAME ...`` is parsed in two
stages, the second by a parser built from the chosen benchmark's module.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass

from services.cli.settings import ToolSettings, add_control_plane_flags, resolve


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    help: str
    control_plane_flags: bool = False


BENCHMARKS = (
    Benchmark(
        "control-plane",
        "services.bench.control_plane",
        "READY latency and Redis round trips per worker",
        control_plane_flags=True,
    ),
    Benchmark("kv", "services.bench.kv", "NIXL KV pulls across processes: GB/s next to memcpy"),
    Benchmark(
        "router",
        "services.bench.router",
        "router overhead over instant stub engines, next to vllm-router",
        control_plane_flags=True,
    ),
    Benchmark(
        "engine",
        "services.bench.engine",
        "engine tokens/s and the KV share of TTFT (reference or vLLM)",
    ),
    Benchmark(
        "soak",
        "services.bench.soak",
        "thousands of requests through pdserve up: errors, TTFT/ITL, RSS growth",
    ),
    Benchmark(
        "routing",
        "services.bench.routing",
        "multi-turn chats through pdserve up: cached share of reusable prompt tokens per pool, "
        "KV bytes moved, TTFT; round-robin, approximate and KV-event placement side by side",
    ),
    Benchmark(
        "trace",
        "services.bench.trace",
        "a Mooncake-format trace through pdserve up --engine sim, per fleet size and routing "
        "setting: cached share beside the ceiling and an offline oracle, TTFT/ITL, goodput, "
        "KV bytes moved, router CPU (PNG)",
    ),
    Benchmark(
        "goodput",
        "services.bench.goodput",
        "simulated GPU engines through the real router: PD splits against colocated "
        "(goodput at TTFT/ITL SLOs over a rate sweep, PNG) and --autoscale against fixed pools",
    ),
    Benchmark(
        "peers",
        "services.bench.peers",
        "pdserve against vLLM's own PD stack (vllm serve + NixlConnector behind vllm-router) "
        "on the same engines and load: latency, goodput, CPU per request of every process, "
        "greedy outputs",
    ),
    Benchmark(
        "relay",
        "services.bench.relay",
        "a decode host's gRPC server CPU per streamed token: one message per token and stream "
        "against one message per engine step for every stream",
    ),
    Benchmark(
        "chaos",
        "services.bench.chaos",
        "load through pdserve up (2 prefill, 2 decode) while engine processes fail: "
        "failed, migrated, retried, added latency",
    ),
)
_BY_NAME = {bench.name: bench for bench in BENCHMARKS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for bench in BENCHMARKS:
        # Stage one only names the benchmark: everything after it is left unparsed (in order)
        # for :func:`benchmark_parser`, built once its module is imported (--help included).
        benches.add_parser(bench.name, help=bench.help, add_help=False)


def benchmark_parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The full parser of one benchmark (imports its module)."""
    module = importlib.import_module(bench.module)
    parser = argparse.ArgumentParser(prog=f"pdserve bench {bench.name}", description=bench.help)
    if bench.control_plane_flags:
        add_control_plane_flags(parser)
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    module.add_arguments(parser)
    return parser


def run(args: argparse.Namespace, settings: ToolSettings) -> int:
    """``args.bench_args``: the flags stage one left unparsed."""
    bench = _BY_NAME[args.bench]
    bench_args = benchmark_parser(bench).parse_args(args.bench_args)
    module = importlib.import_module(bench.module)
    if bench.control_plane_flags:
        settings = resolve(bench_args)
        result = module.run(bench_args, settings.control_plane)
    else:
        result = module.run(bench_args)
    print(json.dumps(result, indent=2))
    return 0
