"""The command line of ``pdserve up`` (see :mod:`services.cli.up` for what it does)."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.cli.up_models import model_spec

TINY_MODEL_DIR = "tiny-model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-dir", type=Path, default=Path(".run"), help="where run-time files go"
    )
    parser.add_argument(
        "--redis-port", type=int, default=None, help="port of the embedded Redis (default: free)"
    )
    parser.add_argument(
        "--exit-after", type=float, default=None, help="stop after this many seconds (tests)"
    )
    parser.add_argument(
        "--no-engines",
        action="store_true",
        help="start the control plane and the readiness display only",
    )
    parser.add_argument(
        "--model",
        action="append",
        type=model_spec,
        default=[],
        metavar="DIR[,KEY=VALUE...]",
        help="a base model to serve: its folder (engines register it by the folder's name), "
        "then its own pools and front-end flags: prefill-replicas=N, prefill-pp=N, "
        "prefill-tp=N, decode-replicas=N, decode-pp=N, decode-tp=N (default: the flags of "
        "those names), frontend-arg=FLAG (repeatable). Repeat for several base models behind "
        "the one router (default: the tiny checkpoint, made in "
        f"WORK_DIR/{TINY_MODEL_DIR})",
    )
    parser.add_argument(
        "--engine",
        default="reference",
        help="engine backend: reference (CPU), vllm, stub or sim (GPU timing, no compute)",
    )
    parser.add_argument(
        "--sim-profile",
        metavar="NAME|PATH",
        default=None,
        help="sim engines' timing profile (pdserve prefill --sim-profile; default: theirs)",
    )
    parser.add_argument("--prefill-pp", type=int, default=1, help="prefill engines' PP size")
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill engines' TP size")
    parser.add_argument("--decode-pp", type=int, default=1, help="decode engines' PP size")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode engines' TP size")
    parser.add_argument(
        "--prefill-replicas", type=int, default=1, help="prefill engines (of each model)"
    )
    parser.add_argument(
        "--decode-replicas", type=int, default=1, help="decode engines (of each model)"
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="no disaggregation: decode engines serve whole requests (for comparison)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the router binds")
    parser.add_argument("--port", type=int, default=8000, help="router port (0: a free one)")
    parser.add_argument(
        "--router-workers",
        type=int,
        default=1,
        help="router processes sharing the port (pdserve router --workers; default 1)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for pdserve router (repeatable)",
    )
    parser.add_argument(
        "--frontend-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM server flag for the router's front end (vLLM's; repeatable; e.g. "
        "--frontend-arg=--tool-call-parser=hermes --frontend-arg=--enable-auto-tool-choice)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="engines' KV block size")
    parser.add_argument(
        "--dtype", default=None, help="engines' dtype (float32, bfloat16...; default: engine's)"
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every pdserve prefill/decode (repeatable)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="vllm: serve LoRA adapters (vLLM's --enable-lora on the engines and the router's "
        "front end; size the engines with --engine-arg=--max-loras=N and "
        "--engine-arg=--max-lora-rank=R); load them at run time through the router's "
        "/v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM's server",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="vllm: LoRA adapters to serve from the start (vLLM's --lora-modules; implies "
        "--enable-lora): every engine loads them before it is READY, the router lists them "
        "in /v1/models",
    )
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="run pdserve planner over the router and start/drain engines to its desired "
        "pool sizes (the replicas flags are the starting sizes)",
    )
    parser.add_argument(
        "--planner-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for pdserve planner with --autoscale (repeatable; e.g. "
        "--planner-arg=--ttft-ms=300 --planner-arg=--decode-max=4)",
    )
    parser.add_argument(
        "--autoscale-poll-s",
        type=float,
        default=2.0,
        help="how often --autoscale reads the planner's decisions",
    )
    parser.add_argument(
        "--scale-down-timeout-s",
        type=float,
        default=120.0,
        help="bound of a released engine's drain (longer than the engines' drain bound)",
    )
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="also run a local Prometheus scraping every process, with the alert rules",
    )
    parser.add_argument(
        "--prometheus-scrape-interval-s", type=float, default=2.0, help="its scrape interval"
    )
    parser.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="bound of the start-up (model loading included)",
    )
    parser.add_argument(
        "--stop-timeout-s", type=float, default=30.0, help="bound of each child's clean stop"
    )
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start an engine that exits on its own again, after a back-off (default: on)",
    )
    parser.add_argument(
        "--restart-limit",
        type=int,
        default=5,
        help="fast failures in a row restarted (before READY or within --restart-stable-s "
        "of it); the next one is a crash loop: no more restarts, an error (default 5)",
    )
    parser.add_argument(
        "--restart-backoff-s",
        type=float,
        default=1.0,
        help="wait before a restart, doubled per fast failure in a row (default 1)",
    )
    parser.add_argument(
        "--restart-max-backoff-s", type=float, default=30.0, help="longest wait before a restart"
    )
    parser.add_argument(
        "--restart-stable-s",
        type=float,
        default=60.0,
        help="an engine that served this long after READY failed slowly: its count restarts",
    )
