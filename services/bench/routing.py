"""``pdserve bench routing``: multi-turn conversations through ``pdserve up``, one fresh stack
per routing setting, side by side in one run.

The workload: ``--conversations`` chats arrive as a Poisson process (``--rate`` per second);
each opens with one of ``--system-prompts`` shared system prompts and runs ``--turns`` turns.
Turn ``t``'s prompt is turn ``t - 1``'s prompt plus the assistant's reply and the next user
message (token ids, so every turn extends the last one exactly), so a scheduler that sends a
turn where the previous ones ran finds most of its prompt cached. ``--kv-blocks`` bounds every
engine's cache (a small value makes engines evict).

Settings (``--policies``; each on a fresh ``pdserve up`` with ``--prefill-replicas`` and
``--decode-replicas`` engines, per router worker count of ``--router-workers``):

- ``round_robin``: the router's ``round_robin`` policy;
- ``approximate``: ``prefix_aware`` with a router that does not follow the KV events
  (``pdserve router --no-kv-events``: what the router sent, and the reference engine's
  heartbeat report of its cache); the engines still publish them, for the live oracle;
- ``precise``: ``prefix_aware`` over the engines' KV-cache events.

Figures per setting (JSON): requests and errors; **reusable** prompt tokens (the full blocks of
a prompt that a request finished before it was sent already had: what a scheduler that knew
every cache, with no evictions, could find cached: the never-evict bound); **prefill cached
share**: ``usage.prompt_tokens_details.cached_tokens`` summed over requests / reusable tokens;
**cached share of the live oracle** (the bench follows every engine's KV events itself and
records, at each send, the longest prefix any engine holds, and any prefill engine; capped per
request: ``routing_figures.live_shares``, ``services.bench.routing_oracle``), with the oracle's
per-engine health (batches applied, losses);
**prefill tokens computed** (prompt tokens minus cached ones); **KV bytes moved per request**
(the engines' ``pdserve_kv_transfer_bytes_total``, delta over the run, over every request);
**local runs** (requests the decode engine ran alone because it held the prompt: conditional
disaggregation, nothing moved) and, over the requests whose KV did move, the **decode cached
share** the bytes imply (the reusable tokens the decode engine did not need moved; the KV bytes
per token from the model's config); TTFT p50/p99 (streamed, from the client). ``comparison``
puts each setting's shares beside ``approximate``'s. The figures are computed in
``services.bench.routing_figures``.

``--lora N`` (vLLM engines) runs each setting twice, on the base model and split over ``N``
generated LoRA adapters (``services.bench.routing_lora``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.routing_figures import (
    Turn,
    comparison,
    kv_bytes,
    kv_bytes_per_token,
    summarize,
)
from services.bench.routing_lora import adapter_of, run_lora
from services.bench.routing_oracle import (
    LiveOracle,
    NeverEvictOracle,
    follow_engines,
)
from services.bench.sse import stream_routed
from services.bench.up_stack import wait_endpoints, work_root
from services.config import ControlPlaneSettings, RedisSettings
from services.supervision import DetachedProcess

SETTINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "round_robin": (("--policy=round_robin",), ()),
    # Engines publish (the live oracle reads them); the router does not follow them.
    "approximate": (("--policy=prefix_aware", "--no-kv-events"), ()),
    "precise": (("--policy=prefix_aware",), ()),
}
"""Setting -> (router arguments, engine arguments)."""

TOKEN_RANGE = (16, 300)
"""Token ids the prompts draw from: the tiny checkpoint's ordinary tokens (its special tokens
have the lowest ids)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("reference", "vllm"), default="reference")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: tiny)")
    parser.add_argument("--policies", default=",".join(SETTINGS), help="comma-separated settings")
    parser.add_argument("--router-workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--prefill-replicas", type=int, default=2)
    parser.add_argument("--decode-replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=3, help="distinct shared ones")
    parser.add_argument("--system-tokens", type=int, default=96)
    parser.add_argument("--user-tokens", type=int, default=24, help="per user message")
    parser.add_argument("--reply-tokens", type=int, default=24, help="per assistant reply")
    parser.add_argument("--max-tokens", type=int, default=4, help="generated per request")
    parser.add_argument("--rate", type=float, default=2.0, help="conversations started per s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-blocks", type=int, default=None, help="engines' KV blocks (cache pressure)"
    )
    parser.add_argument("--dtype", default=None, help="engines' dtype (default: the engine's)")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine (repeatable; e.g. --engine-arg=--enforce-eager)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="vllm: each setting also with the conversations split over N generated LoRA "
        "adapters, beside the base model (services/bench/routing_lora.py)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument(
        "--turns-out",
        type=Path,
        default=None,
        help="folder for one JSON line per request of each setting (<policy>-<workers>.jsonl): "
        "its tokens, cached tokens, the live oracle per engine at its send, its engines, path",
    )


@dataclass
class Conversation:
    system: list[int]
    messages: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(user message, assistant reply) per turn."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    policies = [name for name in str(args.policies).split(",") if name]
    unknown = [name for name in policies if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"pdserve bench routing: unknown setting(s) {unknown}; known: {SETTINGS}")
    workers = [int(count) for count in str(args.router_workers).split(",") if count]
    if args.lora:
        return run_lora(args, policies, workers, _run_setting, _workload_figures(args))
    results: dict[str, Any] = {}
    with work_root(args.work_dir, "routing") as root:
        for count in workers:
            for policy in policies:
                name = f"{policy}/workers={count}"
                results[name] = _run_setting(args, policy, count, root / f"{policy}-{count}")
    return {
        "workload": _workload_figures(args),
        "settings": results,
        "comparison": comparison(results),
    }


