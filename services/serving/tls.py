"""TLS material of engine services (server side) and of their callers (client side).

Files are read when a server or channel is built, so a missing file fails at start-up with its
path in the message, not on the first request.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.serving.h2grpc import client_ssl_context


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTLS:
    """Server certificate and key; with ``client_ca_file`` clients must present a certificate
    signed by it (mutual TLS)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        root = _read(self.client_ca_file, "client CA") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))],
            root_certificates=root,
            require_client_auth=root is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks engines (``ca_file``; system roots when ``None``) and, for mutual
    TLS, the certificate it presents. ``server_name`` overrides the name checked against the
    engine's certificate (engines are often dialled by IP)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTLS: cert_file and key_file go together")

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """The same material for the router's own gRPC client (ALPN ``h2``), read once."""
        if self.cert_file is not None and self.key_file is not None:
            _read(self.cert_file, "TLS certificate")  # a missing file named, as credentials()
            _read(self.key_file, "TLS key")
        return client_ssl_context(
            _read(self.ca_file, "CA") if self.ca_file else None,
            str(self.cert_file) if self.cert_file else None,
            str(self.key_file) if self.key_file else None,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA") if self.ca_file else None,
            private_key=_read(self.key_file, "TLS key") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "TLS certificate") if self.cert_file else None,
        )
