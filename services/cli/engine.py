"""``pdserve prefill`` and ``pdserve decode``: one implementation, the role is the only difference.

Flags override the environment (:class:`~services.serving.host.config.EngineServiceSettings`,
``PDSERVE_...``; the control plane's ``--redis``/``--namespace`` come from
:mod:`services.cli.settings`); the role's service comes from its package
(:mod:`services.prefill`, :mod:`services.decode`) through :data:`ROLE_SERVICES`. A stop
(SIGTERM, SIGINT) ends within the drain bound plus :data:`STOP_OVERRUN_S`, whatever hangs. Exit
codes:
0 after a clean drain, 1 when the engine failed, never got READY or lost its registration, 2 for
invalid settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.cli.settings import ToolSettings, flag_values, overlay
from services.control_plane.wire import EngineRole, validate_identifier
from services.decode.service import DecodeService
from services.engines.errors import EngineError
from services.engines.registry import ENGINES, EngineOptions, create_backend
from services.lifetime import end_process, end_stop_within, freeze_startup_heap
from services.prefill.service import PrefillService
from services.serving.host.config import EngineServiceSettings
from services.serving.host.engine_host import EngineHost
from services.serving.host.role import RoleService

logger = logging.getLogger(__name__)

ROLE_SERVICES: dict[EngineRole, RoleService] = {
    EngineRole.PREFILL: PrefillService(),
    EngineRole.DECODE: DecodeService(),
}
"""The service each role's package hands the engine host."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve prefill`` and ``pdserve decode`` (``--redis``/``--namespace`` are
    added by the caller, as for every command)."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", type=Path, help="local model folder (HF config + weights)")
    engine.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="reference",
        help="engine backend (default: reference, the CPU engine)",
    )
    engine.add_argument("--engine-id", help="engine id (default: the role and a random suffix)")
    engine.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    engine.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    engine.add_argument(
        "--layer-partition",
        type=_partition,
        default=None,
        metavar="N,N,...",
        help="layers per PP stage (default: even split)",
    )
    engine.add_argument("--num-kv-blocks", type=int, help="KV blocks per rank")
    engine.add_argument("--block-size", type=int, help="tokens per KV block")
    engine.add_argument(
        "--dtype", help="weights/activations/KV dtype: float32, bfloat16, float16 (vLLM: auto)"
    )
    engine.add_argument("--max-model-len", type=int, help="vllm: context length")
    engine.add_argument(
        "--kv-cache-gib", type=float, help="vllm: KV cache size (default: vLLM's; 1 on CPUs)"
    )
    engine.add_argument(
        "--enforce-eager", action="store_true", help="vllm: no compiled graphs (faster start)"
    )
    engine.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        help="vllm, reference: how vLLM's engine core and workers or the reference engine's "
        "ranks start: fork (default: from this host, which has their modules loaded; spawned, "
        "each imports vLLM or torch afresh) or spawn",
    )
    engine.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="vllm: send vLLM's OpenTelemetry request spans there (children of the trace "
        "context the router forwards)",
    )
    engine.add_argument(
        "--transfer-mode",
        choices=("push", "pull"),
        help="vllm: prefill WRITEs the KV (push, default; needed for prefill PP > 1) or decode "
        "READs it (pull); both sides must use the same",
    )
    engine.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="reference, vllm, sim: do not publish KV-cache events (default: published on two "
        "ephemeral ports, named in the engine's control-plane record)",
    )
    engine.add_argument(
        "--kv-lease-s", type=float, help="how long a prefill engine holds KV for its consumer"
    )
    engine.add_argument(
        "--enable-lora",
        action="store_true",
        help="vllm: serve LoRA adapters (vLLM's --enable-lora): the engine registers its slots "
        "(--max-loras) and runs requests naming an adapter with it",
    )
    engine.add_argument(
        "--max-loras", type=int, help="vllm: adapters run at once in a batch (default 1)"
    )
    engine.add_argument(
        "--max-lora-rank", type=int, help="vllm: the largest adapter rank (default 16)"
    )
    engine.add_argument(
        "--max-cpu-loras",
        type=int,
        help="vllm: adapters kept loaded, least recently used evicted beyond (default: "
        "--max-loras)",
    )
    engine.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        type=_lora_module,
        metavar="NAME=PATH",
        help="vllm: adapters loaded before the engine is READY (implies --enable-lora)",
    )
    engine.add_argument(
        "--stub-token-delay-s", type=float, default=0.0, help=argparse.SUPPRESS
    )  # stub engine only (tests)
    engine.add_argument("--stub-vocab-size", type=int, help=argparse.SUPPRESS)  # (benchmarks)
    engine.add_argument(
        "--sim-profile",
        metavar="NAME|PATH",
        help="sim: the GPU timing profile, a shipped one's name or a JSON file "
        "(default: llama-3.1-8b-h100)",
    )
    engine.add_argument(
        "--sim-time-scale",
        type=float,
        metavar="S",
        help="sim: wall seconds per simulated second (default 1; 2 runs at half speed, for "
        "more engines or tokens a second than this machine can follow in real time)",
    )
    service = parser.add_argument_group("service")
    service.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="gRPC address to bind (port 0 picks one; default 0.0.0.0:50051)",
    )
    service.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="endpoint registered for routers (default: the bound address)",
    )
    service.add_argument("--metrics-port", type=int, help="serve /metrics here (0 picks one)")
    service.add_argument(
        "--drain-timeout-s", type=float, help="bound of the drain on SIGTERM (default 60)"
    )
    service.add_argument(
        "--ready-timeout-s", type=float, help="bound of start-up until READY (default 300)"
    )
    service.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate (PEM)")
    service.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    service.add_argument(
        "--tls-client-ca",
        type=Path,
        help="require client certificates signed by this CA (mutual TLS)",
    )


