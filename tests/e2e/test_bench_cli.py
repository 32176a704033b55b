"""``pdserve bench kv --quick --json`` prints parseable JSON alone on stdout (NIXL logs go to
stderr) with positive figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_kv_prints_only_json_on_stdout() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "kv", "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=280,
    )
    report = json.loads(result.stdout)
    assert report["benchmark"] == "kv"
    assert report["results"]
    assert all(r["gbps"] > 0 for r in report["results"])


def test_bench_router_reports_router_cpu_and_the_comparison_keys() -> None:
    """A short ``pdserve bench router`` run: figures for both routers (vllm-router is in the
    dev extra), the router CPU per request read from /proc, the load generator's ceiling, the
    comparison's keys, streamed requests at two lengths included, and pdserve's router CPU per
    chat completion (the tiny checkpoint's chat template) for each of its runs. Figures are not
    judged here (benchmarks are measured, not asserted). ``--vllm-api-server`` (vLLM's own
    server, minutes to start; ``frontend_comparison``) is measured for docs/benchmarks.md, not
    here."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "bench",
            "router",
            "--json",
            "--concurrency",
            "1,4",
            # Windows of 1 s with streams of 16 tokens; a window that completed nothing (a
            # loaded machine) is run again twice as long (window_s).
            "--duration-s",
            "1",
            "--latency-s",
            "0.5",
            "--streamed-tokens",
            "4,16",
            "--grpcio-client",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    report = json.loads(result.stdout)
    assert report["benchmark"] == "router"
    assert report["load_generator"]["ceiling"]["requests_per_s"] > 0
    systems = ("pdserve", "vllm_router", "pdserve_grpcio_client")
    for system in systems:
        figures = report[system]
        assert [level["concurrency"] for level in figures["load"]] == [1, 4]
        assert all(level["errors"] == 0 for level in figures["load"]), figures["load"]
        assert figures["router_cpu_ms_per_request"] > 0, (system, figures["load"])
        streamed = figures["streamed"]
        assert streamed["max_tokens"] == [4, 16]
        assert streamed["errors"] == {"4": 0, "16": 0}, streamed["first_error"]
        # Both windows answered streamed requests; their CPU figures are measured (None only
        # for a window without a completed request) and not negative: /proc counts CPU in
        # clock ticks (10 ms), so a short window of a router that barely ran can read 0 (the
        # non-streamed figure above is the one asserted positive).
        assert all(rate > 0 for rate in streamed["requests_per_s"].values()), streamed
        assert all(
            cpu is not None and cpu >= 0 for cpu in streamed["router_cpu_ms_per_request"].values()
        ), streamed
        assert isinstance(streamed["router_cpu_ms_per_extra_token"], float)
        if system == "vllm_router":  # its HTTP stubs serve completions only
            assert "chat" not in figures
            continue
        chat = figures["chat"]
        assert chat["errors"] == 0, chat["first_error"]
        assert chat["requests_per_s"] > 0 and chat["router_cpu_ms_per_request"] > 0, chat
    comparison = report["comparison"]
    assert comparison["rps_ratio"] > 0
    assert set(comparison["router_cpu_ms_per_request"]) == {"pdserve", "vllm_router"}
    assert set(comparison["added_p50_ms"]) == {"pdserve", "vllm_router"}
    assert set(comparison["router_cpu_ms_per_extra_token"]) == {"pdserve", "vllm_router"}
    assert "frontend_comparison" not in report  # only with --vllm-api-server
    clients = report["engine_client_comparison"]
    assert set(clients["router_cpu_ms_per_request"]) == {"h2grpc", "grpcio"}
    assert clients["router_cpu_ratio"] > 0


def test_bench_routing_runs_settings_side_by_side_and_reports_each_figure(tmp_path: Path) -> None:
    """A short ``pdserve bench routing`` (issue 31 deliverable 4): the approximate and precise
    settings, each on its own fresh ``pdserve up`` of reference engines, answer every turn of a
    few two-turn conversations and report the figures docs/benchmarks.md quotes, with the
    comparison row. Figures are not judged here (too few requests to mean anything)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "bench",
            "routing",
            "--policies",
            "approximate,precise",
            "--router-workers",
            "1",
            "--conversations",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "64",
            "--turns-out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    report = json.loads(result.stdout)
    assert set(report["settings"]) == {"approximate/workers=1", "precise/workers=1"}
    for name, figures in report["settings"].items():
        assert figures["requests"] == 6 and figures["errors"] == 0, (name, figures)
        # The second turn of each conversation extends its first: reusable tokens exist.
        assert figures["reusable_tokens"] > 0, figures
        assert figures["prefill_cached_share"] is not None, figures
        # Placement finds some of them, and the answers say so (the router's front end reports
        # cached tokens only with --enable-prompt-tokens-details: without it, 0 everywhere).
        assert figures["cached_tokens"] > 0 and not figures["problems"], figures
        assert figures["prefill_tokens_computed"] <= figures["prompt_tokens"]
        assert figures["kv_bytes_moved_per_request"] is not None
        assert figures["ttft_ms"]["count"] == 6
        # The live oracle followed all four engines (in both settings: the approximate one
        # turns the events off in the router only) and saw the first turns' blocks.
        engines = figures["live_oracle_engines"]
        assert len(engines) == 4 and all(e["batches"] > 0 for e in engines.values()), engines
        assert not any(e["problems"] for e in engines.values()), engines
        assert figures["live_oracle_tokens"] > 0, figures
        assert figures["cached_share_of_live_oracle"] is not None, figures
    # One line per request of each setting: where it went beside what each engine held.
    for setting in ("approximate-1", "precise-1"):
        lines = (tmp_path / f"{setting}.jsonl").read_text().splitlines()
        turns = [json.loads(line) for line in lines]
        assert sorted((t["conversation"], t["index"]) for t in turns) == [
            (c, i) for c in range(3) for i in range(2)
        ]
        for turn in turns:
            assert turn["ok"] and turn["decode_engine"], turn
            assert len(turn["live"]["by_engine"]) == 4, turn
            assert turn["live"]["any_tokens"] == max(turn["live"]["by_engine"].values()), turn
    row = report["comparison"]["precise/workers=1"]
    assert set(row) >= {
        "prefill_cached_share",
        "cached_share_of_live_oracle",
        "kv_bytes_moved_per_request",
        "ttft_p50_ms",
    }
