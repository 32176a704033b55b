"""The collector's policy once a long-running process serves: what start-up left alive is
frozen, and young collections run less often.

A pdserve process that serves (the router, an engine host) imports vLLM, torch and transformers:
an engine host holds about 630k objects after start-up, and one full collection over them took
333-346 ms (the router's ~90k: ~60 ms). Python runs one whenever enough objects have survived
since the last, so every so often a request waited that long behind it: `bench peers` saw a chat
turn's TTFT of 370 ms and a first decode gap of 552 ms, and a probe of the collector in every
process of a push stack found a 405 ms full pass in the serving decode host
(docs/benchmarks.md, 2026-11-28, issue 51). vLLM's own API server and engine core freeze their
start-up heap the same way (``vllm.utils.gc_utils.freeze_gc_heap``).
"""

from __future__ import annotations

import gc

SERVING_GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds once a process serves (Python's are (700, 10, 10)): a request
allocates a few hundred container objects, so the default ran a young collection every other
request."""


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (modules, the app, the engine's client, channels)
    to the permanent generation, which collections skip, and set
    :data:`SERVING_GC_THRESHOLDS`. Cyclic garbage made while serving is still collected. Call it
    once, when the process is about to serve, from its entry point (not from code a test runs
    in its own process)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
