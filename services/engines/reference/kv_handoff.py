"""The reference scheduler's KV hand-off messages: a held prefill's handle, a remote decode's
pull command, how its ranks' pull reports become an error, how a lease ended.

The scheduler (:mod:`~services.engines.reference.scheduler`) decides when; these build what it
sends (to the ranks, see :mod:`~services.engines.reference.messages`) or delivers (to the
caller). Nothing here changes scheduler state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.engines.errors import EngineError, KVTransferFailed, ProducerUnavailable
from services.engines.reference.messages import PullDone, PullKV
from services.engines.reference.metrics import ReferenceEngineMetrics
from services.engines.reference.request_state import EngineRequest, SchedulerLimits
from services.engines.requests import KVHandle

UNAVAILABLE_REASONS = frozenset(
    {"producer_unavailable", "stale_generation", "unknown_peer", "peer_removed", "peer_replaced"}
)
"""Pull failures that mean "the producer is not there (at that generation)"; anything else is a
failed transfer."""

LEASE_OUTCOMES = ("aborted", "expired", "released")
"""A held request's outcomes, the first one any rank reported wins."""


def held_handle(
    request: EngineRequest, engine_id: str, generation: int, lease_expires_at_s: float
) -> KVHandle:
    """The handle a prefill returns for the prompt blocks its ranks now hold."""
    return KVHandle(
        producer_engine_id=engine_id,
        generation=generation,
        request_id=request.request_id,
        block_ids=tuple(request.block_ids),
        num_tokens=len(request.prompt),
        lease_expires_at_s=lease_expires_at_s,
    )


def pull_command(request: EngineRequest, limits: SchedulerLimits) -> PullKV:
    """The command that has every rank pull its share of a remote decode's prompt KV: the
    blocks past the request's prefix-cache hit (none when it holds them all: the pull then
    only notifies the producer ranks, which free the blocks at once)."""
    handle = request.handle
    assert handle is not None  # submit checks
    held = request.cached_tokens // limits.block_size
    return PullKV(
        request_id=request.request_id,
        producer_engine=handle.producer_engine_id,
        producer_generation=handle.generation,
        remote_block_ids=handle.block_ids[held:],
        local_block_ids=tuple(request.block_ids[held : len(handle.block_ids)]),
        timeout_s=limits.kv_pull_timeout_s,
        connect_wait_s=limits.producer_connect_wait_s,
    )


def pull_error(
    request: EngineRequest, failures: Sequence[PullDone], metrics: ReferenceEngineMetrics
) -> EngineError:
    """The error a failed pull delivers (the first failure that is not a cancellation names
    it), counted."""
    first = next((f for f in failures if f.reason != "cancelled"), failures[0])
    assert request.handle is not None  # a pulling request has one
    if first.reason in UNAVAILABLE_REASONS:
        metrics.kv_error("ProducerUnavailable", first.reason)
        return ProducerUnavailable(
            f"producer {request.handle.producer_engine_id} "
            f"unavailable for {request.request_id}: {first.reason} {first.message}"
        )
    metrics.kv_error("KVTransferFailed", first.reason)
    return KVTransferFailed(
        f"KV pull of {request.request_id} failed on rank {first.rank}: "
        f"{first.reason} {first.message}",
        first.reason,
    )


def lease_outcome(outcomes: Iterable[str]) -> str:
    """How a held request ended over all its ranks (aborted over expired over released)."""
    seen = set(outcomes)
    return next(o for o in LEASE_OUTCOMES if o in seen)
