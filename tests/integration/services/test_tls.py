"""TLS and mutual TLS between GrpcAioEngineClient and an engine service (certificates made by
openssl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.requests import SamplingParams
from services.engines.stub import StubBackend
from services.serving.client.grpc_aio import GrpcAioEngineClient
from services.serving.errors import EngineUnreachable
from services.serving.host.config import GrpcServerSettings
from services.serving.tls import ClientTLS
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration


async def test_mutual_tls_admits_only_clients_with_a_certificate(
    cp_settings: ControlPlaneSettings, pki: Path
) -> None:
    grpc_settings = GrpcServerSettings(
        listen="127.0.0.1:0",
        tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key",
        tls_client_ca_file=pki / "ca.pem",
    )
    settings = service_settings(cp_settings, grpc=grpc_settings)
    async with hosted(
        settings, StubBackend(), engine_id="prefill-tls", role=EngineRole.PREFILL
    ) as pre:
        trusted = GrpcAioEngineClient(
            pre.endpoints.grpc,
            tls=ClientTLS(
                ca_file=pki / "ca.pem", cert_file=pki / "client.pem", key_file=pki / "client.key"
            ),
        )
        result = await trusted.prefill("tls-1", [1, 2], SamplingParams(max_tokens=2))
        assert result.kv_handle is not None
        assert await trusted.health()
        anonymous = GrpcAioEngineClient(pre.endpoints.grpc, tls=ClientTLS(ca_file=pki / "ca.pem"))
        with pytest.raises(EngineUnreachable):
            await anonymous.prefill("tls-2", [1, 2], SamplingParams(), timeout_s=5)
        plaintext = GrpcAioEngineClient(pre.endpoints.grpc)
        with pytest.raises(EngineUnreachable):
            await plaintext.prefill("tls-3", [1, 2], SamplingParams(), timeout_s=5)
        for client in (trusted, anonymous, plaintext):
            await client.close()


def test_tls_settings_must_come_in_pairs() -> None:
    with pytest.raises(ValueError, match="go together"):
        GrpcServerSettings(tls_cert_file=Path("x.pem"))
    with pytest.raises(ValueError, match="mutual TLS"):
        GrpcServerSettings(tls_client_ca_file=Path("ca.pem"))
    with pytest.raises(ValueError, match="go together"):
        ClientTLS(cert_file=Path("c.pem"))
