"""When to start a dead child again: bounded exponential back-off, and an end to crash loops.

The state machine of one supervised child (``pdserve up`` keeps one per engine). Each time the
child exits on its own, :meth:`RestartTracker.on_exit` is told how long it served (since its
READY line; ``None`` when it never printed one) and decides:

- a **fast failure** (never READY, or served less than ``stable_after_s``) adds one to the run of
  consecutive fast failures; the restart waits ``backoff_s * 2 ** (run - 1)``, at most
  ``max_backoff_s``;
- a failure after a **stable** run (served ``stable_after_s`` or more) starts the run again:
  it counts as the first fast failure's back-off, ``backoff_s``, and the run is reset to 0;
- the fast failure that makes the run longer than ``max_fast_failures`` is a **crash loop**: no
  restart, ever again (:attr:`RestartTracker.gave_up`); the caller reports it as an error;
- with restarts off, no exit is restarted.

Nothing here reads a clock or sleeps: the caller measures and waits, so tests drive it with
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """How a child that exits on its own is restarted (``pdserve up --restart ...``)."""

    enabled: bool = True
    max_fast_failures: int = 5
    """Consecutive fast failures restarted; the next one is a crash loop (no more restarts)."""
    stable_after_s: float = 60.0
    """A run that served (after its READY line) at least this long ends a run of fast
    failures."""
    backoff_s: float = 1.0
    """The wait before the first restart; doubled for each further consecutive fast failure."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""

    def __post_init__(self) -> None:
        if self.max_fast_failures < 0:
            raise ValueError(f"max_fast_failures must be >= 0, not {self.max_fast_failures}")
        if self.stable_after_s < 0:
            raise ValueError(f"stable_after_s must be >= 0, not {self.stable_after_s}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s, not {self.backoff_s} and "
                f"{self.max_backoff_s}"
            )


@dataclass(frozen=True)
class Decision:
    """What to do about one exit."""

    restart: bool
    delay_s: float
    """How long to wait before the restart (0 without one)."""
    fast_failures: int
    """The run of consecutive fast failures, this exit included."""
    reason: str
    """For people: why (not) restarted."""


class RestartTracker:
    """The restart state of one child (see the module docstring)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        """Restarts decided so far."""
        self.fast_failures = 0
        """The current run of consecutive fast failures."""
        self.gave_up = False

    def on_exit(self, served_s: float | None) -> Decision:
        """The child exited on its own after serving ``served_s`` seconds since its READY line
        (``None``: it never printed one): restart it, after how long, or not."""
        policy = self.policy
        if not policy.enabled:
            return Decision(False, 0.0, self.fast_failures, "restarts are off (--no-restart)")
        if self.gave_up:
            return Decision(False, 0.0, self.fast_failures, "it is in a crash loop")
        if served_s is not None and served_s >= policy.stable_after_s:
            self.fast_failures = 0
            delay = policy.backoff_s
        else:
            self.fast_failures += 1
            if self.fast_failures > policy.max_fast_failures:
                self.gave_up = True
                return Decision(
                    False,
                    0.0,
                    self.fast_failures,
                    f"crash loop: {self.fast_failures} failures in a row, each before READY or "
                    f"within {policy.stable_after_s:g}s of it (at most "
                    f"{policy.max_fast_failures} are restarted)",
                )
            delay = min(policy.backoff_s * 2 ** (self.fast_failures - 1), policy.max_backoff_s)
        self.restarts += 1
        why = (
            f"{self.fast_failures} fast failure(s) in a row"
            if self.fast_failures
            else f"it had served {policy.stable_after_s:g}s or more"
        )
        return Decision(
            True, delay, self.fast_failures, f"restart {self.restarts} in {delay:g}s ({why})"
        )
