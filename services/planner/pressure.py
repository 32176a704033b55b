"""The engines' own load as a floor under the profile's sizing (pure; no I/O).

The profile sizes each pool from the router's rates and latencies, which lag what the engines
see: a decode pool whose KV cache is nearly full preempts (vLLM evicts running sequences past
it and recomputes them later) before the ITL shows it, and a prefill queue longer than the TTFT
SLO allows misses it for every request behind it. Each rule reads the pool's load at the read
(:class:`services.planner.observe.PoolLoad`) and, past its limit, says the pool needs one engine
more than it has. Both only raise a need (the planner takes the larger of theirs and the
profile's); a pool without the figure (a router that relays no engine load, no engine of the
role, engines that report no KV capacity) changes nothing. Bounds and scale-down stabilisation
apply after them as to every need.
"""

from __future__ import annotations

from typing import Literal

from services.engines.sim.profile import SimProfile
from services.planner.observe import PoolLoad

Pressure = Literal["kv_pressure", "queue"]
"""Why a rule raised a pool's need: its KV usage (decode) or its queue (prefill)."""


def kv_pressure_need(load: PoolLoad | None, ready: int | None, limit: float) -> int | None:
    """The decode pool's need from its KV usage: one engine more than it has when its usage
    (``1 - free / total`` over its engines' blocks) is above ``limit``; ``None`` when it is
    not, or is unknown. ``ready``: the pool's READY engines (the router's count; those that
    reported when it has none)."""
    if load is None:
        return None
    usage = load.kv_usage
    if usage is None or usage <= limit:
        return None
    return (ready or load.engines) + 1


def queue_need(load: PoolLoad | None, ready: int | None, limit: float) -> int | None:
    """The prefill pool's need from its queue: one engine more than it has when the requests
    waiting per engine are above ``limit`` (:func:`allowed_queue`); ``None`` when they are not,
    or are unknown."""
    if load is None:
        return None
    engines = ready or load.engines
    if load.queue_depth / engines <= limit:
        return None
    return engines + 1


def allowed_queue(profile: SimProfile, input_tokens: float, ttft_ms: float) -> float:
    """The requests that may wait on one prefill engine within the TTFT SLO: a queue of ``q``
    prompts of the mean length takes ``q * prefill_ms`` before the last one starts, so more
    than ``ttft_ms / prefill_ms`` miss it whatever else happens. At least 1 (an SLO shorter
    than one prefill would otherwise count every queued request as pressure)."""
    prefill_ms = profile.prefill_ms(max(1, round(input_tokens)))
    return max(1.0, ttft_ms / prefill_ms) if prefill_ms > 0 else float("inf")
