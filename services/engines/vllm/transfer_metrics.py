"""vLLM's NIXL transfer statistics as pdserve's ``pdserve_kv_transfer_*`` series.

vLLM's NIXL workers time every transfer they initiate (push: the prefill's WRITEs; pull: the
decode's READs) in ``NixlKVConnectorStats``; EngineCore aggregates the workers' stats each step
and hands them, as the dict ``SchedulerStats.kv_connector_stats``, to the stat loggers of the
process hosting ``AsyncLLM``. :class:`VllmTransferExporter` turns that dict into the same series
the reference engine emits (docs/metrics.md), so the KV-transfer dashboard charts vLLM engines.

NIXL's post time of each transfer (vLLM's ``vllm:nixl_post_time_seconds``, the one figure of
vLLM's ``vllm:nixl_*`` series the transfer series lack) goes to
``pdserve_kv_transfer_descriptor_prep_seconds``, the per-request cost of issuing a transfer.

vLLM aggregates over peers and ranks, so the peer side of a pair is labelled ``unknown`` and
ranks ``all``: latency, bytes, descriptors, failures and expiries are exact per engine, not per
rank pair. Pure code over plain data: no vLLM import.

A consumer's scheduler also stamps when each request's KV is in place (push: the producer's
WRITE notification seen by every worker; pull: every worker's READ done), as
``[vLLM request id, wall-clock time]`` pairs under :data:`KV_IN_PLACE_KEY`: the decode backend
reports the time from a Decode call's arrival to that stamp as the first delta's
``kv_transfer_s``, the router's ``pdserve_router_ttft_phase_seconds{phase="handoff"}``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from services.control_plane.wire import EngineId
from services.engines.requests import DecodeRequest
from services.engines.vllm.contracts import RELEASE_REASONS
from services.kv_transfer.metrics import KVTransferMetrics

KV_IN_PLACE_KEY = "pdserve_kv_in_place"
"""The stats key of ``[vLLM request id, time.time()]`` pairs: a request's KV in place."""
IN_PLACE_REMEMBERED = 4096
"""Stamps kept for requests whose first token was not taken yet (an aborted one's never is)."""
UNKNOWN_PEER = "unknown"
ALL_RANKS = "all"
_FAILURE_KEYS = {
    "num_failed_transfers": "vllm_transfer_failed",
    "num_failed_notifications": "vllm_notification_failed",
    "num_failed_handshakes": "vllm_handshake_failed",
    # A consumer finished reading blocks the producer had already released at lease expiry
    # (the KV it read may have been overwritten): counted where the producer notices it.
    "num_notifications_after_expiry": "vllm_read_after_expiry",
}


def release_stat_key(reason: str) -> str:
    """The stats key counting releases for ``reason`` (one of ``contracts.RELEASE_REASONS``)."""
    return f"pdserve_released_{reason}"


class VllmTransferExporter:
    """Records one engine's ``kv_connector_stats`` dicts (see the module docstring)."""

    def __init__(self, metrics: KVTransferMetrics, engine_id: EngineId, *, producer: bool) -> None:
        self.metrics = metrics
        self.engine_id = engine_id
        self.producer = producer
        self.transfers = 0
        """Transfers recorded so far (successful ones)."""
        self.transfer_seconds = 0.0
        """Their summed durations (``pdserve bench engine`` averages over them)."""
        self.descriptors = 0
        """Their summed NIXL descriptor counts (``pdserve bench engine`` averages over them)."""
        self._in_place: OrderedDict[str, float] = OrderedDict()
        """The caller's request id -> when its KV was in place (``time.time()``)."""
        if producer:
            # Exported at 0 from the start, as the reference engine's producers do: the first
            # expiry is then an increase that increase() and PdserveKVLeasesExpiring see (a
            # series born at 1 is not).
            self._expired_leases()

    def _expired_leases(self) -> Any:
        return self.metrics.expired_leases.labels(
            producer_engine=self.engine_id, consumer_engine=UNKNOWN_PEER, producer_rank=ALL_RANKS
        )

    def _pair(self) -> dict[str, str]:
        own, peer = self.engine_id, UNKNOWN_PEER
        producer, consumer = (own, peer) if self.producer else (peer, own)
        return {
            "producer_engine": producer,
            "consumer_engine": consumer,
            "producer_rank": ALL_RANKS,
            "consumer_rank": ALL_RANKS,
        }

    def record(self, stats: Mapping[str, Any] | None) -> None:
        """Add one step's aggregated stats (``None`` or an empty dict: nothing happened)."""
        if not stats:
            return
        for stamp in stats.get(KV_IN_PLACE_KEY) or ():
            self._stamp(stamp)
        pair = self._pair()
        durations = _floats(stats.get("transfer_duration"))
        sizes = _floats(stats.get("bytes_transferred"))
        descriptors = _floats(stats.get("num_descriptors"))
        posts = _floats(stats.get("post_duration"))
        for index, seconds in enumerate(durations):
            self.metrics.transfer_latency.labels(**pair).observe(seconds)
            if index < len(sizes):
                self.metrics.transferred_bytes.labels(**pair).inc(sizes[index])
            if index < len(descriptors):
                self.metrics.descriptors.labels(**pair).observe(descriptors[index])
            if index < len(posts):  # vLLM's vllm:nixl_post_time_seconds: the closest figure
                self.metrics.descriptor_prep.labels(**pair).observe(posts[index])
        self.transfers += len(durations)
        self.transfer_seconds += sum(durations)
        self.descriptors += int(sum(descriptors))
        for key, reason in _FAILURE_KEYS.items():
            failed = len(stats.get(key) or ())
            if failed:
                self.metrics.failures.labels(**pair, reason=reason).inc(failed)
        expired = len(stats.get("num_kv_expired_reqs") or ())
        if expired and self.producer:
            self._expired_leases().inc(expired)
        for reason in RELEASE_REASONS:
            released = len(stats.get(release_stat_key(reason)) or ())
            if released:
                self.metrics.released.labels(**self._engines(), reason=reason).inc(released)

    def _stamp(self, stamp: Sequence[Any]) -> None:
        vllm_request_id, at = str(stamp[0]), float(stamp[1])
        # vLLM's own id is the caller's plus "-" and 8 random characters (assign_request_id).
        request_id = vllm_request_id.rpartition("-")[0] or vllm_request_id
        self._in_place[request_id] = at
        while len(self._in_place) > IN_PLACE_REMEMBERED:
            self._in_place.popitem(last=False)

    def take_in_place(self, request_id: str) -> float | None:
        """When ``request_id``'s KV was in place (``time.time()``), once; ``None`` when no
        stamp came (nothing was received: a full prefix-cache hit, a local decode)."""
        return self._in_place.pop(request_id, None)

    def _engines(self) -> dict[str, str]:
        own, peer = self.engine_id, UNKNOWN_PEER
        producer, consumer = (own, peer) if self.producer else (peer, own)
        return {"producer_engine": producer, "consumer_engine": consumer}


def handoff_s(
    transfers: VllmTransferExporter | None, request: DecodeRequest, arrived: float
) -> float | None:
    """A decode's handoff: from its Decode call's arrival (``time.time()``) to its KV in place
    (push: the producer's WRITE notification seen; pull: the READ done), as the engine core
    stamped it; ``None`` without a KV handle or when nothing was received (a full prefix-cache
    hit)."""
    if request.kv_handle is None or transfers is None:
        return None
    in_place = transfers.take_in_place(request.request_id)
    return None if in_place is None else max(in_place - arrived, 0.0)


def _floats(values: Sequence[Any] | None) -> list[float]:
    return [float(value) for value in values or ()]
