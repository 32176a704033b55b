"""Process lifetime rules every pdserve process follows, whatever layer starts it: nothing a
process starts outlives it, and a stop ends within its bound
(:mod:`~services.lifetime.parent_death`); a fixed port taken by another process is refused
before anything starts, and a port chosen for a later bind is one the kernel does not hand out
meanwhile (:mod:`~services.lifetime.ports`); a process whose stop released everything ends
without the interpreter's finalization (:mod:`~services.lifetime.process_exit`); a process that
serves freezes what its start-up left alive (:mod:`~services.lifetime.heap`). No import from
the rest of ``services``: Redis, Prometheus, engine ranks, vLLM's engine core and
``pdserve up``'s children all use it."""

from services.lifetime.heap import (
    SERVING_GC_THRESHOLDS,
    collection_deferred_until_serving,
    freeze_startup_heap,
)
from services.lifetime.parent_death import (
    WATCH_PARENT_ENV,
    end_stop_within,
    exit_with_parent,
    parent_death_preexec,
)
from services.lifetime.ports import PortTaken, check_free, ports_to_bind_later
from services.lifetime.process_exit import end_process

__all__ = [
    "SERVING_GC_THRESHOLDS",
    "WATCH_PARENT_ENV",
    "PortTaken",
    "check_free",
    "collection_deferred_until_serving",
    "end_process",
    "end_stop_within",
    "exit_with_parent",
    "freeze_startup_heap",
    "parent_death_preexec",
    "ports_to_bind_later",
]
