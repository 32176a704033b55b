"""``pdserve router``: the OpenAI-compatible router in front of the engines of a control plane.

Settings come from ``PDSERVE_ROUTER_...`` (see :class:`services.router.config.RouterSettings`;
API keys only from the environment, never from flags, so they stay out of ``ps``), the control
plane from ``PDSERVE_CONTROL_PLANE__...`` / ``--redis``; flags override the environment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from services.cli.model_spec import parse_model_spec
from services.cli.settings import ToolSettings
from services.engines.vllm.version_guard import VllmVersionMismatch
from services.router.config import PolicyName, RouterSettings, ServedModelSettings
from services.router.main import run as serve_router
from services.router.main import vllm_frontend_args
from services.router.workers import serve_workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="the checkpoint folder the front end reads (tokenizer, chat template, context; "
        "pdserve make-synthetic-checkpoint writes one for stub and sim engines); required",
    )
    parser.add_argument(
        "--frontend-arg",
        action="append",
        dest="frontend_args",
        metavar="FLAG",
        help="a vLLM server flag for the front end, vLLM's (repeatable; e.g. "
        "--frontend-arg=--tool-call-parser=hermes)",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name, as its engines register it (default: the --tokenizer "
        "folder's name)",
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        type=_served_model,
        metavar="DIR[,name=NAME][,frontend-arg=FLAG...]",
        help="a base model to serve (repeatable; after --tokenizer's when that is given): its "
        "checkpoint folder, the name its engines register (default: the folder's) and vLLM "
        "flags of its own front end; a request goes to the model its 'model' field names",
    )
    parser.add_argument("--policy", choices=get_args(PolicyName), help="routing policy")
    parser.add_argument(
        "--local-max-prompt-tokens",
        type=int,
        help="prompts up to this many tokens run on the decode engine alone (0: never)",
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        default=None,
        help="no disaggregation: every request runs on a decode engine alone",
    )
    parser.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_const",
        const=False,
        default=None,
        help="do not follow the engines' KV-cache events: prefix_aware places by what it sent "
        "and what engines report (PDSERVE_ROUTER_KV_EVENTS=false)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="router processes sharing the port (SO_REUSEPORT; default 1)",
    )
    parser.add_argument(
        "--worker-metrics-port",
        type=int,
        help="with --workers > 1: worker i serves its own /metrics on this port + i "
        "(default 0: free ports, listed in the PDSERVE_READY line)",
    )


def _served_model(text: str) -> ServedModelSettings:
    spec = parse_model_spec(text, {"name"})
    return ServedModelSettings(
        tokenizer=spec.path,
        served_model_name=spec.options.get("name"),
        frontend_args=list(spec.frontend_args),
    )


def build_settings(args: argparse.Namespace, tools: ToolSettings) -> RouterSettings:
    """Environment settings with the flags on top."""
    overrides: dict[str, object] = {"control_plane": tools.control_plane}
    names = (
        "host", "port", "tokenizer", "policy", "local_max_prompt_tokens", "colocated",
        "workers", "worker_metrics_port", "frontend_args", "served_model_name",
        "kv_events", "models",
    )  # fmt: skip
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    base = RouterSettings()
    return RouterSettings.model_validate({**base.model_dump(), **overrides})


def run(args: argparse.Namespace, tools: ToolSettings) -> int:
    try:
        settings = build_settings(args, tools)
    except ValidationError as exc:
        print(f"pdserve router: invalid settings: {exc}")
        return 2
    if settings.tokenizer is None and not settings.models:
        print(
            "pdserve router: --tokenizer is required (or a --model per base model): the "
            "checkpoint folder of the model the engines serve (pdserve "
            "make-synthetic-checkpoint writes one for stub and sim engines)",
            file=sys.stderr,
        )
        return 2
    try:  # one message naming what is wrong, before anything starts
        vllm_frontend_args(settings)  # SystemExit(2) on a flag it refuses, as vllm serve
    except VllmVersionMismatch as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        return serve_workers(settings)
    serve_router(settings)
    return 0
