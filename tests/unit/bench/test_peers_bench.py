"""``pdserve bench peers``' pieces: the command lines of each stack (the same engine settings
on both, the peer tuned as pdserve's engines), layouts the peer refuses, a stack that cannot
start reported and skipped, the CPU of a real process tree per request, the figures, the
side-by-side comparison and table, and greedy-output agreement. The end-to-end run (two vLLM
stacks, minutes) is opt-in: tests/e2e/test_bench_peers.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.bench import peer_stacks, peers
from services.bench.peer_load import Outcome, Slo, Workload, figures, output_agreement, window_s
from services.bench.peer_phases import (
    comparison,
    cpu_by_label,
    cpu_figures,
    per_extra_token,
    table,
)
from services.bench.peer_stacks import (
    EngineSettings,
    Layout,
    pdserve_up_args,
    peer_refusal,
    peer_server_argv,
    process_labels,
    vllm_router_argv,
)
from services.control_plane.local_redis import free_port

SETTINGS = EngineSettings(dtype="float32", block_size=32, kv_cache_bytes=1 << 30, max_model_len=512)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_peer_servers_run_the_same_engine_settings_as_pdserve_and_its_cpu_tuning() -> None:
    argv = peer_server_argv(Path("/m"), "m", 8000, SETTINGS, pp=1, tp=1)
    up = pdserve_up_args(Path("/m"), SETTINGS, Layout(), "push")
    assert flag(argv, "--dtype") == flag(up, "--dtype") == "float32"
    assert flag(argv, "--block-size") == flag(up, "--block-size") == "32"
    assert flag(argv, "--kv-cache-memory-bytes") == str(1 << 30)
    assert "--engine-arg=--kv-cache-gib=1" in up
    assert flag(argv, "--max-model-len") == "512"
    assert "--engine-arg=--max-model-len=512" in up
    assert "--enforce-eager" in argv
    assert "--engine-arg=--enforce-eager" in up
    assert "--engine-arg=--transfer-mode=push" in up
    transfer = json.loads(flag(argv, "--kv-transfer-config"))
    # vLLM's connector with pdserve's CPU settings (no UCX progress thread, no spinning waits).
    assert transfer["kv_connector_module_path"] == "services.bench.peer_connector"
    assert transfer["kv_connector"] == "CalmNixlPullConnector"
    assert (transfer["kv_role"], transfer["kv_buffer_device"]) == ("kv_both", "cpu")
    # vllm-router's render calls are answered, not refused with 403.
    assert "--enable-scale-out" in argv


def test_vllm_router_in_pd_mode_and_its_kv_aware_prefill_policy_over_kv_events() -> None:
    plain = vllm_router_argv("vllm-router", "http://p", "http://d", 9000)
    assert "--vllm-pd-disaggregation" in plain
    assert (flag(plain, "--prefill"), flag(plain, "--decode")) == ("http://p", "http://d")
    assert flag(plain, "--worker-startup-check-interval") == "1"
    events = vllm_router_argv(
        "vllm-router", "http://p", "http://d", 9000, kv_events="tcp://127.0.0.1:5557"
    )
    assert flag(events, "--prefill-policy") == "kv_aware"
    assert flag(events, "--pd-kv-events") == "http://p=tcp://127.0.0.1:5557"
    server = peer_server_argv(Path("/m"), "m", 8000, SETTINGS, pp=1, tp=1, kv_events_port=5557)
    assert json.loads(flag(server, "--kv-events-config"))["endpoint"] == "tcp://*:5557"


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        (Layout(decode_pp=2), "decode PP"),
        (Layout(prefill_pp=2), "push mode"),
        (Layout(prefill_tp=2, decode_tp=1), "decode TP >= prefill TP"),
    ],
)
def test_layouts_the_peer_cannot_run_name_why(layout: Layout, reason: str) -> None:
    refusal = peer_refusal(layout)
    assert refusal is not None and reason in refusal
    assert peer_refusal(Layout(prefill_tp=1, decode_tp=2)) is None


def _setup(tmp_path: Path, layout: Layout) -> peers.Setup:
    return peers.Setup(tmp_path, "m", SETTINGS, layout, tmp_path)


def _load() -> Workload:
    return Workload("m", (1.0,), 1, (4,), 2, 0, 0, 1, 4, 2, 1.0, (1,), 1, seed=0, timeout_s=5.0)


def test_a_peer_that_cannot_start_is_reported_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slo = Slo(1.0, 1.0)
    refused, outcomes = asyncio.run(
        peers._bench_stack("peer", _setup(tmp_path, Layout(decode_pp=2)), _load(), slo)
    )
    assert "decode PP" in refused["error"] and outcomes == []
    monkeypatch.setattr(peers, "vllm_router_binary", lambda: None)
    missing, _ = asyncio.run(peers._bench_stack("peer", _setup(tmp_path, Layout()), _load(), slo))
    assert "vllm-router is not installed" in missing["error"]
    assert any("not run" in line for line in table({"peer": missing}, {}))


ROOT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
sys.stdin.readline()
t = time.process_time()
while time.process_time() - t < 0.2:
    pass
print("burnt", flush=True)
sys.stdin.readline()
child.kill()
"""


