"""The figures of ``pdserve bench routing`` (:mod:`services.bench.routing`): each request's
:class:`Turn`, a setting's figures from its turns and the engines' KV bytes moved
(:func:`summarize`, :func:`live_shares`), and each setting beside ``approximate``'s
(:func:`comparison`). The module docstring of :mod:`services.bench.routing` says what each
figure means."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.routing_oracle import LiveSample
from services.bench.soak import percentiles_ms


@dataclass
class Turn:
    """One request's result."""

    prompt_tokens: int
    reusable_tokens: int
    """The never-evict oracle's (:class:`NeverEvictOracle`)."""
    live: LiveSample | None = None
    """The live oracle's, at the send (:class:`LiveOracle`)."""
    ok: bool = False
    cached_tokens: int = 0
    ttft_s: float | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    path: str | None = None
    """``x-pdserve-execution-path``: ``disaggregated``, or ``local`` (the decode engine ran it
    alone: it held the prompt, so nothing moved)."""
    error: str | None = None
    conversation: int = 0
    """Which conversation and which of its turns (0 first)."""
    index: int = 0
    adapter: str | None = None
    """The LoRA adapter it ran with (``None``: the base model)."""


def kv_bytes(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        text = httpx.get(url, timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name == "pdserve_kv_transfer_bytes":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def kv_bytes_per_token(model_dir: Path, engine: str, dtype: str | None) -> float | None:
    """K and V of one token over every layer, from the checkpoint's ``config.json``, in
    ``dtype`` (default: float32 on the reference engine, the config's dtype on vLLM)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if dtype is None:
        dtype = "float32" if engine == "reference" else str(config.get("torch_dtype", "bfloat16"))
    element = 4 if dtype == "float32" else 2
    return float(2 * config["num_hidden_layers"] * heads * head_dim * element)


def summarize(
    turns: list[Turn], moved_bytes: float, bytes_per_token: float | None, elapsed_s: float
) -> dict[str, Any]:
    done = [turn for turn in turns if turn.ok]
    reusable = sum(turn.reusable_tokens for turn in done)
    cached = sum(min(turn.cached_tokens, turn.prompt_tokens) for turn in done)
    prompt = sum(turn.prompt_tokens for turn in done)
    moved_to = [turn for turn in done if turn.path == "disaggregated"]
    moved_reusable = sum(turn.reusable_tokens for turn in moved_to)
    decode_share = None
    if bytes_per_token and moved_reusable:
        # Of the requests whose KV moved: every prompt token their decode engine lacked moved
        # once, what it held did not (an estimate from the bytes; a partial last block moves
        # too, so a decode engine holding everything reusable scores about 1).
        lacking = moved_bytes / bytes_per_token
        fresh = sum(turn.prompt_tokens for turn in moved_to) - moved_reusable
        decode_share = round(min(1.0, max(0.0, 1 - max(0.0, lacking - fresh) / moved_reusable)), 4)
    errors = [turn.error for turn in turns if not turn.ok]
    return {
        "problems": blind_to_the_cache(reusable, cached),
        "requests": len(turns),
        "errors": len(errors),
        "first_errors": errors[:3],
        "elapsed_s": round(elapsed_s, 2),
        "prompt_tokens": prompt,
        "reusable_tokens": reusable,
        "cached_tokens": cached,
        "prefill_cached_share": round(cached / reusable, 4) if reusable else None,
        "prefill_tokens_computed": prompt - cached,
        "kv_bytes_moved_per_request": round(moved_bytes / len(done)) if done else None,
        "decode_cached_share": decode_share,
        "local_runs": sum(turn.path == "local" for turn in done),
        **live_shares(done),
        "ttft_ms": percentiles_ms([t.ttft_s for t in done if t.ttft_s is not None]),
        "prefill_engines": sorted({t.prefill_engine for t in done if t.prefill_engine}),
        "decode_engines": sorted({t.decode_engine for t in done if t.decode_engine}),
    }


def blind_to_the_cache(reusable_tokens: int, cached_tokens: int) -> list[str]:
    """A workload whose prompts reuse blocks but whose answers report no cached token at all
    measures nothing about placement (the usage's cached tokens went unreported): said in the
    figures, not left to read as a share of 0."""
    if reusable_tokens > 0 and cached_tokens == 0:
        return [
            f"no cached tokens reported though {reusable_tokens} prompt tokens were reusable: "
            "is usage.prompt_tokens_details reported (--enable-prompt-tokens-details)?"
        ]
    return []


def live_shares(done: list[Turn]) -> dict[str, Any]:
    """The cached tokens against the live oracle, over the requests that finished. Each
    request counts at most its oracle's tokens (**capped per request**): a request that found
    more than the oracle said at its send (a block stored meanwhile) does not make up for
    another that missed. ``cached_share_of_live_oracle`` is over the best engine at all: a
    request the router runs on a decode engine alone (conditional disaggregation) finds that
    engine's cache, so every engine's cache is what a scheduler could have used;
    ``cached_share_of_live_prefill_oracle`` is over the best engine of the prefill pool (the
    bound of a scheduler that always disaggregates; a local run can beat it, capped);
    ``..._uncapped`` is plain cached over the live oracle's tokens; ``cached_above_live_oracle``
    counts the requests that found more than any engine held at their send."""
    sampled = [(turn, turn.live) for turn in done if turn.live is not None]
    if not sampled:
        return {"live_oracle_tokens": None, "cached_share_of_live_oracle": None}

    def cached(turn: Turn) -> int:
        return min(turn.cached_tokens, turn.prompt_tokens)

    def share(oracle: list[int]) -> float | None:
        total = sum(oracle)
        found = sum(min(cached(turn), o) for (turn, _), o in zip(sampled, oracle, strict=True))
        return round(found / total, 4) if total else None

    anywhere = [live.any_tokens for _, live in sampled]
    prefill = [live.prefill_tokens for _, live in sampled]
    total = sum(anywhere)
    return {
        "live_oracle_tokens": total,
        "live_prefill_oracle_tokens": sum(prefill),
        "cached_share_of_live_oracle": share(anywhere),
        "cached_share_of_live_prefill_oracle": share(prefill),
        "cached_share_of_live_oracle_uncapped": (
            round(sum(cached(turn) for turn, _ in sampled) / total, 4) if total else None
        ),
        "cached_above_live_oracle": sum(cached(turn) > live.any_tokens for turn, live in sampled),
    }


def comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Each setting's figures beside ``approximate``'s with the same router workers."""
    rows: dict[str, Any] = {}
    for name, figures in results.items():
        policy, workers = name.split("/")
        baseline = results.get(f"approximate/{workers}")
        if baseline is None or policy == "approximate":
            continue
        rows[name] = {
            key: {"this": figures.get(key), "approximate": baseline.get(key)}
            for key in (
                "prefill_cached_share",
                "cached_share_of_live_oracle",
                "cached_share_of_live_prefill_oracle",
                "decode_cached_share",
                "kv_bytes_moved_per_request",
                "prefill_tokens_computed",
            )
        }
        rows[name]["ttft_p50_ms"] = {
            "this": figures["ttft_ms"]["p50"],
            "approximate": baseline["ttft_ms"]["p50"],
        }
    return rows
