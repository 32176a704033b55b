"""A session-wide pool of spawned worker processes (each imports torch and NIXL once).

The modules that use it name :data:`WORKER_POOL` as their ``xdist_group``, so ``make test``'s
workers (``--dist loadgroup``) run them all in one process and spawn the pool once, not once
in each worker that happens to draw one of them (six processes importing torch and NIXL: about
a dozen seconds of CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.kv_transfer.harness import WorkerProcess, spawn_workers

POOL_SIZE = 6
WORKER_POOL = "kv-transfer-worker-pool"
"""The ``xdist_group`` of the modules that use :func:`worker_pool`."""


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[list[WorkerProcess]]:
    workers = spawn_workers(POOL_SIZE)
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def workers(worker_pool: list[WorkerProcess]) -> Iterator[list[WorkerProcess]]:
    """The pool's workers; every one is closed after the test with its block pool full."""
    for worker in worker_pool:
        if not worker.process.is_alive():
            pytest.fail(f"worker {worker.process.pid} died in an earlier test")
    yield worker_pool
    for worker in worker_pool:
        worker.drain()
    statuses = [worker.call("close", timeout_s=30) for worker in worker_pool]
    leaked = [s for s in statuses if s is not None and s[0] != s[1]]
    assert not leaked, f"block pools not back to full (free, total): {leaked}"
