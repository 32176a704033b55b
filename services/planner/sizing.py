"""How many engines each pool needs for a load at the SLOs, from a profile: pure arithmetic.

Prefill (one prompt at a time per engine, as the profile's ``prefill_ms`` times it): a prompt of
the mean input length ``I`` takes ``s = prefill_ms(I)``, so an engine completes ``mu = 1000 / s``
prompts a second (``I * mu`` prompt tokens/s). Arrivals queue as in an M/D/1 queue, whose mean
wait at utilisation ``rho`` is ``rho * s / (2 * (1 - rho))``; TTFT is that wait, the prefill
and the KV transfer (``transfer_ms(I)``). The largest utilisation meeting the TTFT budget is
``rho* = 2k / (1 + 2k)`` with ``k = (ttft - transfer) / s - 1``, kept within
``[RHO_FLOOR, RHO_CAP]``: the cap leaves head-room for bursts, and the floor sizes a pool whose
SLO no utilisation meets (the prefill alone is longer) for its throughput instead of without
bound. Prefill replicas: ``ceil(rate / (rho* * mu))``.

Cached prompts: a request whose prompt's first ``K`` tokens the prefill engine holds in its
prefix cache computes only the rest (the profile's step with ``K`` tokens of context,
:func:`prefill_service_ms`), so ``Load.cached_tokens`` (the router's count of what its
placements found cached) shortens ``s`` and a fleet whose prompts mostly hit is not sized as
if every token were computed. The transfer still moves the whole prompt.

Decode: a step of ``B`` sequences at the mean context ``C = I + O/2`` takes ``decode_step_ms(B,
B*C)``; the largest ``B`` whose step meets the ITL, within ``max_num_seqs`` and the KV blocks
(a sequence holds ``ceil((I + O) / block_size)`` blocks at its end), gives ``B * 1000 / step``
tokens/s an engine (``B = 1`` when even one sequence misses the ITL). Decode replicas:
``ceil(rate * O / tokens_per_s)``.

Correction: the SLOs are divided by the pool's observed/expected ratio (clamped), so a fleet
slower than its profile is sized against a tighter target. Every function is monotone: a higher
rate or a tighter SLO never gives fewer replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engines.sim.profile import SimProfile

RHO_CAP = 0.9
"""The highest prefill utilisation planned for, whatever the SLO allows."""
RHO_FLOOR = 0.1
"""The lowest: below it queueing is not what misses the TTFT."""


@dataclass(frozen=True)
class Load:
    """One interval's load: requests a second and their mean lengths in tokens."""

    rate_rps: float
    input_tokens: float
    output_tokens: float
    cached_tokens: float = 0.0
    """Mean prompt tokens a request placed on the prefill pool finds in its engine's prefix
    cache (not computed there)."""


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class PoolSize:
    """What one pool needs: ``replicas`` (0 for no load), each engine's capacity in its own
    unit (prompt tokens/s for prefill, generated tokens/s for decode), and whether the SLO is
    reachable at all with this profile (more engines do not shorten one prefill or one step)."""

    replicas: int
    tokens_per_s: float
    slo_reachable: bool


def prefill_service_ms(profile: SimProfile, input_tokens: float, cached_tokens: float) -> float:
    """One prompt of ``input_tokens`` whose first ``cached_tokens`` are cached (at most all but
    its last token): the rest computed over the cached context."""
    tokens = max(1, round(input_tokens))
    cached = min(max(0, round(cached_tokens)), tokens - 1)
    return profile.step_ms(prefill_chunks=[(cached, tokens - cached)])


def prefill_size(profile: SimProfile, load: Load, ttft_ms: float) -> PoolSize:
    """The prefill pool for ``load`` at ``ttft_ms`` (see the module docstring)."""
    tokens = max(1, round(load.input_tokens))
    service_ms = prefill_service_ms(profile, load.input_tokens, load.cached_tokens)
    budget_ms = ttft_ms - profile.transfer_ms(tokens)
    k = budget_ms / service_ms - 1
    rho = 2 * k / (1 + 2 * k) if k > 0 else 0.0
    rho = min(max(rho, RHO_FLOOR), RHO_CAP)
    prompts_per_s = 1000 / service_ms
    replicas = math.ceil(load.rate_rps / (rho * prompts_per_s)) if load.rate_rps > 0 else 0
    return PoolSize(replicas, tokens * prompts_per_s, slo_reachable=k >= 0)


