"""HeartbeatLateness: a renewal later than half the lease is reported with where the time went."""

from __future__ import annotations

from services.serving.host.registration import HeartbeatLateness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_renewals_within_half_the_lease_are_on_time() -> None:
    clock = Clock()
    lateness = HeartbeatLateness(10.0, clock)
    for _ in range(3):
        clock.now += 2.0
        started = lateness.calling()
        clock.now += 0.1
        assert lateness.renewed(started) is None


def test_a_late_renewal_names_the_call_and_the_host_share() -> None:
    clock = Clock()
    lateness = HeartbeatLateness(10.0, clock)
    clock.now += 7.0  # the host was away (interval + a blocked loop)
    started = lateness.calling()
    clock.now += 0.5  # the Redis call
    report = lateness.renewed(started)
    assert report is not None
    assert "renewed 7.5s after" in report
    assert "the Redis call took 0.5s, the host 7.0s" in report
    # The next one is measured from this renewal, not from the start.
    clock.now += 2.0
    assert lateness.renewed(lateness.calling()) is None
