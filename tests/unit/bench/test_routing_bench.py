"""``pdserve bench routing``'s workload and figures: the oracle's reusable tokens, the shares."""

from __future__ import annotations

import argparse

from services.bench.routing import Turn, _conversations, _Oracle, _summarize, add_arguments


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_oracle_counts_leading_full_blocks_a_finished_prompt_shared() -> None:
    oracle = _Oracle(block_size=4)
    first = list(range(10))  # two full blocks and a partial one
    assert oracle.reusable(first) == 0
    oracle.finished(first)
    # The same two blocks, then something else: both blocks are reusable.
    assert oracle.reusable([*range(8), 99, 98, 97]) == 8
    # A different first block: nothing, even though the second block's tokens match.
    assert oracle.reusable([7, *range(1, 10)]) == 0
    # An engine never reports a prompt's last token cached: a prompt of exactly two known
    # blocks reuses one.
    assert oracle.reusable(list(range(8))) == 4


def test_conversations_share_system_prompts_and_extend_each_turn() -> None:
    args = _args("--conversations", "5", "--system-prompts", "2", "--turns", "3")
    conversations = _conversations(args)
    assert len(conversations) == 5
    assert conversations[0].system == conversations[2].system == conversations[4].system
    assert conversations[0].system != conversations[1].system
    assert all(len(c.messages) == 3 for c in conversations)
    assert _conversations(args)[3].messages == conversations[3].messages  # seeded


def test_summary_shares() -> None:
    turns = [
        Turn(40, 0, ok=True, cached_tokens=0, ttft_s=0.1, path="disaggregated"),
        Turn(60, 32, ok=True, cached_tokens=16, ttft_s=0.2, path="disaggregated"),
        Turn(60, 32, ok=False, error="HTTP 503"),
        Turn(50, 48, ok=True, cached_tokens=48, ttft_s=0.1, path="local"),
    ]
    # 150 prompt tokens done, 80 reusable. The two disaggregated requests: 100 prompt tokens, 32
    # reusable; 68 + 16 tokens moved: their decode engines lacked 16 of the 32.
    figures = _summarize(turns, moved_bytes=84 * 10.0, bytes_per_token=10.0, elapsed_s=1.0)
    assert figures["requests"] == 4 and figures["errors"] == 1
    assert figures["local_runs"] == 1
    assert figures["first_errors"] == ["HTTP 503"]
    assert figures["prefill_cached_share"] == 0.8  # (16 + 48) / 80
    assert figures["prefill_tokens_computed"] == 150 - 64
    assert figures["decode_cached_share"] == 0.5
    assert figures["kv_bytes_moved_per_request"] == 280  # 840 bytes over 3 requests done
