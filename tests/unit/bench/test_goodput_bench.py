"""``pdserve bench goodput``'s layouts, SLO test, figures and fidelity rows."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench import goodput_trace
from services.bench.goodput import _layouts, _plot, _versus, fidelity_output_tokens
from services.bench.goodput_load import Outcome, Slo, figures_of, unshared
from services.bench.procs import children_with_arg
from services.bench.trace import SHIPPED_TRACE, load_workload
from services.bench.trace_file import BLOCK_TOKENS, oracle_tokens
from services.engines.sim.profile import load_profile
from services.planner.config import PlannerSettings
from services.planner.main import build_planner
from services.planner.observe import RouterSnapshot
from services.planner.plan import step_record


def test_layouts_are_every_split_and_colocated() -> None:
    assert _layouts(3) == [("colocated", 0, 3), ("1P2D", 1, 2), ("2P1D", 2, 1)]


def test_a_request_meets_the_slos_only_with_both_bounds_kept() -> None:
    slo = Slo(ttft_s=0.3, itl_s=0.02)
    assert slo.met(Outcome(0.0, ok=True, ttft_s=0.2, itl_s=0.01))
    assert not slo.met(Outcome(0.0, ok=True, ttft_s=0.4, itl_s=0.01))
    assert not slo.met(Outcome(0.0, ok=True, ttft_s=0.2, itl_s=0.03))
    assert not slo.met(Outcome(0.0, ok=False, ttft_s=0.1, itl_s=0.01, error="HTTP 503"))


def test_goodput_counts_requests_meeting_the_slos_per_second_of_window() -> None:
    slo = Slo(ttft_s=0.3, itl_s=0.02)
    outcomes = [
        Outcome(0.0, sent_s=0.01, ok=True, ttft_s=0.1, itl_s=0.01),
        Outcome(1.0, sent_s=1.0, ok=True, ttft_s=0.5, itl_s=0.01),
        Outcome(2.0, sent_s=2.2, ok=True, ttft_s=0.2, itl_s=0.01),
        Outcome(3.0, sent_s=3.0, ok=False, error="HTTP 503"),
    ]
    figures = figures_of(outcomes, slo, window_s=4.0)
    assert figures["goodput"] == 0.5
    assert figures["slo_attainment"] == 0.5
    assert figures["errors"] == 1 and figures["first_errors"] == ["HTTP 503"]
    assert figures["client"]["send_lateness_ms"]["count"] == 4


def test_fidelity_streams_are_long_enough_for_a_window_where_all_decode() -> None:
    profile = load_profile("llama-3.1-8b-h100")
    alone = fidelity_output_tokens(profile, 512, 1, 16)
    assert 32 <= alone <= 64
    # 32 prompts of 2,048 tokens take ~2.3 s to prefill; the first stream decodes meanwhile.
    stagger_ms = 32 * profile.prefill_ms(2048)
    crowded = fidelity_output_tokens(profile, 2048, 32, 16)
    assert crowded * profile.decode_step_ms(1, 2048) > stagger_ms + 16 * 8
    assert fidelity_output_tokens(profile, profile.model.max_model_len - 10, 32, 16) == 10


def test_a_fidelity_row_has_the_raw_ratio_and_the_sims_own_beside_it() -> None:
    row = _versus("ttft", {"input_tokens": 1024}, 47.0, 37.0, 10.0)
    assert row["ratio"] == pytest.approx(47 / 37, abs=1e-4)
    assert row["sim_ratio"] == pytest.approx(1.0)
    assert row["overhead_ms"] == 10.0 and row["input_tokens"] == 1024


def test_the_sweep_plot_is_a_png_of_goodput_by_rate_per_layout(tmp_path: Path) -> None:
    sweep = {
        "layouts": {
            "colocated": [{"rate": 2.0, "goodput": 1.5}, {"rate": 4.0, "goodput": 3.0}],
            "1P1D": [{"rate": 2.0, "goodput": 1.6}, {"rate": 4.0, "goodput": 3.4}],
        }
    }
    path = tmp_path / "plots" / "goodput.png"
    _plot(sweep, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_processes_are_counted_from_their_command_line() -> None:
    """``bench goodput``'s engine-seconds count ``pdserve up``'s children that are engine hosts
    (``--engine-id`` in their command line) from start to exit, and nothing else."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine = subprocess.Popen([*sleep, "--engine-id", "decode-0"])
    other = subprocess.Popen([*sleep, "--engine-idx"])
    try:
        found = children_with_arg(os.getpid(), "--engine-id")
        assert engine.pid in found and other.pid not in found
    finally:
        for child in (engine, other):
            child.kill()
            child.wait()
    assert engine.pid not in children_with_arg(os.getpid(), "--engine-id")