def _workload_figures(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "engine", "dtype", "engine_arg", "conversations", "turns", "system_prompts",
        "system_tokens", "user_tokens", "reply_tokens", "max_tokens", "rate", "block_size",
        "kv_blocks", "prefill_replicas", "decode_replicas", "lora", "seed",
    )  # fmt: skip
    return {key: getattr(args, key) for key in keys}


def _run_setting(
    args: argparse.Namespace,
    policy: str,
    workers: int,
    work_dir: Path,
    *,
    up_args: Sequence[str] = (),
    adapters: Sequence[str] = (),
) -> Any:
    """One fresh stack (``up_args`` added to ``pdserve up``'s); conversations run with
    ``adapters`` (:func:`~services.bench.routing_lora.adapter_of`) or the base model."""
    router_args, engine_args = SETTINGS[policy]
    engine_args = (
        *engine_args,
        *((f"--num-kv-blocks={args.kv_blocks}",) if args.kv_blocks else ()),
        *args.engine_arg,
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    up = DetachedProcess.pdserve_up(
        work_dir,
        "--engine",
        args.engine,
        "--prefill-replicas",
        str(args.prefill_replicas),
        "--decode-replicas",
        str(args.decode_replicas),
        "--router-workers",
        str(workers),
        "--block-size",
        str(args.block_size),
        *(["--dtype", args.dtype] if args.dtype else []),
        *(["--model", str(args.model)] if args.model is not None else []),
        *(f"--router-arg={arg}" for arg in router_args),
        # vLLM's front end (the router's, whatever the engines) reports cached tokens only
        # with this flag, as vLLM's server does.
        "--frontend-arg=--enable-prompt-tokens-details",
        *(f"--engine-arg={arg}" for arg in engine_args),
        *up_args,
    )
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
        router = str(endpoints["router"])
        listed = httpx.get(f"{router}/v1/models", timeout=30).json()["data"]
        model = next(str(card["id"]) for card in listed if card.get("parent") is None)
        metrics = [str(url) for name, url in endpoints["metrics"].items() if name != "router"]
        moved_before = kv_bytes(metrics)
        started = time.perf_counter()
        control_plane = ControlPlaneSettings(
            redis=RedisSettings(url=str(endpoints["redis"])),
            namespace=str(endpoints["namespace"]),
        )
        turns, oracle_health = asyncio.run(_load(args, router, model, control_plane, adapters))
        elapsed = time.perf_counter() - started
        moved = kv_bytes(metrics) - moved_before
        model_dir = args.model or work_dir / "tiny-model"
        per_token = kv_bytes_per_token(model_dir, args.engine, args.dtype)
        figures = summarize(turns, moved, per_token, elapsed)
        figures["live_oracle_engines"] = oracle_health
        if args.turns_out is not None:
            _write_turns(args.turns_out / f"{policy}-{workers}.jsonl", turns)
        return figures
    finally:
        up.stop()


def _write_turns(path: Path, turns: list[Turn]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for turn in turns:
            out.write(json.dumps(dataclasses.asdict(turn)) + "\n")


def _conversations(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]

    systems = [tokens(args.system_tokens) for _ in range(args.system_prompts)]
    return [
        Conversation(
            systems[index % len(systems)],
            [(tokens(args.user_tokens), tokens(args.reply_tokens)) for _ in range(args.turns)],
        )
        for index in range(args.conversations)
    ]


async def _load(
    args: argparse.Namespace,
    router: str,
    model: str,
    control_plane: ControlPlaneSettings,
    adapters: Sequence[str],
) -> tuple[list[Turn], dict[str, object]]:
    async with follow_engines(control_plane) as live:
        turns = await _conversations_through(args, router, model, live, adapters)
        return turns, live.health()


async def _conversations_through(
    args: argparse.Namespace,
    router: str,
    model: str,
    live: LiveOracle,
    adapters: Sequence[str] = (),
) -> list[Turn]:
    conversations = _conversations(args)
    oracle = NeverEvictOracle(args.block_size)
    turns: list[Turn] = []
    rng = random.Random(args.seed + 1)
    # Idle connections expire before the router's keep-alive (uvicorn: 5 s) closes them.
    limits = httpx.Limits(
        max_connections=args.conversations, max_keepalive_connections=64, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(base_url=router, limits=limits) as client:

        async def chat(number: int, conversation: Conversation, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            prompt = list(conversation.system)
            lora = adapter_of(number, args.system_prompts, adapters)
            for index, (user, reply) in enumerate(conversation.messages):
                prompt += user
                turn = Turn(len(prompt), oracle.reusable(prompt, lora), live.at_send(prompt, lora))
                turn.conversation, turn.index, turn.adapter = number, index, lora
                turns.append(turn)
                await stream_routed(
                    client, lora or model, prompt, args.max_tokens, args.request_timeout_s, turn
                )
                oracle.finished(prompt, lora)
                prompt += reply

        delays, at = [], 0.0
        for _ in conversations:
            delays.append(at)
            at += rng.expovariate(args.rate)
        await asyncio.gather(
            *(
                chat(number, c, d)
                for number, (c, d) in enumerate(zip(conversations, delays, strict=True))
            )
        )
    return turns
