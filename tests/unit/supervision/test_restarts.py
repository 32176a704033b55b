"""The restart state machine of ``pdserve up``'s engines: back-off, reset after a stable run,
crash loop, restarts off. Driven with numbers (it reads no clock)."""

from __future__ import annotations

import pytest

from services.supervision import RestartPolicy, RestartTracker

POLICY = RestartPolicy(max_fast_failures=4, stable_after_s=60, backoff_s=1, max_backoff_s=5)


def test_fast_failures_back_off_exponentially_up_to_the_bound() -> None:
    tracker = RestartTracker(POLICY)
    decisions = [tracker.on_exit(served_s=None), *(tracker.on_exit(2.0) for _ in range(3))]
    assert [d.restart for d in decisions] == [True] * 4
    assert [d.delay_s for d in decisions] == [1, 2, 4, 5]
    assert [d.fast_failures for d in decisions] == [1, 2, 3, 4]
    assert tracker.restarts == 4 and not tracker.gave_up


def test_the_failure_past_the_limit_is_a_crash_loop_and_nothing_restarts_it_again() -> None:
    tracker = RestartTracker(POLICY)
    for _ in range(4):
        assert tracker.on_exit(None).restart
    loop = tracker.on_exit(None)
    assert not loop.restart and tracker.gave_up
    assert loop.fast_failures == 5 and "crash loop" in loop.reason
    # Even a long run afterwards does not bring it back.
    assert not tracker.on_exit(3600.0).restart
    assert tracker.restarts == 4


def test_a_stable_run_resets_the_count_and_the_back_off() -> None:
    tracker = RestartTracker(POLICY)
    for _ in range(3):
        tracker.on_exit(1.0)
    after_stable = tracker.on_exit(served_s=60.0)
    assert after_stable.restart and after_stable.delay_s == 1 and after_stable.fast_failures == 0
    # The next fast failures count from one again: four more are restarted.
    assert [tracker.on_exit(None).delay_s for _ in range(4)] == [1, 2, 4, 5]
    assert not tracker.on_exit(None).restart


def test_with_restarts_off_no_exit_is_restarted() -> None:
    tracker = RestartTracker(RestartPolicy(enabled=False))
    decision = tracker.on_exit(None)
    assert not decision.restart and "--no-restart" in decision.reason
    assert tracker.restarts == 0 and not tracker.gave_up


def test_a_limit_of_zero_gives_up_at_the_first_fast_failure() -> None:
    tracker = RestartTracker(RestartPolicy(max_fast_failures=0))
    assert tracker.on_exit(100.0).restart  # a slow failure is still restarted
    assert not tracker.on_exit(1.0).restart and tracker.gave_up


@pytest.mark.parametrize(
    "fields",
    [
        {"max_fast_failures": -1},
        {"stable_after_s": -1.0},
        {"backoff_s": -1.0},
        {"backoff_s": 10.0, "max_backoff_s": 5.0},
    ],
)
def test_bad_policies_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**fields)  # type: ignore[arg-type]
