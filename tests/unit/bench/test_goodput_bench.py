"""``pdserve bench goodput``'s layouts, SLO test and figures."""

from __future__ import annotations

from services.bench.goodput import Outcome, Slo, _figures, _layouts


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
    figures = _figures(outcomes, slo, window_s=4.0)
    assert figures["goodput"] == 0.5
    assert figures["slo_attainment"] == 0.5
    assert figures["errors"] == 1 and figures["first_errors"] == ["HTTP 503"]
    assert figures["client"]["send_lateness_ms"]["count"] == 4
