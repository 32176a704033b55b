"""Prometheus metrics of the router (docs/metrics.md, "Router", is the contract).

Created per instance with an injectable ``CollectorRegistry``: tests pass a fresh one. The
families are declared here, on :class:`services.metrics.Metrics` as every component's are
(its own kinds through ``collector``); the kinds of metric the request path and the scrape read
(:class:`~services.router.metrics.kinds.LoopHistogram` and the rest) are
:mod:`services.router.metrics.kinds`'.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from services.metrics import LATENCY_BUCKETS_S, Metrics
from services.router.metrics.kinds import Children, CircuitGauge, InflightGauge, LoopHistogram

HOLDOVER_OUTCOMES = ("held", "confirmed", "replaced", "failed", "expired")
"""Every ``outcome`` of ``pdserve_router_engine_holdovers_total``."""

_LATENCY_BUCKETS = (*LATENCY_BUCKETS_S, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


FALLBACK_REASONS = (
    "no_prefill_engine",
    "prefill_circuit_open",
    "prefill_failed",
    "kv_handoff_failed",
)
"""Every ``reason`` of ``pdserve_router_fallbacks_total``."""


_CACHED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_KV_BYTE_BUCKETS = (0, *(float(4**n * 1024) for n in range(3, 14)))
"""0, then 64 KiB to 64 GiB by fours (a block of a large model is megabytes)."""

TRACE_HEADERS = ("traceparent", "tracestate")
"""Every ``header`` of ``pdserve_router_trace_context_dropped_total``."""

IGNORED_FIELD_LABELS = 32
"""Distinct ``field`` labels of ``pdserve_router_ignored_fields_total`` (clients name fields:
the series stay bounded)."""


class RouterMetrics(Metrics):
    """``pdserve_router_*``; see docs/metrics.md for names and labels."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.requests = self.counter(
            "pdserve_router_requests_total",
            "Requests answered, by endpoint and outcome (ok or the error code).",
            ["endpoint", "outcome"],
        )
        self.execution_path = self.counter(
            "pdserve_router_execution_path_total",
            "Requests by how they ran: disaggregated (prefill then decode engine), local "
            "(the decode engine prefilled itself), retried (disaggregated after a failed "
            "prefill attempt) or forked (one prefill and one KV transfer for every choice of "
            "the prompt, forked on the decode engine); a request with n > 1 counts each choice.",
            ["path"],
        )
        self.choices = self.counter(
            "pdserve_router_choices_total",
            "Prompts with several choices (n > 1), by how their choices ran: forked (one "
            "prefill and one KV transfer, forked on the decode engine) or per_choice (a "
            "request per choice: an engine that cannot fork, or local execution).",
            ["path"],
        )
        self.fallbacks = self.counter(
            "pdserve_router_fallbacks_total",
            "Requests that ran differently from the plan, by reason (no_prefill_engine, "
            "prefill_circuit_open, prefill_failed, kv_handoff_failed: the decode engine could "
            "not get the KV of any prefill engine left).",
            ["reason"],
        )
        # Exported at 0 from the start: the first fallback is then an increase that rate(),
        # increase() and the PdserveRouterFallbacks alert see (a series born at 1 is not).
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        self.ignored_fields = self.counter(
            "pdserve_router_ignored_fields_total",
            "Request fields the router ignored because vLLM's server does not know them "
            f"either, by field (the first {IGNORED_FIELD_LABELS} names seen; later ones as "
            "other).",
            ["field"],
        )
        self._ignored_names: set[str] = set()
        self.trace_context_dropped = self.counter(
            "pdserve_router_trace_context_dropped_total",
            "W3C trace context headers of requests that were not valid and were not sent on "
            "to the engines, by header (traceparent: the request went on without a trace "
            "context; tracestate: without its tracestate).",
            ["header"],
        )
        for header in TRACE_HEADERS:
            self.trace_context_dropped.labels(header=header)
        self.prefill_retries = self.counter(
            "pdserve_router_prefill_retries_total",
            "Prefill attempts that failed and were retried on another engine, by phase "
            "(connect, prefill: the Prefill call; kv_wait: the producer was gone before the "
            "decode engine pulled; kv_pull: the pull itself failed) and reason (the error code).",
            ["phase", "reason"],
        )
        self.engine_timeouts = self.counter(
            "pdserve_router_engine_timeouts_total",
            "Engine calls the router stopped waiting for, by call (prefill, decode) and bound: "
            "deadline (the whole call outlived prefill_timeout_s or decode_timeout_s) or idle "
            "(no decode delta within decode_idle_timeout_s).",
            ["call", "bound"],
        )
        self.aborts = self.counter(
            "pdserve_router_aborts_total",
            "Abort calls the router sent for a timed-out or orphaned request, by engine role "
            "and outcome: found, unknown (the engine no longer had it) or failed (the engine "
            "did not answer; its own cancellation or KV lease cleans up).",
            ["role", "outcome"],
        )
        self.ttft = self._loop_histogram(
            "pdserve_router_ttft_seconds",
            "Request arrival to its first token, by execution path (each choice of a request "
            "with n > 1).",
            ["path"],
            buckets=_LATENCY_BUCKETS,
        )
        self.ttft_phase = self._loop_histogram(
            "pdserve_router_ttft_phase_seconds",
            "Parts of a disaggregated request's first tokens: prefill (the Prefill call), "
            "handoff (KV transfer reported by the decode engine), first_decode_token (the "
            "rest of the wait for the decode engine's first token; streamed requests only). "
            "A prompt with n > 1 forked from one prefill observes prefill and handoff once "
            "and first_decode_token once per choice.",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = self._loop_histogram(
            "pdserve_router_itl_seconds",
            "Time between two token deltas of one streamed request (a non-streamed one's "
            "decode answers in one message: no gaps); with n > 1, each choice's own gaps.",
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = self._loop_histogram(
            "pdserve_router_e2e_latency_seconds",
            "Request arrival to its last byte, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_time = self._loop_histogram(
            "pdserve_router_queue_time_seconds",
            "Request arrival to its first engine call (parsing, tokenizing, scheduling).",
            buckets=_LATENCY_BUCKETS,
        )
        self.overhead = self._loop_histogram(
            "pdserve_router_overhead_seconds",
            "Router time of a request excluding the time spent waiting on engine calls.",
            buckets=_OVERHEAD_BUCKETS,
        )
        # Per request, so ``_sum`` over ``_count`` is an interval's mean length (the planner's
        # input and output lengths) and ``_sum`` alone the token rate.
        self.prompt_tokens = self._loop_histogram(
            "pdserve_router_request_prompt_tokens",
            "Prompt tokens of each request that reached an engine (every prompt of a batch, "
            "once per prompt).",
            buckets=_TOKEN_BUCKETS,
        )
        self.generation_tokens = self._loop_histogram(
            "pdserve_router_request_generation_tokens",
            "Tokens generated for each request that reached an engine (every choice; a "
            "request that failed mid-stream counts what it had generated).",
            buckets=_TOKEN_BUCKETS,
        )
        # Per served base model: the ``model`` label is a name the router serves (its front
        # ends), never a request's text; a name no model serves is answered (404) by the
        # first model's front end and counted under it.
        self.model_requests = self.counter(
            "pdserve_router_model_requests_total",
            "Generation requests answered, by served base model and outcome (as "
            "pdserve_router_requests_total).",
            ["model", "outcome"],
        )
        self.model_prompt_tokens = self.counter(
            "pdserve_router_model_prompt_tokens_total",
            "Prompt tokens of the requests that reached an engine, by served base model.",
            ["model"],
        )
        self.model_generation_tokens = self.counter(
            "pdserve_router_model_generation_tokens_total",
            "Tokens generated, by served base model.",
            ["model"],
        )
        self.model_e2e = self._loop_histogram(
            "pdserve_router_model_e2e_latency_seconds",
            "Generation request arrival to its last byte, by served base model.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
        )
        self.engine_inflight = self.collector(InflightGauge())
        self.engine_load = self.gauge(
            "pdserve_router_engine_load",
            "Load each engine last reported through the control plane.",
            ["engine", "role", "kind"],
        )
        self.ready_engines = self.gauge(
            "pdserve_router_ready_engines",
            "READY engines the router can use, by role.",
            ["role"],
        )
        self.migrations = self.counter(
            "pdserve_router_migrations_total",
            "Requests whose decode continued on another engine pair after tokens had gone "
            "out (prompt plus the tokens so far re-prefilled), by reason (the decode error "
            "code).",
            ["reason"],
        )
        self.circuit_trips = self.counter(
            "pdserve_router_circuit_trips_total",
            "Circuit breakers opened: an engine's call failed through the engine's fault and "
            "the router stopped choosing it, by engine and role.",
            ["engine", "role"],
        )
        self.circuit_state = self.collector(CircuitGauge())
        self.control_plane_unreachable = self.gauge(
            "pdserve_router_control_plane_unreachable_seconds",
            "Seconds since this router last followed the control plane (0 while it does): how "
            "stale its view of the engines may be; it serves from that view meanwhile.",
        )
        self.holdovers = self.counter(
            "pdserve_router_engine_holdovers_total",
            "Engines kept after a control-plane outage although Redis, back, no longer listed "
            "them READY (held), and how each hold ended: confirmed (Redis listed the same "
            "generation READY again), replaced (its new generation READY), failed (a call "
            "failed), expired (not READY again within the holdover).",
            ["outcome"],
        )
        for outcome in HOLDOVER_OUTCOMES:
            self.holdovers.labels(outcome=outcome)
        self.engine_grpc_client = self.gauge(
            "pdserve_router_engine_grpc_client",
            "The gRPC client of the router's engine calls: 1 for the one in use (h2: "
            "pdserve's own; grpcio: grpc.aio).",
            ["client"],
        )
        self.engine_protocol_errors = self.counter(
            "pdserve_router_engine_protocol_errors_total",
            "Breaches of HTTP/2 or gRPC's framing by engines, met by the router's h2 gRPC "
            "client, by kind (each closed the connection or failed its call).",
            ["error"],
        )
        self.engine_call_retries = self.counter(
            "pdserve_router_engine_call_retries_total",
            "Engine calls the router's h2 gRPC client sent a second time, on a fresh "
            "connection, because the engine never processed the first (reason: "
            "refused_stream, goaway).",
            ["reason"],
        )
        self.placement_decisions = self.counter(
            "pdserve_router_placement_decisions_total",
            "Engine choices, by pool (prefill, decode, local) and reason: what decided it "
            "(docs/router.md, Placement).",
            ["pool", "reason"],
        )
        self.lora_loads = self.counter(
            "pdserve_router_lora_loads_total",
            "LoRA adapter loads onto engines, by pool (prefill, decode, local; api: "
            "/v1/load_lora_adapter or --lora-modules, one per engine) and outcome (ok, "
            "failed); a request placed on an engine that does not hold its adapter counts "
            "one (the engine loads it first: docs/router.md, LoRA adapters).",
            ["pool", "outcome"],
        )
        self.lora_evictions = self.counter(
            "pdserve_router_lora_evictions_total",
            "LoRA adapters an engine stopped holding without an unload through the router "
            "(its LRU made room for another), by engine role.",
            ["role"],
        )
        self.cached_tokens = self._loop_histogram(
            "pdserve_router_cached_tokens",
            "Prompt tokens the chosen engine holds per request, by pool, as the router's "
            "cache view (KV events or its own routing history) says at placement.",
            ["pool"],
            buckets=_CACHED_TOKEN_BUCKETS,
        )
        self.kv_blocks_moved = self._loop_histogram(
            "pdserve_router_kv_blocks_moved",
            "Prompt blocks a disaggregated request's decode engine lacks at placement (the "
            "blocks its KV transfer moves; times the engine's block bytes for bytes).",
            buckets=_BLOCK_BUCKETS,
        )
        self.kv_bytes_moved = self._loop_histogram(
            "pdserve_router_kv_bytes_moved",
            "KV bytes a disaggregated request's transfer moves, as placed: the blocks its "
            "decode engine lacks times the engine's block bytes (engines that publish them).",
            buckets=_KV_BYTE_BUCKETS,
        )
        self.kv_events_received = self.counter(
            "pdserve_router_kv_events_received_total",
            "KV-event batches applied to the router's index (every engine together).",
        )
        self.kv_events_dropped = self.counter(
            "pdserve_router_kv_events_dropped_total",
            "KV-event messages or events not applied, by reason.",
            ["reason"],
        )
        self.kv_parents_adopted = self.counter(
            "pdserve_router_kv_parents_adopted_total",
            "Stored blocks whose parent the KV-event index had never seen (cached before this "
            "router subscribed), found in a prompt this router sent the engine.",
        )
        self.kv_events_stale = self.counter(
            "pdserve_router_kv_events_stale_total",
            "Engines whose KV-event stream became incomplete (placed by load only until it "
            "resumes), by reason.",
            ["reason"],
        )
        self.kv_events_stale_engines = self.gauge(
            "pdserve_router_kv_events_stale_engines",
            "Engines publishing KV events whose stream is incomplete now.",
        )
        self.kv_index_blocks = self.gauge(
            "pdserve_router_kv_index_blocks",
            "Blocks in the router's KV-event index, every engine together.",
        )
        self.kv_index_evictions = self.counter(
            "pdserve_router_kv_index_evictions_total",
            "Index entries forgotten to stay within a bound (engine: max_blocks_per_engine; "
            "total: max_blocks_total).",
            ["bound"],
        )
        # The request path's children (see Children).
        self.requests_by = Children(self.requests)
        self.execution_path_by = Children(self.execution_path)
        self.ttft_by = self.ttft.labels
        self.ttft_phase_by = self.ttft_phase.labels
        self.e2e_by = self.e2e.labels
        self.placement_by = Children(self.placement_decisions)
        self.cached_tokens_by = self.cached_tokens.labels

    def engine_protocol_error(self, error: str) -> None:
        """Count one breach (the h2 client's ``on_protocol_error``; ``error`` is one of
        :class:`services.serving.h2grpc.errors.Violation`'s few labels)."""
        self.engine_protocol_errors.labels(error=error).inc()

    def engine_call_retry(self, reason: str) -> None:
        """Count one call sent again (the h2 client's ``on_retry``)."""
        self.engine_call_retries.labels(reason=reason).inc()

    def trace_dropped(self, header: str) -> None:
        """Count one request's invalid trace context header (``traceparent`` or
        ``tracestate``), which was not forwarded."""
        self.trace_context_dropped.labels(header=header).inc()

    def ignored(self, names: list[str]) -> list[str]:
        """Count ignored request fields; the names never ignored before (to log once)."""
        new = []
        for name in names:
            label = name if name in self._ignored_names else "other"
            if name not in self._ignored_names and len(self._ignored_names) < IGNORED_FIELD_LABELS:
                self._ignored_names.add(name)
                label = name
                new.append(name)
            self.ignored_fields.labels(field=label).inc()
        return new

    def observe_model(
        self, model: str, outcome: str, elapsed_s: float, tokens: tuple[int, int] | None
    ) -> None:
        """One generation request of served base model ``model``: its outcome, latency and
        (when it reached an engine) its prompt and generated tokens."""
        self.model_requests.labels(model=model, outcome=outcome).inc()
        self.model_e2e.labels(model).observe(elapsed_s)
        if tokens is not None:
            self.model_prompt_tokens.labels(model=model).inc(tokens[0])
            self.model_generation_tokens.labels(model=model).inc(tokens[1])

    def _loop_histogram(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> LoopHistogram:
        """A histogram the request path observes (see :class:`LoopHistogram`), declared as
        :meth:`~services.metrics.Metrics.histogram` declares ``prometheus_client``'s."""
        return self.collector(LoopHistogram(name, documentation, buckets, labels))
