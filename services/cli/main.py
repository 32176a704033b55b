"""``pdserve``: one console script for every service, tool and benchmark.

Subcommands: ``up`` (the system on one machine), ``router`` (the OpenAI-compatible router),
``status`` (engines and readiness grids), ``planner`` (pool sizes for the SLOs),
``profile`` (a running layout measured into a profile),
``bench`` (benchmarks printing JSON), ``make-tiny-model`` (a local test checkpoint),
``make-synthetic-checkpoint`` (what the router reads for stub and sim engines).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from services.cli import bench, planner, profile, status, up, up_args
from services.cli import engine as engine_cli
from services.cli import router as router_cli
from services.cli.settings import add_control_plane_flags, resolve
from services.control_plane import ControlPlaneError
from services.control_plane.wire import EngineRole
from services.lifetime import collection_deferred_until_serving, end_process

logger = logging.getLogger("pdserve")

SERVING_COMMANDS = ("router", EngineRole.PREFILL.value, EngineRole.DECODE.value)
"""The commands whose process serves until stopped (their start defers the collector)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default)...")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status_parser = commands.add_parser(
        "status", help="engines, generations, leases and the (pp, tp) readiness grid"
    )
    add_control_plane_flags(status_parser)
    status.add_arguments(status_parser)

    up_parser = commands.add_parser(
        "up", help="the whole system on this machine", allow_abbrev=False
    )
    add_control_plane_flags(up_parser)
    up_args.add_arguments(up_parser)

    tiny = commands.add_parser(
        "make-tiny-model",
        help="write a small deterministic Llama checkpoint with its tokenizer (no downloads)",
        add_help=False,
    )
    tiny.add_argument("rest", nargs=argparse.REMAINDER)

    synthetic = commands.add_parser(
        "make-synthetic-checkpoint",
        help="write the checkpoint the router reads for stub or sim engines (no weights)",
    )
    synthetic.add_argument("directory")
    synthetic.add_argument("--engine", choices=("stub", "sim"), default="stub")
    synthetic.add_argument("--sim-profile", help="the sim engines' profile (name or path)")

    router_parser = commands.add_parser(
        "router",
        help="the OpenAI-compatible router in front of the control plane's engines",
        allow_abbrev=False,  # --frontend is not --frontend-arg (a vLLM flag's value)
    )
    add_control_plane_flags(router_parser)
    router_cli.add_arguments(router_parser)

    for role in (EngineRole.PREFILL, EngineRole.DECODE):
        role_parser = commands.add_parser(
            role.value, help=f"host a {role} engine: register it, serve gRPC, drain on SIGTERM"
        )
        add_control_plane_flags(role_parser)
        engine_cli.add_arguments(role_parser)

    planner_parser = commands.add_parser("planner", help=planner.HELP, description=planner.HELP)
    planner.add_arguments(planner_parser)

    profile_parser = commands.add_parser("profile", help=profile.HELP, description=profile.HELP)
    add_control_plane_flags(profile_parser)
    profile.add_arguments(profile_parser)

    bench_parser = commands.add_parser("bench", help="benchmarks printing JSON figures")
    bench.add_arguments(bench_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unparsed = parser.parse_known_args(argv)
    if args.command == "bench":
        # Flags of the chosen benchmark are parsed by its own parser (see services.cli.bench).
        args.bench_args = unparsed
    elif unparsed:
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    if args.command == "make-tiny-model":
        # Imported here: it pulls torch, which the other commands do not need.
        from services.engines.reference.tiny_model import main_make_tiny_model  # noqa: PLC0415

        return main_make_tiny_model(args.rest)
    if args.command == "make-synthetic-checkpoint":
        return _make_synthetic_checkpoint(args)
    if args.command in SERVING_COMMANDS:
        with collection_deferred_until_serving():  # freeze_startup_heap once it serves
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        settings = resolve(args)
    except ValueError as exc:
        print(f"pdserve: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=(args.log_level or settings.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "status":
            return status.run(args, settings.control_plane)
        if args.command == "up":
            return up.run(args, settings)
        if args.command == "router":
            return router_cli.run(args, settings)
        if args.command == "planner":
            return planner.run(args)
        if args.command == "profile":
            return profile.run(args, settings.control_plane)
        if args.command in (EngineRole.PREFILL, EngineRole.DECODE):
            return engine_cli.run(args, settings, EngineRole(args.command))
        return bench.run(args, settings)
    except ControlPlaneError as exc:
        print(f"pdserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _make_synthetic_checkpoint(args: argparse.Namespace) -> int:
    """Print the checkpoint's folder and the model name to serve it as (``pdserve router
    --tokenizer DIR --served-model-name NAME``)."""
    from services.engines.registry import synthetic_model  # noqa: PLC0415
    from services.tokenization.synthetic_checkpoint import (  # noqa: PLC0415
        write_synthetic_checkpoint,
    )

    model = synthetic_model(args.engine, sim_profile=args.sim_profile)
    path = write_synthetic_checkpoint(
        args.directory, vocab_size=model.vocab_size, max_model_len=model.max_model_len
    )
    print(f"{path} {model.name}")
    return 0


if __name__ == "__main__":
    exit_code = main()
    if exit_code == 0:
        # Done, and everything released (an engine host's clean stop ends there already): the
        # interpreter's finalization would only free memory (services/lifetime/process_exit.py).
        end_process(exit_code)
    sys.exit(exit_code)
