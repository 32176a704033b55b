"""Redis AUTH and TLS as the control plane's client uses them.

AUTH: a real ``redis-server --requirepass``; a wrong password is an ``auth`` failure, not
retried, and the password appears in no message and no log record (the right one works).
TLS: a real TLS handshake against :class:`~tests.security.tls_proxy.RedisTLSProxy` (the
installable redis-server has no TLS; see that module), with server verification by CA, mutual
TLS, and clear failures for an untrusted server or a plaintext client.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlaneMetrics, ControlPlaneUnavailable, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.synthetic import synthetic_spec
from tests.conftest import counter_value
from tests.security.tls_proxy import RedisTLSProxy

pytestmark = pytest.mark.integration

PASSWORD = "redis-pw-7c1d9e"  # a test secret that must never be printed
WRONG = "guess-4f0a2b"


def _settings(url: str, namespace: str, **redis: object) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        redis=RedisSettings.model_validate(
            {"url": url, "retry_attempts": 2, "retry_backoff_s": 0.01, **redis}
        ),
        namespace=namespace,
    )


async def test_wrong_redis_password_fails_once_clearly_and_is_never_logged(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with LocalRedisServer(password=PASSWORD) as server:
        metrics = ControlPlaneMetrics()
        cp = RedisControlPlane(_settings(server.url, namespace, password=WRONG), metrics)
        try:
            with pytest.raises(ControlPlaneUnavailable) as caught:
                await cp.list_engines()
        finally:
            await cp.close()
        assert caught.value.reason == "auth"
        assert "refused the credentials" in str(caught.value)
        assert (
            counter_value(
                metrics, "pdserve_control_plane_redis_retries_total", operation="list_engines"
            )
            == 0
        )
        assert (
            counter_value(
                metrics, "pdserve_control_plane_redis_errors_total", operation="list_engines"
            )
            == 1
        )
        good = RedisControlPlane(_settings(server.url, namespace, password=PASSWORD), metrics)
        try:
            await good.register(synthetic_spec("authed"))
            assert [v.engine_id for v in await good.list_engines()] == ["authed"]
            # Settings print masked, whatever the caller does with them.
            assert PASSWORD not in repr(good.connection.settings)
            assert PASSWORD not in str(good.connection.settings.model_dump())
        finally:
            await good.close()
    for secret in (PASSWORD, WRONG):
        assert secret not in str(caught.value)
        assert secret not in repr(caught.value.__cause__)
        assert secret not in caplog.text


async def test_control_plane_over_tls_verifies_the_server_and_supports_mutual_tls(
    redis_server: LocalRedisServer, namespace: str, pki: Path, other_pki: Path
) -> None:
    async with RedisTLSProxy(
        redis_server.port, pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem"
    ) as proxy:
        mutual = _settings(
            proxy.url,
            namespace,
            tls_ca_file=pki / "ca.pem",
            tls_cert_file=pki / "client.pem",
            tls_key_file=pki / "client.key",
        )
        cp = RedisControlPlane(mutual, ControlPlaneMetrics())
        try:
            engine = await cp.register(synthetic_spec("over-tls"))
            views = await cp.list_engines()
            assert [(v.engine_id, v.generation) for v in views] == [("over-tls", engine.generation)]
        finally:
            await cp.close()
        assert proxy.handshakes >= 1

        # A server certificate from a CA the client does not trust: refused, clearly.
        untrusted = _settings(
            proxy.url,
            namespace,
            tls_ca_file=other_pki / "ca.pem",
            tls_cert_file=pki / "client.pem",
            tls_key_file=pki / "client.key",
        )
        cp = RedisControlPlane(untrusted, ControlPlaneMetrics())
        try:
            with pytest.raises(ControlPlaneUnavailable, match=r"(?i)certificate verify failed"):
                await cp.list_engines()
        finally:
            await cp.close()

        # No client certificate while the server requires one: refused by the server.
        anonymous = _settings(proxy.url, namespace, tls_ca_file=pki / "ca.pem")
        before = proxy.handshakes
        cp = RedisControlPlane(anonymous, ControlPlaneMetrics())
        try:
            with pytest.raises(ControlPlaneUnavailable, match="Redis unreachable"):
                await cp.list_engines()
        finally:
            await cp.close()
        assert proxy.handshakes == before

        # Plaintext to the TLS port: an error, not a hang and not a silent downgrade.
        plaintext = _settings(f"redis://127.0.0.1:{proxy.port}/0", namespace)
        cp = RedisControlPlane(plaintext, ControlPlaneMetrics())
        try:
            with pytest.raises(ControlPlaneUnavailable, match="Redis unreachable"):
                await cp.list_engines()
        finally:
            await cp.close()
        assert proxy.handshakes == before