def test_every_request_of_the_sweep_has_its_own_first_block() -> None:
    """The sim engines cache prompts: a sweep that sent one prompt would measure cache hits,
    not the prefill it sizes pools for."""
    prompt = list(range(40, 240))
    firsts = {tuple(unshared(prompt, n)[:16]) for n in range(3000)}
    assert len(firsts) == 3000
    assert unshared(prompt, 5)[2:] == prompt[2:] and len(unshared([50], 7)) == 1


def test_the_trace_run_shows_what_the_cached_share_saves_the_planner() -> None:
    """The headline of ``--trace``: two real planners read the shipped trace's load (its
    rate at the default time scale, mean prompt, and the offline oracle's cached tokens on
    the default fleet, as the router would count them), one with the cached share and one
    without; the bench's figures from their JSON lines say how many prefill engines the cache
    saves. Goes to zero (fails) if the planner stops reading the cached share."""
    parser = argparse.ArgumentParser()
    goodput_trace.add_arguments(parser)
    args = parser.parse_args(["--trace", str(SHIPPED_TRACE)])
    profile = load_profile()
    workload = load_workload(
        argparse.Namespace(
            trace=args.trace, kv_blocks=None, block_tokens=BLOCK_TOKENS, max_requests=None
        ),
        profile,
    )
    requests = workload.requests
    prefill_engines = int(args.trace_fleet.partition(":")[0])
    capacity = profile.kv_cache.num_blocks * profile.kv_cache.block_size
    cached = oracle_tokens(
        requests, prefill_engines, capacity, engine_block=profile.kv_cache.block_size
    )
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    rate = len(requests) / (span_s * args.trace_time_scale)
    prompt, hit = sum(r.input_length for r in requests) / len(requests), sum(cached) / len(cached)
    assert hit > 0.5 * prompt  # the trace mostly hits
    figures = {}
    for name, use in (("cached", True), ("blind", False)):
        planner = build_planner(
            PlannerSettings(ttft_ms=150, itl_ms=12.5, prefill_max=64, cached_tokens=use)
        )
        lines = []
        for interval in range(6):
            n = rate * 2.0 * interval
            snapshot = RouterSnapshot(
                at_s=2.0 * interval, requests=n, ttft_sum_s=0, ttft_count=0, itl_sum_s=0,
                itl_count=0, ready_prefill=prefill_engines, ready_decode=2,
                prompt_tokens=(n * prompt, n), generation_tokens=(n * 32, n),
                prefill_cached_tokens=(n * hit, n),
            )  # fmt: skip
            lines.append(json.loads(json.dumps(step_record(planner.step(snapshot)))))
        figures[name] = goodput_trace.planner_figures(lines)
    assert figures["cached"]["intervals"] == figures["blind"]["intervals"] == 5
    assert figures["blind"]["cached_tokens_mean"] == 0
    effect = goodput_trace.cached_share_effect(figures["cached"], figures["blind"])
    assert effect["prefill_engines_saved"] >= 1, (figures, effect)
    assert effect["prefill_need_ratio"] < 1
