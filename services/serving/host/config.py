"""Settings of ``pdserve prefill`` and ``pdserve decode``: environment (``PDSERVE_...``) first,
flags on top (see :mod:`services.cli.engine`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.config import ControlPlaneSettings
from services.engines.producer_check import STALE_FACTOR
from services.serving.tls import ServerTLS
from services.serving.wire.convert import DEFAULT_MAX_MESSAGE_BYTES


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) to its parts; ``ValueError`` naming it otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class GrpcServerSettings(BaseModel):
    """Where and how the engine serves gRPC."""

    listen: str = "0.0.0.0:50051"
    """``HOST:PORT`` to bind; port 0 picks a free one (announced in the ready line)."""
    advertise: str | None = None
    """The endpoint registered in the control plane (what routers dial); the bound address by
    default, with this host's name for a wildcard host."""
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024)
    """Bound of one message either way; larger ones are refused by gRPC."""
    tls_cert_file: Path | None = None
    """Server certificate (PEM): serve TLS when set, with ``tls_key_file``."""
    tls_key_file: Path | None = None
    """Server private key (PEM)."""
    tls_client_ca_file: Path | None = None
    """CA that signs client certificates: require mutual TLS when set."""

    @model_validator(mode="after")
    def _check(self) -> GrpcServerSettings:
        split_host_port(self.listen)
        if self.advertise is not None:
            split_host_port(self.advertise)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("grpc tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("grpc tls_client_ca_file (mutual TLS) needs tls_cert_file")
        return self

    def tls(self) -> ServerTLS | None:
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return ServerTLS(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


class EngineServiceSettings(BaseSettings):
    """What an engine service reads from the environment, e.g. ``PDSERVE_GRPC__LISTEN``,
    ``PDSERVE_CONTROL_PLANE__REDIS__URL``, ``PDSERVE_DRAIN_TIMEOUT_S``."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", env_nested_delimiter="__")

    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings)
    """Redis and lease settings (shared with the other tools)."""
    grpc: GrpcServerSettings = Field(default_factory=GrpcServerSettings)
    """The gRPC server."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus ``/metrics`` on this port (0 picks one); off when unset."""
    metrics_host: str = "0.0.0.0"
    """Address the metrics server binds."""
    ready_timeout_s: float = Field(default=300.0, gt=0)
    """The engine must be READY in the control plane this long after registering (model
    loading included), else the service exits non-zero."""
    drain_timeout_s: float = Field(default=60.0, gt=0)
    """On SIGTERM, in-flight requests (and a prefill engine's held KV) get this long."""
    log_level: str = "WARNING"
    """Python logging level."""
    producer_view_max_stale_s: float | None = Field(default=None, ge=0)
    """A decode engine checks each KV handle's producer in the control plane; while the
    control plane is unreachable it answers from the producer's view read at most this long
    before the outage began, for as long as it lasts (counted in
    ``pdserve_engine_producer_check_fallbacks_total``) instead of refusing the request.
    Unset: 3 x ``control_plane.lease_ttl_s``; 0 turns the fallback off
    (``PDSERVE_PRODUCER_VIEW_MAX_STALE_S``; see ``ProducerViews``)."""
    producer_view_retry_after_s: float = Field(default=1.0, ge=0)
    """After a failed read of a producer's view, checks within this many seconds answer from
    memory without asking the control plane (each would wait out the client's retries); the
    first check after that asks again (``PDSERVE_PRODUCER_VIEW_RETRY_AFTER_S``)."""

    @property
    def producer_view_max_stale(self) -> float:
        """``producer_view_max_stale_s`` with its default resolved."""
        if self.producer_view_max_stale_s is not None:
            return self.producer_view_max_stale_s
        return STALE_FACTOR * self.control_plane.lease_ttl_s
