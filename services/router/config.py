"""Settings of ``pdserve router`` (environment ``PDSERVE_ROUTER_...``, flags on top)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.config import ControlPlaneSettings
from services.serving.tls import ClientTLS

PolicyName = Literal["round_robin", "least_loaded", "prefix_aware"]
GrpcClientName = Literal["h2", "grpcio"]


class EngineGrpcSettings(BaseModel):
    """How the router dials engines (``PDSERVE_ROUTER_ENGINE_GRPC__...``).

    The targets themselves only ever come from READY records in the control plane; these
    settings say how to secure the channel. With ``tls`` the router refuses plaintext engines
    (the handshake fails and the request is answered 502/503, never sent in the clear).
    """

    client: GrpcClientName = "h2"
    """The gRPC client of the router's calls to engines: ``h2`` (pdserve's own, HTTP/2 frames
    handled on the event loop: about half grpc.aio's CPU per call, docs/h2grpc.md) or
    ``grpcio`` (grpc.aio). Both speak the same gRPC to the same engines."""
    tls: bool = False
    """Dial engines over TLS (``ca_file``, else the system roots, checks their certificate)."""
    tls_ca_file: Path | None = None
    """CA bundle (PEM) that signs the engines' certificates."""
    tls_cert_file: Path | None = None
    """Client certificate (PEM) presented to engines that require mutual TLS."""
    tls_key_file: Path | None = None
    """The client certificate's private key (PEM)."""
    tls_server_name: str | None = None
    """Name checked against every engine's certificate instead of the dialled host (engines
    are usually registered by IP)."""

    @model_validator(mode="after")
    def _check(self) -> EngineGrpcSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("engine_grpc tls_cert_file and tls_key_file go together")
        configured = (self.tls_ca_file, self.tls_cert_file, self.tls_server_name)
        if not self.tls and any(value is not None for value in configured):
            raise ValueError("engine_grpc TLS files or server name are set but tls is false")
        return self

    def client_tls(self) -> ClientTLS | None:
        """The channel credentials' material, or ``None`` for plaintext."""
        if not self.tls:
            return None
        return ClientTLS(
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            server_name=self.tls_server_name,
        )


class ServedModelSettings(BaseModel):
    """One more base model the router serves (``PDSERVE_ROUTER_MODELS``, ``pdserve router
    --model``): its engines register it under ``served_model_name`` and it gets a front end
    of its own (tokenizer, chat template, context: vLLM's state for that model)."""

    tokenizer: Path
    """The model's checkpoint folder, which its front end reads (as ``tokenizer``)."""
    served_model_name: str | None = None
    """The name its engines register (``EngineRecord.model``); ``None``: the folder's name."""
    frontend_args: list[str] = Field(default_factory=list)
    """vLLM server flags of this model's front end, after the router's ``frontend_args``."""

    @property
    def name(self) -> str:
        return self.served_model_name or self.tokenizer.resolve().name