def expected_ttft_ms(
    profile: SimProfile, input_tokens: float, utilisation: float, cached_tokens: float = 0.0
) -> float:
    """The TTFT the model expects at ``utilisation`` of the prefill pool (capped at
    :data:`RHO_CAP`): the M/D/1 wait, the prefill (of what is not cached) and the transfer."""
    tokens = max(1, round(input_tokens))
    service_ms = prefill_service_ms(profile, input_tokens, cached_tokens)
    rho = min(max(utilisation, 0.0), RHO_CAP)
    return service_ms + rho * service_ms / (2 * (1 - rho)) + profile.transfer_ms(tokens)


def max_decode_batch(profile: SimProfile, load: Load, itl_ms: float) -> tuple[int, bool]:
    """The largest batch whose step at the mean context meets ``itl_ms`` within the engine's
    limits, and whether one exists (else 1, ``False``)."""
    context = load.input_tokens + load.output_tokens / 2
    blocks_each = math.ceil((load.input_tokens + load.output_tokens) / profile.kv_cache.block_size)
    limit = min(profile.scheduler.max_num_seqs, profile.kv_cache.num_blocks // max(blocks_each, 1))
    limit = max(limit, 1)
    decode = profile.decode
    per_sequence = decode.per_sequence_ms + decode.per_context_token_ms * context
    if per_sequence > 0:
        batch = math.floor((itl_ms - decode.base_ms) / per_sequence)
    else:
        batch = limit if itl_ms >= decode.base_ms else 0
    batch = min(batch, limit)
    # The closed form may be off by one at a float boundary: the profile has the last word.
    while batch >= 1 and _step_ms(profile, batch, context) > itl_ms:
        batch -= 1
    return (batch, True) if batch >= 1 else (1, False)


def decode_size(profile: SimProfile, load: Load, itl_ms: float) -> PoolSize:
    """The decode pool for ``load`` at ``itl_ms`` (see the module docstring)."""
    batch, reachable = max_decode_batch(profile, load, itl_ms)
    context = load.input_tokens + load.output_tokens / 2
    tokens_per_s = batch * 1000 / _step_ms(profile, batch, context)
    demand = load.rate_rps * load.output_tokens
    replicas = math.ceil(demand / tokens_per_s) if demand > 0 else 0
    return PoolSize(replicas, tokens_per_s, slo_reachable=reachable)


def expected_itl_ms(profile: SimProfile, load: Load, engines: int) -> float:
    """The step time the model expects on ``engines`` decode engines sharing ``load``: the batch
    ``b`` that Little's law gives when each sequence holds a slot for ``O`` steps of its own
    length (``b = lambda * O * step(b) / 1000``, solved in closed form for the linear step),
    within ``[1, max_num_seqs]``."""
    context = load.input_tokens + load.output_tokens / 2
    decode = profile.decode
    per_engine = load.rate_rps * load.output_tokens / max(engines, 1) / 1000
    slope = decode.per_sequence_ms + decode.per_context_token_ms * context
    denominator = 1 - per_engine * slope
    limit = profile.scheduler.max_num_seqs
    batch = per_engine * decode.base_ms / denominator if denominator > 0 else float(limit)
    batch = min(max(batch, 1.0), float(limit))
    return decode.base_ms + slope * batch


def _step_ms(profile: SimProfile, batch: int, context: float) -> float:
    return profile.decode_step_ms(batch, round(batch * context))


def correction(observed_ms: float | None, expected_ms: float, low: float, high: float) -> float:
    """``observed / expected`` within ``[low, high]``; 1.0 without an observation."""
    if observed_ms is None or expected_ms <= 0:
        return 1.0
    return min(max(observed_ms / expected_ms, low), high)
