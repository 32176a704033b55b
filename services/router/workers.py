"""``pdserve router --workers N``: N router processes serving one port.

The supervisor (the process ``pdserve router`` runs in) reserves the port with an
``SO_REUSEPORT`` socket (so ``--port 0`` resolves once for every worker), starts N workers
(``multiprocessing`` spawn; settings pickled over the pipe, API keys never in argv or the
environment), waits for each one's ready payload, prints one ``PDSERVE_READY`` line, and then
only supervises:

- **Sharing the port**: every worker binds the port with ``SO_REUSEPORT``; the kernel hashes
  each new connection to one worker's accept queue, so no accept wakes every process (no
  thundering herd) and keep-alive connections stay on their worker.
- **Sharing the control plane's view**: each worker follows the control plane itself (its own
  ``EnginePool`` and watcher), as separate router replicas do. Picks do not herd because
  ``least_loaded`` / ``prefix_aware`` score an engine by the worker's *own* reservations (exact
  for its own requests, taken before its first ``await``) plus the queue the engine reports in
  its heartbeat (everyone else's work); ties rotate. Connections are spread evenly over workers,
  so each worker spreads its share evenly and so does the sum (tested with two workers over two
  engine pairs). No counter is shared between processes: a shared one would need a lock or
  atomics on every pick and release for a gain only at tiny concurrency.
- **Metrics**: each worker serves its own registry on its own port (``worker_metrics_port`` +
  i, or free ports), listed as ``metrics_urls`` in the ready line and in ``pdserve up``'s
  ``endpoints.json``; Prometheus scrapes every worker and the dashboards' ``sum()`` adds them.
  The shared port's ``/metrics`` answers the one worker that took the connection.
- **Stopping**: workers run in their own process group, so a terminal's Ctrl-C reaches only the
  supervisor, which sends each worker SIGTERM once (uvicorn's graceful shutdown) and waits;
  a worker that does not stop within :data:`STOP_GRACE_S` is killed. A worker that exits on its
  own stops the others (exit status 1). A worker whose supervisor is killed stops by itself
  (it polls its parent).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

from services.lifetime import PortTaken, check_free
from services.router.config import RouterSettings
from services.router.main import reuse_port_socket, run
from services.serving.ready import format_ready_line

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long every worker has to report ready."""

STOP_GRACE_S = 15.0
"""How long workers have after SIGTERM (uvicorn's graceful shutdown is 10 s) before SIGKILL."""


def worker_settings(settings: RouterSettings, index: int, port: int) -> RouterSettings:
    """Worker ``index``'s settings: the shared port with ``SO_REUSEPORT``, its metrics port."""
    base = settings.worker_metrics_port
    return settings.model_copy(
        update={
            "workers": 1,
            "port": port,
            "reuse_port": True,
            "metrics_port": base + index if base else 0,
        }
    )


def _worker_main(settings: RouterSettings, index: int, parent_pid: int, ready: Queue[Any]) -> None:
    """A worker process: its own process group (Ctrl-C goes to the supervisor only), then the
    router until SIGTERM or until the supervisor is gone."""
    os.setpgid(0, 0)
    logging.basicConfig(level=settings.log_level.upper())

    def announce(payload: dict[str, Any]) -> None:
        ready.put({**payload, "worker": index})

    run(settings, ready=announce, parent_pid=parent_pid)


def serve_workers(settings: RouterSettings) -> int:
    """Run ``settings.workers`` workers on one port until SIGINT/SIGTERM (0) or until a worker
    exits on its own (1); see the module docstring."""
    # SO_REUSEPORT would let the workers share a port another process (another router) holds:
    # refused first, naming the holder.
    try:
        check_free([("router", settings.host, settings.port)])
    except PortTaken as exc:
        print(f"pdserve router: {exc}", file=sys.stderr, flush=True)
        return 2
    # Bound, not listening: it takes no connection, it only resolves and holds the port.
    reserved = reuse_port_socket(settings.host, settings.port, listen=False)
    port = reserved.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    ready: Queue[Any] = context.Queue()
    workers: list[BaseProcess] = []
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(settings.workers):
            process = context.Process(
                target=_worker_main,
                args=(worker_settings(settings, index, port), index, os.getpid(), ready),
                name=f"pdserve-router-worker-{index}",
            )
            process.start()
            workers.append(process)
        payloads = _wait_ready(workers, ready, lambda: stopping)
        reserved.close()  # every worker listens now
        if payloads is None:
            return 0 if stopping else 1
        first = payloads[0]
        print(
            format_ready_line(
                {
                    "service": "router",
                    "url": first["url"],
                    "port": port,
                    "metrics_url": first["metrics_url"],
                    "metrics_urls": [payload["metrics_url"] for payload in payloads],
                    "workers": len(payloads),
                    "pids": [payload["pid"] for payload in payloads],
                }
            ),
            flush=True,
        )
        while not stopping:
            dead = [process for process in workers if not process.is_alive()]
            if dead:
                logger.error(
                    "router worker %s exited with status %s; stopping the others",
                    dead[0].name,
                    dead[0].exitcode,
                )
                return 1
            time.sleep(0.2)
        return 0
    finally:
        reserved.close()
        _stop(workers)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_ready(
    workers: list[BaseProcess], ready: Queue[Any], stopping: Any
) -> list[dict[str, Any]] | None:
    """Every worker's ready payload by index, or ``None`` if one exited or a stop came first."""
    payloads: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(payloads) < len(workers):
        if stopping() or time.monotonic() > deadline:
            if not stopping():
                logger.error("router workers not ready within %.0fs", START_TIMEOUT_S)
            return None
        for process in workers:
            if not process.is_alive():
                logger.error("router worker %s exited before it was ready", process.name)
                return None
        try:
            payload = ready.get(timeout=0.2)
        except queue.Empty:
            continue
        payloads[int(payload["worker"])] = payload
    return [payloads[index] for index in range(len(workers))]


def _stop(workers: list[BaseProcess]) -> None:
    """SIGTERM to every live worker once, wait up to :data:`STOP_GRACE_S`, then SIGKILL."""
    for process in workers:
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("router worker %s did not stop; killing it", process.name)
            process.kill()
            process.join()
