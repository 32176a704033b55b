"""From a pool's needed replicas to its desired count: bounds, then scale-down stabilisation.

Up at once; down only once every need of the last ``window`` intervals was below the current
count, and then to the highest of them (as Kubernetes' HPA stabilisation window), so a load that
oscillates changes a pool at most once a window downwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

Reason = Literal[
    "scale_up", "scale_down", "hold", "hold_stabilizing", "at_min", "at_max", "no_metrics"
]
REASONS: tuple[Reason, ...] = (
    "scale_up",
    "scale_down",
    "hold",
    "hold_stabilizing",
    "at_min",
    "at_max",
    "no_metrics",
)
"""Every ``reason`` of ``pdserve_planner_decisions_total``: the count went up or down, stayed
(``hold``), stayed while a lower need waits out the window (``hold_stabilizing``), stayed at a
bound the need is beyond (``at_min``, ``at_max``), or stayed because the interval's figures
were missing or stale (``no_metrics``)."""


@dataclass(frozen=True)
class Bounds:
    """``--min`` and ``--max`` of one pool (``1 <= low <= high``: never zero engines)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"pool bounds need 1 <= min <= max, got {self.low}..{self.high}")

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.low), self.high)


@dataclass(frozen=True)
class Decision:
    desired: int
    needed: int
    """The need before bounds and stabilisation."""
    reason: Reason


class PoolPlanner:
    """One pool's desired count over intervals (``window`` intervals of scale-down
    stabilisation; 1 scales down at once)."""

    def __init__(self, bounds: Bounds, window: int, initial: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"stabilisation window must be >= 1 interval, got {window}")
        self.bounds = bounds
        self.desired = bounds.clamp(initial if initial is not None else bounds.low)
        self._needs: deque[int] = deque(maxlen=window)

    def decide(self, needed: int) -> Decision:
        """The desired count after one interval whose pool needs ``needed`` replicas."""
        bounded = self.bounds.clamp(needed)
        self._needs.append(bounded)
        previous = self.desired
        if bounded >= previous:
            self.desired = bounded
        elif len(self._needs) == self._needs.maxlen and max(self._needs) < previous:
            self.desired = max(self._needs)
        return Decision(self.desired, needed, self._reason(previous, bounded, needed))

    def hold(self) -> Decision:
        """An interval without figures: keep the count (and forget no need seen before)."""
        return Decision(self.desired, self.desired, "no_metrics")

    def _reason(self, previous: int, bounded: int, needed: int) -> Reason:
        if self.desired > previous:
            return "scale_up"
        if self.desired < previous:
            return "scale_down"
        if bounded < previous:
            return "hold_stabilizing"
        if needed > self.bounds.high:
            return "at_max"
        if needed < self.bounds.low:
            return "at_min"
        return "hold"
