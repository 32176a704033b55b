"""``StreamBounds``: one timer for a whole engine stream, instead of one ``asyncio.timeout`` per
message.

A Decode stream has two bounds (:mod:`services.router.execution.executor`): ``idle_s`` between two
messages (the first included), counted only while the router waits on the engine, and
``whole_s`` for the call. ``asyncio.timeout`` per message costs a ``Timeout``, a loop timer and
its cancellation for every token; here a message costs two stores (:meth:`waiting`,
:meth:`done_waiting`), and the one loop timer is re-armed only when it fires before the bound it
stands for (the wait it was armed for ended, or a later one began).

Expiry is reported as ``asyncio.timeout`` reports it: the waiting task is cancelled, and
:meth:`expired_here` (called on the ``CancelledError``) uncancels it and says whether the
cancellation was this timer's alone (a cancellation from elsewhere, such as a client that hung
up, still propagates).
"""

from __future__ import annotations

import asyncio

EARLY_S = 1e-3
"""A timer that fires at most this early counts as on time (event loops round timers)."""


class StreamBounds:
    """The idle and whole-call bounds of one engine stream; see the module docstring.

    ``expired`` is ``"idle"`` or ``"deadline"`` once a bound tripped (the one that was the
    nearer when the wait began), else ``None``. Create within the running loop; ``close``
    when the stream ends.
    """

    def __init__(self, idle_s: float, whole_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        now = self._loop.time()
        self._deadline = now + whole_s
        self._since = now
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._handle: asyncio.TimerHandle | None = None
        self.expired: str | None = None

    def waiting(self) -> None:
        """The current task starts waiting for the engine's next message."""
        self._since = self._loop.time()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        if self._handle is None:
            self._arm()

    def done_waiting(self) -> None:
        """The message came (or the wait ended otherwise)."""
        self._task = None

    def expired_here(self) -> bool:
        """On a ``CancelledError`` from the wait: whether it is this timer's expiry (the task is
        uncancelled then, as ``asyncio.timeout`` does) rather than a cancellation from
        elsewhere."""
        if self.expired is None:
            return False
        task = asyncio.current_task()
        assert task is not None
        return task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _due(self) -> float:
        return min(self._since + self._idle_s, self._deadline)

    def _arm(self) -> None:
        self._handle = self._loop.call_at(self._due(), self._fire)

    def _fire(self) -> None:
        self._handle = None
        task = self._task
        if task is None or self.expired is not None:
            return  # not waiting now: the next wait arms the timer again
        if self._due() - self._loop.time() > EARLY_S:
            self._arm()  # armed for an earlier wait; this one is not due yet
            return
        self.expired = "idle" if self._since + self._idle_s < self._deadline else "deadline"
        task.cancel()