class RouterSettings(BaseSettings):
    """Everything the router reads. ``control_plane`` comes from the shared tool settings
    (``PDSERVE_CONTROL_PLANE__...`` and ``--redis``), the rest from ``PDSERVE_ROUTER_...``;
    API keys as a JSON list: ``PDSERVE_ROUTER_API_KEYS='["key-1", "key-2"]'``."""

    model_config = SettingsConfigDict(
        env_prefix="PDSERVE_ROUTER_",
        env_nested_delimiter="__",
        hide_input_in_errors=True,  # errors would otherwise echo API keys given as a bad type
    )

    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = Field(default=8000, ge=0, le=65535)
    """HTTP port; 0 picks a free one (printed in the ``PDSERVE_READY`` line)."""
    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings)
    """Where the engines are registered."""
    engine_grpc: EngineGrpcSettings = Field(default_factory=EngineGrpcSettings)
    """TLS (optionally mutual) of the router's gRPC channels to engines."""
    api_keys: list[SecretStr] = Field(default_factory=list)
    """Accepted Bearer keys; empty = no authentication. Compared in constant time, never
    logged."""
    tokenizer: Path | None = None
    """The checkpoint folder the front end (vLLM's OpenAI serving code) reads: the tokenizer,
    chat template, vocabulary and context of the model the engines serve (for the engines that
    load no model, the synthetic checkpoint ``pdserve up`` writes); needed to serve
    (``create_app`` refuses ``None``)."""
    frontend_args: list[str] = Field(default_factory=list)
    """vLLM server flags for the front end (``--chat-template``,
    ``--tool-call-parser``, ``--enable-auto-tool-choice``, ``--reasoning-parser``,
    ``--max-model-len``...), as ``vllm serve`` takes them."""
    served_model_name: str | None = None
    """The model's name (the one its engines register); ``None``:
    the ``tokenizer`` folder's name, the engines' default."""
    models: list[ServedModelSettings] = Field(default_factory=list)
    """The base models served (after ``tokenizer``'s, when it is set), each with its own front
    end and its own engines' pools (``PDSERVE_ROUTER_MODELS='[{"tokenizer": "/models/a"},
    {"tokenizer": "/models/b"}]'``); a request goes to the model its ``model`` field names,
    one that names none to the first (docs/router.md, Several base models)."""
    policy: PolicyName = "prefix_aware"
    """How engines are chosen: ``round_robin``; ``least_loaded`` (the router's in-flight
    reservations plus each engine's reported queue); ``prefix_aware`` (least-loaded decode,
    prefill by longest cached prompt prefix unless that engine is overloaded; with engines that
    publish KV events, both pools by their real caches balanced with load, see
    ``prefill_cache_weight``)."""
    colocated: bool = False
    """Serve without disaggregation: every request runs on one decode (or ``both``) engine,
    which prefills it itself; prefill engines are not used. For comparison runs
    (``pdserve up --colocated``); then a READY decode engine is enough for ``/health``."""
    local_max_prompt_tokens: int = Field(default=0, ge=0)
    """Prompts of at most this many tokens run entirely on the decode engine (no KV transfer);
    0 disaggregates every prompt."""
    local_cached_fraction: float = Field(default=0.9, gt=0)
    """Prompts of which the chosen decode engine holds at least this fraction of full blocks
    run there alone, no prefill engine and no KV transfer (conditional disaggregation): by its
    KV events when it publishes them, else by what this router already sent it; above 1
    disables the rule."""
    max_prefill_attempts: int = Field(default=3, ge=1)
    """Prefill attempts per request, each on a different engine."""
    local_fallback: bool = True
    """When no prefill engine is READY or every attempt failed, run the request on the decode
    engine (counted in ``pdserve_router_fallbacks_total``) instead of failing it."""
    prefill_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one Prefill call."""
    decode_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one whole Decode stream."""
    decode_idle_timeout_s: float = Field(default=60.0, gt=0)
    """The longest the router waits for the next delta of a Decode stream, the first one
    included (which may queue behind other requests on a busy engine, hence a generous
    default). A decode engine that stalls without dying (a stopped rank while its host keeps
    heartbeating) ends its streams with ``engine_timeout`` after this, not after
    ``decode_timeout_s``; the request is aborted on the engine and the timeout counted in
    ``pdserve_router_engine_timeouts_total{call="decode", bound="idle"}``."""
    default_max_tokens: int = Field(default=256, ge=1)
    """``max_tokens`` of a chat request that sets none (completions default to 16, as
    OpenAI's)."""
    prefix_cache_blocks: int = Field(default=65536, ge=1)
    """Block hashes remembered per engine by the prefix-aware policy (LRU)."""
    prefix_load_slack: int = Field(default=4, ge=0)
    """``prefix_aware`` prefers the best-cached prefill engine only while its load is within
    this many requests of the least-loaded one (no herding on a hot prefix)."""
    kv_events: bool = True
    """Follow the KV-cache events of every READY engine whose record names an event endpoint
    (``services.kv_events``): ``prefix_aware`` then places by what those engines really hold
    (docs/router.md, "Placement"); engines that publish none keep the approximation."""
    kv_events_replay_timeout_s: float = Field(default=2.0, gt=0)
    """How long a replay from an engine's replay endpoint may go without a message (the
    request's answer, then each next batch) before the events it should have returned count as
    lost (the engine is then stale, its entries dropped)."""
    kv_events_heartbeat_s: float = Field(default=5.0, gt=0)
    """ZMTP heartbeat interval on each event subscription; a publisher silent for three
    intervals is disconnected, and its engine stale until it reconnects and replays."""
    kv_events_silence_s: float | None = Field(default=None, gt=0)
    """How long the KV-event batch an engine's load record names as its last
    (``EngineLoad.kv_events_seq``) may go unreceived before the engine is stale as ``silent``
    (a publisher that stopped sending while its connection lives; entries kept, fresh again
    once the batch arrives). Unset: three control-plane heartbeat intervals."""
    kv_index_blocks_per_engine: int = Field(default=262_144, ge=1)
    """Blocks the KV-event index keeps per engine (its oldest forgotten past it, counted in
    ``pdserve_router_kv_index_evictions_total``); about 230 bytes each (measured)."""
    kv_index_blocks_total: int = Field(default=2_097_152, ge=1)
    """Blocks the KV-event index keeps over every engine together (the largest engine's oldest
    forgotten past it)."""
    prefill_cache_weight: float = Field(default=4.0, ge=0)
    """With KV events: a prefill engine's score is this times the share of the prompt's full
    blocks it holds, minus its load (in-flight + queued requests); the highest wins. So a
    fully cached prompt is worth this many queued requests; 0 places by load only."""
    decode_cache_weight: float = Field(default=1.0, ge=0)
    """The same for the decode engine, whose cached blocks are only not moved over NIXL: at 1
    a prompt it holds wins among engines of equal load, never over one with a request less
    in flight (at 4, conversations and shared system prompts gathered on one decode engine of
    four: docs/benchmarks.md, 2026-11-28). Local placement, which computes the prompt there,
    takes ``prefill_cache_weight``."""
    workers: int = Field(default=1, ge=1, le=64)
    """Router processes serving ``port`` together (``SO_REUSEPORT``: the kernel spreads
    connections over them). Each follows the control plane and reserves engines on its own,
    like separate router replicas (see ``services/router/workers.py``)."""
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    """With ``workers`` > 1: worker ``i`` also serves its own ``/metrics`` on this port + ``i``
    (0: free ports), listed in the ``PDSERVE_READY`` line as ``metrics_urls``; the shared
    port's ``/metrics`` answers only the worker that took the connection."""
    reuse_port: bool = False
    """Bind ``port`` with ``SO_REUSEPORT`` (set for each worker by the supervisor)."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Also serve ``/metrics`` on this port (0: a free one); ``None``: only on ``port``."""
    max_migrations: int = Field(default=2, ge=0)
    """How many times one request may move to another engine pair after its decode engine
    failed or stalled (prompt plus the tokens so far re-prefilled, the stream goes on); 0
    ends such a request with the error instead. Counted in
    ``pdserve_router_migrations_total``."""
    circuit_backoff_s: float = Field(default=5.0, gt=0)
    """How long an engine whose call failed through its own fault is left out of the
    router's choices before one probe request may try it (``services.router.scheduling.health``)."""
    circuit_max_backoff_s: float = Field(default=60.0, gt=0)
    """The back-off doubles after each failed probe, up to this."""
    control_plane_holdover_s: float | None = Field(default=None, gt=0)
    """After a control-plane outage, how long an engine the router had READY stays chosen
    (while its calls succeed) although Redis, back, does not list it READY yet (Redis restarted
    empty: every engine registers again at a new generation, which then replaces it). Unset:
    three lease TTLs. See ``services.router.scheduling.pool``."""
    http_keep_alive_s: float = Field(default=75.0, gt=0)
    """How long an idle HTTP/1.1 keep-alive connection stays open. Longer than the idle expiry
    of the clients that pool connections (httpx and so the ``openai`` SDK: 5 s; aiohttp: 15 s)
    and of load balancers (60 s is common), so the client retires an idle connection first: a
    server that closes one as the client reuses it (uvicorn's default, 5 s, equal to httpx's)
    makes that request fail with no response ("Server disconnected"), a request lost on a
    loaded router."""
    max_request_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    """The largest generation request body read (4 MiB: a 128k-token context as text or as
    token ids, with room for its JSON; raise it for batched prompts of such contexts); a larger
    one is answered 413 before its JSON is parsed (``Content-Length``) or as soon as the bytes
    read pass it (chunked); counted in ``pdserve_router_requests_total`` with
    ``outcome="request_too_large"``."""
    log_level: str = "WARNING"
    """Python logging level."""

    @property
    def holdover_s(self) -> float:
        """``control_plane_holdover_s`` with its default resolved."""
        if self.control_plane_holdover_s is not None:
            return self.control_plane_holdover_s
        return 3 * self.control_plane.lease_ttl_s

    def served_models(self) -> list[ServedModelSettings]:
        """Every base model served: ``tokenizer``'s (when set) first, then ``models``; a router
        of one model is a list of one. ``ValueError`` when there is none."""
        served = list(self.models)
        if self.tokenizer is not None:
            first = ServedModelSettings(
                tokenizer=self.tokenizer, served_model_name=self.served_model_name
            )
            served.insert(0, first)
        if not served:
            raise ValueError(
                "the router needs tokenizer (or models): the checkpoint folder its front end reads"
            )
        return served

    @model_validator(mode="after")
    def _check(self) -> RouterSettings:
        names = [model.name for model in self.served_models()] if self.models else []
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise ValueError(f"two served models have the same name: {', '.join(doubled)}")
        if any(not key.get_secret_value() for key in self.api_keys):
            raise ValueError("api_keys must not contain an empty key")
        if self.worker_metrics_port and self.worker_metrics_port + self.workers - 1 > 65535:
            raise ValueError("worker_metrics_port + workers - 1 must be a port (<= 65535)")
        return self
