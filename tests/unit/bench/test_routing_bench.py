"""``pdserve bench routing``'s workload and figures: both oracles' tokens, the shares."""

from __future__ import annotations

import argparse

from services.bench.routing import _conversations, add_arguments
from services.bench.routing_figures import Turn, live_shares, summarize
from services.bench.routing_oracle import (
    EngineCache,
    LiveOracle,
    LiveSample,
    NeverEvictOracle,
)
from services.control_plane.wire import EngineRole
from services.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_oracle_counts_leading_full_blocks_a_finished_prompt_shared() -> None:
    oracle = NeverEvictOracle(block_size=4)
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
    figures = summarize(turns, moved_bytes=84 * 10.0, bytes_per_token=10.0, elapsed_s=1.0)
    assert figures["requests"] == 4 and figures["errors"] == 1
    assert figures["local_runs"] == 1
    assert figures["first_errors"] == ["HTTP 503"]
    assert figures["prefill_cached_share"] == 0.8  # (16 + 48) / 80
    assert figures["prefill_tokens_computed"] == 150 - 64
    assert figures["decode_cached_share"] == 0.5
    assert figures["kv_bytes_moved_per_request"] == 280  # 840 bytes over 3 requests done
    assert figures["problems"] == []


def test_a_workload_with_reuse_and_no_cached_token_reported_is_a_problem() -> None:
    turns = [Turn(60, 32, ok=True, cached_tokens=0, ttft_s=0.2, path="disaggregated")]
    (problem,) = summarize(turns, 0.0, None, 1.0)["problems"]
    assert "no cached tokens reported though 32" in problem
    # Nothing reusable, nothing cached: no problem.
    assert summarize([Turn(60, 0, ok=True)], 0.0, None, 1.0)["problems"] == []


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> EventBatch:
    return EventBatch(0.0, (BlockStored(tuple(hashes), parent, tuple(tokens), 4),))


def test_the_live_oracle_follows_each_engines_stores_and_evictions() -> None:
    prefill = EngineCache("p0", EngineRole.PREFILL, block_size=4)
    decode = EngineCache("d0", EngineRole.DECODE, block_size=4)
    oracle = LiveOracle([prefill, decode])
    prompt = list(range(13))  # three full blocks and one token
    assert oracle.at_send(prompt) == LiveSample(0, 0)
    # The prefill engine stores blocks 0-1, then block 2 chained on its hash of block 1.
    prefill.apply(0, _stored([100, 101], None, list(range(8))))
    prefill.apply(1, _stored([102], 101, list(range(8, 12))))
    assert oracle.at_send(prompt) == LiveSample(12, 12)
    # Never the prompt's last token: a prompt of exactly three held blocks finds two.
    assert oracle.at_send(list(range(12))) == LiveSample(8, 8)
    # The decode engine holds the whole prompt's blocks; the prefill engine evicts block 1,
    # which ends its prefix at block 0 although it still holds block 2.
    decode.apply(0, _stored([7, 8, 9], None, list(range(12))))
    prefill.apply(2, EventBatch(0.0, (BlockRemoved((101,)),)))
    assert oracle.at_send(prompt) == LiveSample(4, 12)
    # Other tokens in block 0: nothing anywhere.
    assert oracle.at_send([99, *range(1, 13)]) == LiveSample(0, 0)
    decode.apply(1, EventBatch(0.0, (AllBlocksCleared(),)))
    assert oracle.at_send(prompt) == LiveSample(4, 4)


def test_the_live_oracle_drops_what_it_cannot_chain_and_an_engine_it_lost() -> None:
    cache = EngineCache("p0", EngineRole.PREFILL, block_size=4)
    oracle = LiveOracle([cache])
    cache.apply(0, _stored([5], 404, list(range(4))))  # a parent it never saw stored
    cache.apply(1, EventBatch(0.0, (BlockStored((6,), None, tuple(range(8)), 8),)))
    assert oracle.at_send(list(range(9))) == LiveSample(0, 0)
    cache.apply(2, _stored([1, 2], None, list(range(8))))
    assert oracle.at_send(list(range(9))) == LiveSample(8, 8)
    cache.stale("gap", lost=True)  # removals may be gone: forget everything
    assert oracle.at_send(list(range(9))) == LiveSample(0, 0)
    assert oracle.health()["p0"]["problems"] == {
        "unknown_parent": 1,
        "block_size": 1,
        "lost:gap": 1,
    }


def test_shares_of_the_live_oracle_are_capped_per_request() -> None:
    done = [
        # Found all the prefill pool held.
        Turn(60, 48, LiveSample(32, 32), ok=True, cached_tokens=32),
        # Found more than the oracle said at its send (a block stored meanwhile): counts 16.
        Turn(60, 48, LiveSample(16, 32), ok=True, cached_tokens=48),
        # Missed what the prefill pool held; a decode engine held more.
        Turn(60, 48, LiveSample(32, 48), ok=True, cached_tokens=0),
        Turn(60, 0, None, ok=True),  # no sample: left out
    ]
    shares = live_shares(done)
    assert shares["live_oracle_tokens"] == 112
    assert shares["live_prefill_oracle_tokens"] == 80
    assert shares["cached_share_of_live_oracle"] == 0.5714  # (32 + 32 + 0) / 112
    assert shares["cached_share_of_live_prefill_oracle"] == 0.6  # (32 + 16 + 0) / 80
    assert shares["cached_share_of_live_oracle_uncapped"] == 0.7143  # 80 / 112
    assert shares["cached_above_live_oracle"] == 1
    assert live_shares([Turn(10, 0, None, ok=True)])["cached_share_of_live_oracle"] is None
