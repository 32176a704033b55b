"""``pdserve bench trace``'s trace reading (bad lines skipped and counted, the first named; an
unreadable trace fails before anything starts), its prompts (equal hash ids, equal blocks), the
ceiling and the offline oracle with the fleet's capacities, and its figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.bench.trace import SHIPPED_TRACE, add_arguments, load_workload
from services.bench.trace_figures import Sent, phase_means, summarize
from services.bench.trace_file import (
    Prompts,
    TraceError,
    TraceRequest,
    oracle_tokens,
    read_trace,
    reusable_tokens,
)
from services.engines.sim.profile import load_profile


def _line(**fields: object) -> str:
    record: dict[str, object] = {
        "timestamp": 0,
        "input_length": 600,
        "output_length": 5,
        "hash_ids": [1, 2],
    }
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not None})


def test_bad_lines_are_skipped_and_counted_with_the_first_named(tmp_path: Path) -> None:
    lines = [
        _line(timestamp=20),
        "not json",
        _line(input_length=None),  # missing
        _line(output_length=-1),
        _line(input_length=2000),  # four blocks' worth, two hash ids
        _line(input_length=5000, hash_ids=list(range(10))),  # beyond the context
        _line(timestamp=10, hash_ids=[1, 3]),
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    trace = read_trace(path, max_model_len=4096)
    assert [r.timestamp_ms for r in trace.requests] == [10.0, 20.0]  # in time order
    assert trace.lines == 7 and trace.skipped == 5
    assert trace.first_skipped is not None and trace.first_skipped.startswith("line 2: not JSON")
    assert read_trace(path, max_model_len=4096, limit=1).requests[0].timestamp_ms == 20.0


def test_a_trace_that_cannot_be_read_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl", max_model_len=4096)
    empty = tmp_path / "bad.jsonl"
    empty.write_text("{}\n")
    with pytest.raises(TraceError, match=r"no valid request.*line 1: no timestamp"):
        read_trace(empty, max_model_len=4096)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="pdserve bench trace: cannot read"):
        load_workload(parser.parse_args([str(tmp_path / "missing.jsonl")]), load_profile())


def test_equal_hash_ids_give_equal_blocks() -> None:
    prompts = Prompts(vocab_size=1000, block_tokens=8)
    a = prompts.prompt(TraceRequest(0, 20, 1, (5, 6, 7)))
    b = Prompts(vocab_size=1000, block_tokens=8).prompt(TraceRequest(0, 12, 1, (5, 9)))
    assert len(a) == 20 and len(b) == 12
    assert a[:8] == b[:8] and a[8:12] != b[8:12]
    assert all(16 <= token < 1000 for token in a)


def _requests(*ids: tuple[int, ...]) -> list[TraceRequest]:
    """Each prompt: its full blocks and 10 tokens of a last, partial one (its last id)."""
    return [TraceRequest(i, 512 * (len(h) - 1) + 10, 1, h) for i, h in enumerate(ids)]


def test_the_ceiling_and_the_oracle_with_capacities() -> None:
    requests = _requests((1, 2, 99), (1, 2, 3, 98), (4, 97), (1, 2, 3, 96))
    assert reusable_tokens(requests, engine_block=16) == [0, 1024, 0, 1536]
    # One cache of three blocks: the unrelated request's block evicts one, the tail of the
    # prefix (block 3, as an engine frees a request's tail first), so 1 and 2 still hit.
    assert oracle_tokens(requests, 1, 3 * 512, engine_block=16) == [0, 1024, 0, 1024]
    # Two caches: the unrelated request goes to the other one, nothing is evicted.
    assert oracle_tokens(requests, 2, 3 * 512, engine_block=16) == [0, 1024, 0, 1536]


def test_the_shipped_trace_reuses_and_the_figures_say_when_nothing_was_cached() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(SHIPPED_TRACE)])
    workload = load_workload(args, load_profile())
    assert workload.skipped == 0 and len(workload.requests) > 100
    assert sum(workload.reusable) > 0.5 * sum(r.input_length for r in workload.requests)
    sent = [
        Sent(0, 4000, 0, 0, ok=True, ttft_s=0.1, itls_s=[0.01]),
        Sent(1, 4000, 3584, 3584, scheduled_s=2.0, ok=True, ttft_s=0.3, itls_s=[0.2]),
    ]
    figures = summarize(sent, args, elapsed_s=3.0)
    assert figures["cached_share"] == 0.0
    assert figures["problems"] and "3584" in figures["problems"][0]
    assert figures["goodput_per_s"] == 0.5  # the second missed the ITL SLO (100 ms)
    sent[1].cached_tokens = 3584
    figures = summarize(sent, args, elapsed_s=3.0)
    assert figures["cached_share"] == 1.0 and figures["cached_share_of_oracle"] == 1.0
    assert figures["problems"] == []


def test_where_the_first_token_waited_is_each_phases_mean_over_the_run() -> None:
    before = {"prefill": (1.0, 10.0)}
    after = {"prefill": (3.0, 20.0), "handoff": (0.1, 10.0), "first_decode_token": (0.5, 0.0)}
    assert phase_means(before, after) == {
        "prefill": 200.0,
        "handoff": 10.0,
        "first_decode_token": None,
    }


def test_the_figures_say_how_placement_spread_and_queued_requests() -> None:
    """Per engine counts (most first) and, from the client's clock, how many requests were
    already on a request's prefill engine (sent, no first token) or decode engine (sent, not
    finished) when it was sent: what decode herding looks like in the figures."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(SHIPPED_TRACE)])

    def sent(index: int, at_s: float, prefill: str, decode: str) -> Sent:
        # first token 0.1 s after sending, then 4 tokens 0.1 s apart: done at +0.5 s
        return Sent(
            index, 4000, 0, scheduled_s=at_s, ok=True, ttft_s=0.1, itls_s=[0.1] * 4,
            prefill_engine=prefill, decode_engine=decode, path="disaggregated",
        )  # fmt: skip

    requests = [
        sent(0, 0.0, "p1", "d1"),
        sent(1, 0.05, "p1", "d1"),  # p1 still prefilling request 0; d1 streaming it
        sent(2, 0.3, "p2", "d1"),  # d1 streams 0 and 1, p2 idle
        sent(3, 0.35, "p2", "d2"),  # p2 prefilling request 2, d2 idle
    ]
    figures = summarize(requests, args, elapsed_s=1.0)
    assert figures["requests_per_prefill_engine"] == [2, 2]
    assert figures["requests_per_decode_engine"] == [3, 1]
    ahead = figures["ahead_on_arrival"]
    assert ahead["prefill_busy_share"] == 0.5  # requests 1 and 3
    assert ahead["prefill_mean"] == 0.5
    assert ahead["decode_mean"] == 0.75  # 1 behind 0; 2 behind 0 and 1
