"""The collector's policy in a process that serves (the router, an engine host): no automatic
collection while it starts, what start-up left alive frozen once it serves, and young
collections less often from then on.

A pdserve process that serves (the router, an engine host) imports vLLM, torch and transformers:
an engine host holds about 630k objects after start-up, and one full collection over them took
333-346 ms (the router's ~90k: ~60 ms). Python runs one whenever enough objects have survived
since the last, so every so often a request waited that long behind it: `bench peers` saw a chat
turn's TTFT of 370 ms and a first decode gap of 552 ms, and a probe of the collector in every
process of a push stack found a 405 ms full pass in the serving decode host
(docs/benchmarks.md, 2026-11-28, issue 51). vLLM's own API server and engine core freeze their
start-up heap the same way (``vllm.utils.gc_utils.freeze_gc_heap``).

While such a process starts, its imports alone ran ten full collections, 2-2.8 s of CPU in
the router and in each vLLM engine host, and every vLLM process forked from a host paid two or
three more over the heap it inherited (0.4 s each): about 11 s of CPU in all to start a 1 + 1
vLLM stack, for a few hundred cyclic objects freed. So, as Python's documentation of
``gc.freeze`` advises for a parent that forks: collection is off while the process starts,
everything alive is frozen right before each fork, and a forked child collects again at once
(vLLM's engine core and workers, the reference engine's ranks: they never reach this module's
serving call).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

SERVING_GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds once a process serves (Python's are (700, 10, 10)): a request
allocates a few hundred container objects, so the default ran a young collection every other
request."""


_starting = False
"""Whether this process is in :func:`collection_deferred_until_serving` and not yet serving."""
_fork_hooks_registered = False


def _freeze_before_fork() -> None:
    if _starting:
        gc.freeze()


def _collect_in_child() -> None:
    if _starting:  # the child (a rank, vLLM's engine core or worker) never calls the freeze
        gc.enable()


@contextlib.contextmanager
def collection_deferred_until_serving() -> Iterator[None]:
    """Around the whole run of a process that calls :func:`freeze_startup_heap` once it
    serves: no automatic collection until then (explicit ``gc.collect()`` calls still run), and
    each child forked meanwhile gets a frozen heap and collects. On the way out the collector is
    as it was (a test calling the entry point in its own process keeps its collector)."""
    global _starting, _fork_hooks_registered  # noqa: PLW0603 - one interpreter, one state
    if not _fork_hooks_registered:  # fork hooks cannot be removed: registered once, gated
        os.register_at_fork(before=_freeze_before_fork, after_in_child=_collect_in_child)
        _fork_hooks_registered = True
    was_enabled = gc.isenabled()
    _starting = True
    gc.disable()
    try:
        yield
    finally:
        _starting = False
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (modules, the app, the engine's client, channels)
    to the permanent generation, which collections skip, and set
    :data:`SERVING_GC_THRESHOLDS`. Cyclic garbage made while serving is still collected. Call it
    once, when the process is about to serve, from its entry point (not from code a test runs
    in its own process); it ends :func:`collection_deferred_until_serving`'s deferral."""
    global _starting  # noqa: PLW0603
    _starting = False
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    gc.enable()