def test_a_stack_that_fails_under_load_is_reported_and_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped = []

    class Gone(peers.Running):
        async def stop(self) -> None:
            stopped.append(self.name)

    async def start(name: str, setup: peers.Setup) -> peers.Running:
        # Nothing listens there: the warm-up request fails.
        return Gone(name, f"http://127.0.0.1:{free_port()}", {}, [])

    monkeypatch.setattr(peers, "_start", start)
    failed, outcomes = asyncio.run(
        peers._bench_stack("pdserve_push", _setup(tmp_path, Layout()), _load(), Slo(1.0, 1.0))
    )
    assert "warm-up" in failed["error"] and outcomes == []
    assert stopped == ["pdserve_push"]


def test_cpu_per_request_of_a_real_process_tree_by_process() -> None:
    """The headline figure: CPU of every process of a stack, read from the processes' own
    clocks, per completed request; a tree that burnt 0.2 s reads at least that."""
    root = subprocess.Popen(
        [sys.executable, "-c", ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert root.stdin is not None and root.stdout is not None
    try:
        assert root.stdout.readline().strip() == "ready"
        labels = process_labels({"stack": root.pid})
        before = cpu_by_label(labels)
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "burnt"
        cpu = cpu_figures(before, cpu_by_label(labels), completed=2)
    finally:
        root.communicate("\n", timeout=30)
    assert set(labels.values()) == {"stack", "stack/python"}
    assert cpu["cpu_ms_per_request"] >= 100  # 0.2 s over 2 requests
    assert cpu["cpu_ms_per_request_by_process"]["stack"] >= 100
    assert cpu["cpu_ms_per_request_by_process"]["stack/python"] >= 0
    assert cpu_figures(before, before, completed=0)["cpu_ms_per_request"] is None


def outcome(
    key: str, ttft: float, itls: list[float], tokens: list[int], ok: bool = True
) -> Outcome:
    return Outcome(
        key=key, body={}, path="/v1/completions", ok=True, sent_s=0.0, ttft_s=ttft,
        e2e_s=ttft + sum(itls), itls_s=itls, token_ids=tokens,
    )  # fmt: skip


def test_figures_count_goodput_at_the_slos_and_latency_percentiles() -> None:
    done = [
        outcome("a", 0.1, [0.01, 0.01], [1, 2, 3]),
        outcome("b", 0.9, [0.01], [1, 2]),  # TTFT over the SLO
        outcome("c", 0.1, [0.5], [1, 2]),  # mean ITL over the SLO
    ]
    failed = Outcome(key="d", body={}, path="/v1/completions", error="HTTP 500")
    phase = figures([*done, failed], window_s(done), Slo(ttft_s=0.5, itl_s=0.1))
    assert (phase["requests"], phase["completed"], phase["errors"]) == (4, 3, 1)
    assert phase["first_errors"] == ["HTTP 500"]
    assert phase["window_s"] == pytest.approx(0.91)
    assert phase["goodput_rps"] == pytest.approx(1 / 0.91, rel=1e-2)
    assert phase["ttft_ms"]["p50"] == 100.0 and phase["ttft_ms"]["p99"] == 900.0
    # The second token (TTFT and the first gap, the KV handoff in pdserve), the gaps after it.
    assert phase["second_token_ms"]["p50"] == 600.0 and phase["second_token_ms"]["count"] == 3
    assert phase["later_itl_ms"] == {"p50": 10.0, "p90": 10.0, "p99": 10.0, "count": 1}
    assert phase["slo_attainment"] == 0.25


def test_outputs_compared_token_for_token_by_request() -> None:
    agreement = output_agreement({"a": [1, 2], "b": [3], "x": [9]}, {"a": [1, 2], "b": [4]})
    assert agreement == {"compared": 2, "equal": 1, "first_different": ["b"]}


def test_each_stack_over_the_peer_and_the_table() -> None:
    phase = {
        **figures([outcome("a", 0.2, [0.02], [1, 2])], 1.0, Slo(1.0, 1.0)),
        "cpu_ms_per_request": 400.0,
    }
    ours = {**phase, "cpu_ms_per_request": 100.0}
    stacks = {
        "peer": {"phases": {"rate_1": phase}, "peak_rss_mib": 3000.0, "kv_transfers": {}},
        "pdserve_push": {
            "phases": {"rate_1": ours},
            "peak_rss_mib": 2000.0,
            "kv_transfers": {"transfers": 1.0, "failed": 0.0},
        },
    }
    compared = comparison(stacks)["pdserve_push_over_peer"]["rate_1"]
    assert compared["cpu_ms_per_request"] == 0.25
    assert compared["ttft_ms.p50"] == 1.0
    lines = table(stacks, {"pdserve_push_vs_peer": {"compared": 1, "equal": 1}})
    assert lines[0].split()[:2] == ["stack", "phase"]
    assert any(line.split()[:2] == ["pdserve_push", "rate_1"] for line in lines)
    assert "greedy outputs pdserve_push_vs_peer: 1/1 equal" in lines
    assert any("transfers 1, failed 0" in line for line in lines)


def test_process_names_of_a_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = {1: [2, 3], 2: [4], 3: [], 4: []}
    kinds = {2: "prefill", 3: "redis", 4: "engine-core"}
    monkeypatch.setattr(peer_stacks, "descendants", lambda root: [1, 2, 3, 4])
    monkeypatch.setattr(
        peer_stacks, "_parent", lambda pid: next((p for p, c in tree.items() if pid in c), None)
    )
    monkeypatch.setattr(peer_stacks, "_kind", lambda pid: kinds[pid])
    assert process_labels({"up": 1}) == {
        1: "up",
        2: "prefill",
        3: "redis",
        4: "prefill/engine-core",
    }


def test_the_cpu_of_one_more_streamed_token_per_process() -> None:
    def phase(total: float, router: float) -> dict[str, Any]:
        return {
            "cpu_ms_per_request": total,
            "cpu_ms_per_request_by_process": {"router": router, "decode/worker": total - router},
        }

    phases = {"tokens_4": phase(40.0, 4.0), "tokens_64": phase(100.0, 10.0)}
    token = per_extra_token(phases, (4, 64))
    assert token == {"total": 1.0, "by_process": {"decode/worker": 0.9, "router": 0.1}}
    assert per_extra_token(phases, ()) == {}
    assert per_extra_token({"tokens_4": phase(40.0, 4.0)}, (4, 64)) == {}
    stack = {"phases": {}, "peak_rss_mib": 1.0, "kv_transfers": {}, "cpu_ms_per_extra_token": token}
    assert "pdserve_push: CPU ms per extra streamed token 1 (decode/worker 0.9, router 0.1)" in (
        table({"pdserve_push": stack}, {})
    )
