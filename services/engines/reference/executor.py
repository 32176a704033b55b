"""The host's handle on an engine's rank processes: start, broadcast, events, death, stop.

:class:`RankGroup` starts one process per ``(pp_rank, tp_rank)``, each with a duplex pipe, by the
options' ``start_method``: ``spawn`` (a fresh interpreter) or ``fork`` (a copy of the host, which
has no NIXL agent and, when it forks, no OpenMP pool: ``ReferenceEngineOptions.start_method``).
Commands go to every rank in the same order; events come back from any rank. A rank that exits is
noticed through its process sentinel in the same ``wait`` that reads events, so a dead rank surfaces
as :class:`EngineFailed` within one wait, never as a hang. Only the engine loop's thread uses a
group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from services.engines.backend import EngineRegistration
from services.engines.errors import EngineFailed
from services.engines.reference.messages import HostCommand, RankEvent, RankFatal, RankReady
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.rank import RankSetup, rank_main
from services.lifetime import ports_to_bind_later
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)


class RankGroup:
    """The rank processes of one engine generation."""

    def __init__(
        self,
        options: ReferenceEngineOptions,
        registration: EngineRegistration,
        compat_hash: str,
    ) -> None:
        self.options = options
        self.ranks: tuple[RankKey, ...] = tuple(
            (pp, tp) for pp in range(options.pp_size) for tp in range(options.tp_size)
        )
        self._registration = registration
        self._compat_hash = compat_hash
        self._conns: dict[RankKey, Connection] = {}
        self._processes: dict[RankKey, BaseProcess] = {}
        self.failure: str | None = None
        """Why the group failed (a rank died or reported a fatal error), once it has."""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank process (returns at once; :meth:`wait_ready` waits for them)."""
        ctx = (
            multiprocessing.get_context("fork")
            if self.options.start_method == "fork"
            else multiprocessing.get_context("spawn")
        )
        (port,) = ports_to_bind_later(1, "127.0.0.1")
        init_method = f"tcp://127.0.0.1:{port}"
        for rank in self.ranks:
            parent, child = ctx.Pipe()
            setup = RankSetup(
                self.options, rank, self._registration, init_method, self._compat_hash
            )
            process = ctx.Process(
                target=rank_main,
                args=(setup, child),
                name=f"pdserve-{self._registration.engine_id}-pp{rank[0]}tp{rank[1]}",
                daemon=True,
            )
            process.start()
            child.close()
            self._conns[rank] = parent
            self._processes[rank] = process

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every rank reported ready; raises :class:`EngineFailed` on a death, a
        fatal error or the timeout (other events that arrive meanwhile are dropped: nothing
        else runs before the engine is up)."""
        ready: set[RankKey] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self.ranks) - ready)
                raise EngineFailed(f"ranks {missing} not ready after {timeout_s} s")
            for event in self.receive(left):
                if isinstance(event, RankReady):
                    ready.add(event.rank)

    def pids(self) -> dict[RankKey, int]:
        return {rank: p.pid for rank, p in self._processes.items() if p.pid is not None}

    def stop(self, command: HostCommand, timeout_s: float) -> None:
        """Ask every live rank to exit with ``command``; kill those still running after
        ``timeout_s``. Idempotent."""
        for rank, conn in self._conns.items():
            if self._processes[rank].is_alive():
                with contextlib.suppress(OSError, ValueError):
                    conn.send(command)
        deadline = time.monotonic() + timeout_s
        for rank, process in self._processes.items():
            process.join(max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                logger.warning("rank %s did not exit in %.0f s: killing it", rank, timeout_s)
                self._kill(process)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def kill(self) -> None:
        """Kill every rank now (after a failure: survivors may be stuck in a collective)."""
        for process in self._processes.values():
            self._kill(process)

    @staticmethod
    def _kill(process: BaseProcess) -> None:
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        process.join(5)

    # -- traffic -------------------------------------------------------------------------------

    def broadcast(self, command: HostCommand) -> None:
        """Send ``command`` to every rank; raises :class:`EngineFailed` if one is gone."""
        self._check()
        for rank, conn in self._conns.items():
            try:
                conn.send(command)
            except (OSError, ValueError) as exc:
                self._fail(f"rank {rank} cannot be reached: {exc}")
                raise EngineFailed(self.failure or "") from exc

    def receive(self, timeout_s: float, *, extra: Connection | None = None) -> Iterator[RankEvent]:
        """Events that arrive within ``timeout_s`` (all that are ready once one is).

        Also wakes when ``extra`` becomes readable (the loop's wake-up pipe; not read here).
        Raises :class:`EngineFailed` when a rank died or reported a fatal error.
        """
        self._check()
        by_handle: dict[object, RankKey] = {}
        handles: list[object] = []
        for rank, conn in self._conns.items():
            by_handle[conn] = rank
            handles.append(conn)
        sentinels = {self._processes[rank].sentinel: rank for rank in self.ranks}
        handles.extend(sentinels)
        if extra is not None:
            handles.append(extra)
        ready = wait(handles, timeout=max(timeout_s, 0.0))  # type: ignore[arg-type]
        events: list[RankEvent] = []
        for handle in ready:
            source = by_handle.get(handle)
            if source is None:
                continue
            conn = self._conns[source]
            while conn.poll():
                try:
                    event: RankEvent = conn.recv()
                except (EOFError, OSError):
                    break
                if isinstance(event, RankFatal):
                    self._fail(f"rank {source} failed:\n{event.error}")
                    raise EngineFailed(f"rank {event.rank} failed: {_last_line(event.error)}")
                events.append(event)
        for handle in ready:
            if isinstance(handle, int) and handle in sentinels:
                rank = sentinels[handle]
                code = self._processes[rank].exitcode
                self._fail(f"rank {rank} exited with code {code}")
                raise EngineFailed(self.failure or "")
        return iter(events)

    def _check(self) -> None:
        if self.failure is not None:
            raise EngineFailed(self.failure)
        for rank, process in self._processes.items():
            if not process.is_alive():
                self._fail(f"rank {rank} exited with code {process.exitcode}")
                raise EngineFailed(self.failure or "")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            logger.error("engine %s: %s", self._registration.engine_id, why)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
