"""``pdserve bench <name>``: run one benchmark and print its JSON figures."""

from __future__ import annotations

import argparse
import json

from services.bench import control_plane as control_plane_bench
from services.bench import engine as engine_bench
from services.bench import kv as kv_bench
from services.bench import router as router_bench
from services.bench import soak as soak_bench
from services.cli.settings import ToolSettings, add_control_plane_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    cp = benches.add_parser("control-plane", help="READY latency and Redis round trips per worker")
    add_control_plane_flags(cp)
    cp.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    control_plane_bench.add_arguments(cp)
    kv = benches.add_parser(
        "kv", help="NIXL KV pulls across processes: GB/s next to memcpy, descriptor cost"
    )
    kv.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    kv_bench.add_arguments(kv)
    router = benches.add_parser(
        "router", help="router overhead over instant stub engines, next to vllm-router"
    )
    add_control_plane_flags(router)
    router.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    router_bench.add_arguments(router)
    engine = benches.add_parser(
        "engine", help="reference engine tokens/s and the KV-transfer share of TTFT"
    )
    engine.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    engine_bench.add_arguments(engine)
    soak = benches.add_parser(
        "soak", help="thousands of requests through pdserve up: errors, TTFT/ITL, RSS growth"
    )
    soak.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    soak_bench.add_arguments(soak)


def run(args: argparse.Namespace, settings: ToolSettings) -> int:
    if args.bench == "control-plane":
        result = control_plane_bench.run(args, settings.control_plane)
    elif args.bench == "kv":
        result = kv_bench.run(args)
    elif args.bench == "router":
        result = router_bench.run(args, settings.control_plane)
    elif args.bench == "engine":
        result = engine_bench.run(args)
    elif args.bench == "soak":
        result = soak_bench.run(args)
    else:  # pragma: no cover - argparse restricts choices
        raise SystemExit(f"unknown benchmark {args.bench}")
    print(json.dumps(result, indent=2))
    return 0
