"""gRPC TLS between the router and engines, configured by settings (``engine_grpc``).

Real engine hosts (stub backend) serve mutual TLS with openssl-made certificates; a real router
(uvicorn, Redis control plane) dials them. A router with the CA and a client certificate serves
requests; a router without a client certificate, or without TLS, cannot reach the engines and
answers with an OpenAI error envelope instead of sending anything in the clear.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from services.router.config import EngineGrpcSettings, RouterSettings
from services.router.scheduling.connector import GrpcConnectorFactory
from services.serving.host.config import GrpcServerSettings
from services.serving.tls import ClientTLS
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

BODY = {"model": "stub", "prompt": [1, 2, 3, 4], "max_tokens": 3}


def _router_settings(
    cp: ControlPlaneSettings, engine_grpc: EngineGrpcSettings, checkpoint: Path
) -> RouterSettings:
    return RouterSettings(
        control_plane=cp,
        tokenizer=checkpoint,
        served_model_name="stub",
        engine_grpc=engine_grpc,
        prefill_timeout_s=5,
        decode_timeout_s=5,
        max_prefill_attempts=1,
    )


async def test_router_reaches_mutual_tls_engines_only_with_its_client_certificate(
    cp_settings: ControlPlaneSettings, pki: Path, stub_checkpoint: Path
) -> None:
    grpc_tls = GrpcServerSettings(
        listen="127.0.0.1:0",
        tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key",
        tls_client_ca_file=pki / "ca.pem",
    )
    engine_settings = service_settings(cp_settings, grpc=grpc_tls)
    trusted = EngineGrpcSettings(
        tls=True,
        tls_ca_file=pki / "ca.pem",
        tls_cert_file=pki / "client.pem",
        tls_key_file=pki / "client.key",
    )
    no_client_cert = EngineGrpcSettings(tls=True, tls_ca_file=pki / "ca.pem")
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-tls", role=EngineRole.PREFILL),
        hosted(engine_settings, StubBackend(), engine_id="decode-tls", role=EngineRole.DECODE),
    ):
        async with (
            serving_router(_router_settings(cp_settings, trusted, stub_checkpoint)) as url,
            httpx.AsyncClient(base_url=url, timeout=20) as client,
        ):
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert response.headers["x-pdserve-prefill-engine"] == "prefill-tls"
            assert response.headers["x-pdserve-decode-engine"] == "decode-tls"
            assert response.json()["usage"]["completion_tokens"] == 3

        for refused in (no_client_cert, EngineGrpcSettings()):
            async with (
                serving_router(_router_settings(cp_settings, refused, stub_checkpoint)) as url,
                httpx.AsyncClient(base_url=url, timeout=30) as client,
            ):
                response = await client.post("/v1/completions", json=BODY)
                assert response.status_code in (502, 503), response.text
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_engine_grpc_settings_are_checked_at_start_up(tmp_path: Path, pki: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        EngineGrpcSettings(tls=True, tls_cert_file=pki / "client.pem")
    with pytest.raises(ValueError, match="tls is false"):
        EngineGrpcSettings(tls_ca_file=pki / "ca.pem")
    assert EngineGrpcSettings().client_tls() is None
    missing = tmp_path / "missing-ca.pem"
    for client in ("h2", "grpcio"):
        with pytest.raises(ValueError, match=r"missing-ca\.pem"):
            GrpcConnectorFactory(ClientTLS(ca_file=missing), client=client)
    settings = RouterSettings.model_validate(
        {"engine_grpc": {"tls": True, "tls_ca_file": str(pki / "ca.pem")}}
    )
    tls = settings.engine_grpc.client_tls()
    assert tls is not None and tls.ca_file == pki / "ca.pem"
