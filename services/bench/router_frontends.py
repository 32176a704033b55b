"""The front-end columns of ``pdserve bench router`` (:mod:`services.bench.router`): the same
completions and chat requests through two OpenAI front ends over the generated tiny
checkpoint's tokenizer and chat template, and their router CPU per request side by side
(``frontend_comparison``).

- ``pdserve``: pdserve's router (vLLM's front end over its executor; ``--tokenizer`` the tiny
  checkpoint) over the two instant stub engines;
- ``vllm_api_server``: vLLM's own API server (``python -m vllm.entrypoints.openai.api_server``,
  the front end a user of llm-d or vllm-router runs before each engine) on the tiny checkpoint.
  Its engine runs in a child process (``EngineCore``), so the API server process's own CPU
  (every thread, no child) is its front end's; the engine's is reported as the stubs'. Its
  engine is a real (tiny) model, not instant: its rates and latencies are the model's, its CPU
  per request is still the front end's alone.

pdserve's stubs draw their tokens from the checkpoint's vocabulary (:data:`TINY_VOCAB`), which
its front end detokenizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from services.bench.procs import start, stop
from services.bench.router_load import (
    BODY,
    Placement,
    Target,
    measure,
    wait_http,
)
from services.control_plane.local_redis import free_port
from services.engines.reference.tiny_model import make_tiny_model

TINY_VOCAB = 384
"""The generated tiny checkpoint's vocabulary (``pdserve make-tiny-model``)."""

COLUMNS = ("pdserve", "vllm_api_server")
VLLM_START_TIMEOUT_S = 600.0
"""vLLM's API server starts its engine process and loads the model: minutes on a loaded
machine."""


def tiny_model(log_dir: Path) -> Path:
    """The tiny checkpoint, generated once in ``log_dir``."""
    model = log_dir / "tiny-model"
    return model if (model / "config.json").exists() else make_tiny_model(model)


def frontend_flags(model: Path) -> list[str]:
    """Router flags of its front end over the tiny checkpoint, serving the stubs' model."""
    return [
        "--tokenizer", str(model), "--served-model-name", "stub",
        "--frontend-arg=--max-model-len=512",
    ]  # fmt: skip


async def bench_vllm_api_server(
    args: argparse.Namespace,
    model: Path,
    instant: Target,
    placement: Placement,
    log_dir: Path,
) -> dict[str, Any]:
    """vLLM's own API server on the tiny checkpoint, measured as a router is."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "stub", "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "512", "--block-size", "32", "--host", "127.0.0.1",
        "--port", str(port), "--disable-log-stats", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    server = await start("vllm-api-server", argv, log_dir, cores=placement.router, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"{url}/health", service=server, timeout_s=VLLM_START_TIMEOUT_S)
        await wait_http(f"{url}/v1/completions", "POST", json.loads(BODY), service=server)
        target = Target(
            f"{url}/v1/completions",
            router=[server],
            chat_url=f"{url}/v1/chat/completions",
            router_children=False,
        )
        return await measure(target, instant, args, placement, log_dir)
    finally:
        await stop(server)


def frontend_comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Router CPU per completion and per chat completion of each measured front end
    (:data:`COLUMNS`), their ratios to pdserve's router's, best rates and CPU per extra
    streamed token."""

    def column(pick: Any) -> dict[str, Any]:
        return {name: pick(result) for name, result in results.items()}

    def ratio(figures: dict[str, float | None]) -> dict[str, float | None]:
        base = figures.get("pdserve")
        return {
            name: value / base if value and base else None
            for name, value in figures.items()
            if name != "pdserve"
        }

    completions = column(lambda r: r["router_cpu_ms_per_request"])
    chat = column(lambda r: r["chat"]["router_cpu_ms_per_request"] if "chat" in r else None)
    return {
        "tokenizer": "the generated tiny checkpoint's (its chat template for chat)",
        "router_cpu_ms_per_request": completions,
        "router_cpu_ratio": ratio(completions),
        "chat_router_cpu_ms_per_request": chat,
        "chat_router_cpu_ratio": ratio(chat),
        "max_sustained_rps": column(lambda r: r["max_sustained_rps"]),
        "router_cpu_ms_per_extra_token": column(
            lambda r: r["streamed"]["router_cpu_ms_per_extra_token"] if "streamed" in r else None
        ),
    }
