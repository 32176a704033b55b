"""The ITL window on synthetic token timelines: streams whose prompts finish at different times
join a decode loop whose step takes longer the more streams it holds."""

from __future__ import annotations

import pytest

from services.bench.itl_window import itl_window, token_times
from services.bench.soak import Outcome


def _step_s(batch: int) -> float:
    return (5.0 + 1.0 * batch) / 1000


def _decode_loop(first_tokens: list[float], tokens: int) -> list[list[float]]:
    """Each stream's token times: its first at ``first_tokens[i]`` (the prefill's), then one a
    step from the first step that starts after it, until it has ``tokens``."""
    timelines = [[at] for at in first_tokens]
    now = 0.0
    while any(len(times) < tokens for times in timelines):
        active = [t for t in timelines if t[0] <= now + 1e-12 and len(t) < tokens]
        if not active:
            now = min(t[0] for t in timelines if len(t) < tokens)
            continue
        now += _step_s(len(active))
        for times in active:
            times.append(now)
    return timelines


def test_the_window_is_where_every_stream_decodes_and_measures_the_full_batch() -> None:
    # Four prompts prefilled 50 ms apart, 40 tokens each: the first streams decode at batch 1..3
    # meanwhile and finish first.
    timelines = _decode_loop([0.0, 0.05, 0.10, 0.15], tokens=40)
    window = itl_window(timelines)
    assert window is not None and window.all_decoding
    assert window.ms == pytest.approx(_step_s(4) * 1000)
    assert window.effective_batch == pytest.approx(4.0)
    assert window.gaps >= 16
    # Its context: the tokens generated before a gap in the window, on average.
    assert 1 < window.mean_generated < 40

    # The whole-life mean of each stream (the old method) is a smaller batch's step.
    whole_life = [(t[-1] - t[0]) / (len(t) - 1) * 1000 for t in timelines]
    assert sum(whole_life) / len(whole_life) < 0.95 * window.ms


def test_streams_that_never_all_decode_together_fall_back_with_their_effective_batch() -> None:
    # Ten tokens each, prompts 100 ms apart: the first stream is done before the last starts.
    timelines = _decode_loop([0.0, 0.1, 0.2, 0.3], tokens=10)
    window = itl_window(timelines)
    assert window is not None and not window.all_decoding
    assert window.effective_batch < 2
    assert window.ms < _step_s(2) * 1000


def test_a_window_spanning_few_steps_says_how_few() -> None:
    timelines = _decode_loop([0.0, 0.05], tokens=12)
    window = itl_window(timelines)
    assert window is not None and window.all_decoding
    assert window.gaps < 16
    assert window.ms == pytest.approx(_step_s(2) * 1000)


def test_streams_without_a_decoding_gap_give_no_window() -> None:
    assert itl_window([[0.0, 0.01], [0.0]]) is None
    assert itl_window([]) is None


def test_token_times_are_sent_plus_ttft_plus_the_gaps() -> None:
    outcome = Outcome(ok=True, sent_at=10.0, ttft_s=0.5, itls_s=[0.1, 0.2], tokens=3)
    assert token_times(outcome) == pytest.approx([10.5, 10.6, 10.8])
    assert token_times(Outcome(ok=False, sent_at=10.0)) == []
