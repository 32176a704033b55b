"""Closes the scheduling layer starts without waiting for them (a departed engine's connector,
its KV-event subscriber): each task held until it ends, its failure logged, and all awaited
when the owner closes. A close that raised in a task nobody awaited used to surface only as
asyncio's "Task exception was never retrieved", with no word of what failed to close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundCloses:
    """Closes of ``what`` (named in the log) under way; :meth:`wait` awaits them all."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, close: Coroutine[Any, Any, Any]) -> None:
        """Run ``close`` on the running loop without waiting; with no loop (unit tests feeding
        the pool synchronously) it is not run."""
        try:
            task = asyncio.get_running_loop().create_task(close)
        except RuntimeError:
            close.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.warning("closing %s failed: %r", self._what, error)

    async def wait(self) -> None:
        """Until every close under way has ended (their failures logged, not raised)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
