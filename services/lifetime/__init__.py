"""Process lifetime rules every pdserve process follows, whatever layer starts it: nothing a
process starts outlives it, and a stop ends within its bound
(:mod:`~services.lifetime.parent_death`). No import from the rest
of ``services``: Redis, Prometheus, engine ranks, vLLM's engine core and ``pdserve up``'s
children all use it."""

from services.lifetime.parent_death import (
    WATCH_PARENT_ENV,
    end_stop_within,
    exit_with_parent,
    parent_death_preexec,
)

__all__ = ["WATCH_PARENT_ENV", "end_stop_within", "exit_with_parent", "parent_death_preexec"]