def _partition(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,N,... got {text!r}") from None
    if not parts or any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError("layer counts must be >= 1")
    return parts


def build_settings(args: argparse.Namespace, tool: ToolSettings) -> EngineServiceSettings:
    """Environment settings with the command's flags on top (raises ``ValueError``)."""
    settings = EngineServiceSettings()
    grpc_flags = {
        "listen": "listen",
        "advertise": "advertise",
        "tls_cert": "tls_cert_file",
        "tls_key": "tls_key_file",
        "tls_client_ca": "tls_client_ca_file",
    }
    return overlay(
        settings,
        {
            "control_plane": tool.control_plane,
            "grpc": overlay(settings.grpc, flag_values(args, grpc_flags)),
            **flag_values(args, ("metrics_port", "drain_timeout_s", "ready_timeout_s")),
        },
    )


def _lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH`` (vLLM's ``--lora-modules`` short form) as ``(name, path)``."""
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


FORKING_ENGINES = frozenset({"vllm", "reference"})
"""Engines whose processes this host forks unless ``--start-method`` says otherwise."""


def host_start_method(engine: str, flag: str | None) -> str | None:
    """vLLM's engine core and workers and the reference engine's ranks are forked from this
    host unless ``--start-method`` says otherwise: the host has their modules loaded and runs
    no multi-threaded torch kernel (docs/vllm.md, ``ReferenceEngineOptions.start_method``);
    the synthetic engines take no start method."""
    if flag is not None or engine not in FORKING_ENGINES:
        return flag
    return "fork"


def run(args: argparse.Namespace, tool: ToolSettings, role: EngineRole) -> int:
    try:
        settings = build_settings(args, tool)
        engine_id = validate_identifier(
            args.engine_id or f"{role.value}-{uuid.uuid4().hex[:8]}", "engine id"
        )
        options = EngineOptions(
            model_dir=args.model,
            pp_size=args.pp,
            tp_size=args.tp,
            layer_partition=args.layer_partition,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            kv_lease_s=args.kv_lease_s,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_cache_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
            enforce_eager=args.enforce_eager,
            start_method=host_start_method(args.engine, args.start_method),
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            transfer_mode=args.transfer_mode,
            kv_events=args.kv_events,
            stub_token_delay_s=args.stub_token_delay_s,
            stub_vocab_size=args.stub_vocab_size,
            sim_profile=args.sim_profile,
            sim_time_scale=args.sim_time_scale,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            lora_modules=tuple(args.lora_modules),
        )
        registry = CollectorRegistry()
        backend = create_backend(args.engine, options, registry=registry)
    except (ValueError, ValidationError, EngineError) as exc:
        print(f"pdserve {role.value}: {exc}", file=sys.stderr)
        return 2
    host = EngineHost(
        settings,
        backend,
        engine_id=engine_id,
        service=ROLE_SERVICES[role],
        registry=registry,
        on_ready=freeze_startup_heap,
    )
    code = asyncio.run(_serve(host))
    if code == 0:
        # A clean stop released everything (servers, registration, ranks or vLLM's processes):
        # the interpreter's finalization would only free memory, a second of CPU per stop.
        end_process(code)
    return code


STOP_OVERRUN_S = 30.0
"""Past the drain bound, what the rest of a stop may take (deregistration, the gRPC server's
grace, the backend's stop) before the process is killed with its ranks
(:func:`~services.lifetime.end_stop_within`): a stop never waits on Redis or a hung rank."""


async def _serve(host: EngineHost) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        if not stop.is_set():
            stop.set()
            bound_s = host.settings.drain_timeout_s + STOP_OVERRUN_S
            end_stop_within(bound_s, name=f"engine {host.engine_id}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    return await host.run(stop)
