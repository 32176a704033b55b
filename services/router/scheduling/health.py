"""Health feedback: a circuit breaker per engine generation, fed by the router's own calls.

The control plane says which engines are READY; it learns that an engine died only when its
lease runs out (seconds). The router learns it at once, from its calls: an engine whose call
failed through the engine's fault (unreachable, failed, timed out, a broken decode stream) is
taken out of the router's choices immediately, without waiting for the lease.

States (per :class:`~services.router.scheduling.pool.EngineSlot`; a new generation gets a new slot
and so a closed breaker)::

    closed ──failure──> open ──back-off elapsed, next call──> half_open (one probe call)
      ^                  ^                                       │
      └────success───────┼───────────────────────────────────────┤
                         └──────────failure (back-off doubles)───┘

While open, and while the half-open probe is in flight, :meth:`CircuitBreaker.available` is
false and the scheduler does not choose the engine (see ``services.router.scheduling.scheduler``).
The probe is the first call made after the back-off; its success closes the breaker, its failure
opens it again with twice the back-off (up to a maximum). A probe that never reports (its
request ended before using the engine) stops blocking after ``probe_lease_s``.

Not engine faults, so never counted against a breaker: bad input, overloaded or draining
engines (load, not health), and KV-pull failures the decode engine reports about a producer
(the producer's own next call decides; the request itself avoids that producer).

Exported as ``pdserve_router_engine_circuit_state{engine, role, state}`` (read from the pool
when scraped) and ``pdserve_router_circuit_trips_total{engine, role}``; ``pdserve status
--router URL`` shows the states.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One engine's breaker; see the module docstring. Not thread-safe (one event loop)."""

    def __init__(
        self,
        *,
        backoff_s: float = 5.0,
        max_backoff_s: float = 60.0,
        probe_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._base_backoff_s = backoff_s
        self._max_backoff_s = max(max_backoff_s, backoff_s)
        self._probe_lease_s = probe_lease_s
        self._clock = clock
        self._backoff_s = backoff_s
        self.state = CircuitState.CLOSED
        self._reopen_at = 0.0
        self._probe_started = 0.0
        self.trips = 0

    def available(self) -> bool:
        """Whether the scheduler may choose this engine now."""
        if self.state is CircuitState.CLOSED:
            return True
        now = self._clock()
        if self.state is CircuitState.OPEN:
            return now >= self._reopen_at
        return now - self._probe_started >= self._probe_lease_s

    def begin_call(self) -> None:
        """Called right before each call on the engine: the first call after the back-off is
        the half-open probe (others are kept away until it reports)."""
        if self.state is not CircuitState.CLOSED and self.available():
            self.state = CircuitState.HALF_OPEN
            self._probe_started = self._clock()

    def success(self) -> None:
        """A call succeeded: close the breaker and reset the back-off."""
        self.state = CircuitState.CLOSED
        self._backoff_s = self._base_backoff_s

    def failure(self) -> bool:
        """A call failed through the engine's fault: open (again). True when this opened a
        closed breaker (a trip, counted by the caller)."""
        tripped = self.state is CircuitState.CLOSED
        if self.state is CircuitState.HALF_OPEN:
            self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        self.state = CircuitState.OPEN
        self._reopen_at = self._clock() + self._backoff_s
        if tripped:
            self.trips += 1
        return tripped

    @property
    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 otherwise)."""
        if self.state is not CircuitState.OPEN:
            return 0.0
        return max(self._reopen_at - self._clock(), 0.0)
