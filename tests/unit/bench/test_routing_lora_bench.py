"""``pdserve bench routing --lora``: the split of the workload over adapters, the oracles keyed
by adapter, and the headline figure (the cached share with adapters beside the base model's)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

from services.bench.routing import _conversations, add_arguments
from services.bench.routing_figures import Turn, summarize
from services.bench.routing_lora import adapter_of, lora_vs_base
from services.bench.routing_oracle import EngineCache, LiveOracle, NeverEvictOracle
from services.control_plane.wire import EngineRole
from services.kv_events.events import BlockStored, EventBatch

ADAPTERS = ("lora-0", "lora-1")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_conversations_of_a_system_prompt_share_one_adapter() -> None:
    chosen = [adapter_of(number, 4, ADAPTERS) for number in range(12)]
    assert chosen[:4] == ["lora-0", "lora-1", "lora-0", "lora-1"]
    assert chosen == chosen[:4] * 3  # conversation n has system prompt n % 4, so its adapter
    assert adapter_of(5, 4, ()) is None  # the base model


def test_both_oracles_key_an_adapters_blocks_apart() -> None:
    prompt = list(range(9))  # two full blocks and one token
    never = NeverEvictOracle(block_size=4)
    never.finished(prompt, "lora-0")
    assert never.reusable(prompt, "lora-0") == 8
    assert never.reusable(prompt, "lora-1") == never.reusable(prompt) == 0
    engine = EngineCache("d0", EngineRole.DECODE, block_size=4)
    live = LiveOracle([engine])
    # vLLM names the adapter in the event of the first stored block (no parent).
    engine.apply(0, EventBatch(0.0, (BlockStored((1, 2), None, tuple(range(8)), 4, "lora-1"),)))
    assert live.at_send(prompt, "lora-1").any_tokens == 8
    assert live.at_send(prompt, "lora-0").any_tokens == live.at_send(prompt).any_tokens == 0


def _through_one_engine(adapters: Sequence[str]) -> dict[str, Any]:
    """The workload, one turn at a time, on one engine that finds what it stored for the same
    adapter, as vLLM's prefix cache does; the figures of ``bench routing``."""
    args = _args(
        "--conversations", "6", "--system-prompts", "2", "--turns", "3", "--block-size", "4",
        "--system-tokens", "8", "--user-tokens", "4", "--reply-tokens", "4",
    )  # fmt: skip
    engine = EngineCache("d0", EngineRole.BOTH, block_size=4)
    live, never = LiveOracle([engine]), NeverEvictOracle(block_size=4)
    hashes = itertools.count(1)
    turns: list[Turn] = []
    for number, conversation in enumerate(_conversations(args)):
        lora = adapter_of(number, args.system_prompts, adapters)
        prompt = list(conversation.system)
        for user, reply in conversation.messages:
            prompt += user
            sample = live.at_send(prompt, lora)
            turn = Turn(len(prompt), never.reusable(prompt, lora), sample, ok=True, adapter=lora)
            turn.cached_tokens = sample.any_tokens
            turns.append(turn)
            full = len(prompt) // 4 * 4
            stored = BlockStored(
                tuple(next(hashes) for _ in range(full // 4)), None, tuple(prompt[:full]), 4, lora
            )
            engine.apply(0, EventBatch(0.0, (stored,)))
            never.finished(prompt, lora)
            prompt += reply
    return summarize(turns, 0.0, None, 1.0)


def test_the_workload_split_over_adapters_caches_what_the_base_model_does() -> None:
    base, lora = _through_one_engine(()), _through_one_engine(ADAPTERS)
    # Split by system prompt: the same tokens are reusable with adapters as without.
    assert lora["reusable_tokens"] == base["reusable_tokens"] > 0
    row = lora_vs_base(base, lora)
    assert row["cached_share_of_live_oracle"] == {"lora": 1.0, "base": 1.0}
    assert row["prefill_cached_share"] == {"lora": 1.0, "base": 1.0}
    assert row["goal_met"] is True


def test_the_goal_is_not_met_below_the_base_model_at_zero_or_with_errors() -> None:
    def figures(share: float | None, errors: int = 0) -> dict[str, Any]:
        return {"cached_share_of_live_oracle": share, "errors": errors}

    assert lora_vs_base(figures(0.9), figures(0.89))["goal_met"] is True  # within tolerance
    assert lora_vs_base(figures(0.9), figures(0.8))["goal_met"] is False
    assert lora_vs_base(figures(0.0), figures(0.0))["goal_met"] is False  # nothing cached
    assert lora_vs_base(figures(0.9), figures(None))["goal_met"] is False
    assert lora_vs_base(figures(0.9), figures(1.0, errors=1))["goal_met"] is False
