"""The Redis connection: built from settings, with retries, backoff and error translation.

Every control-plane command goes through :meth:`RedisConnection.call`, which counts round trips,
retries transient failures (connection lost, timeout, Redis still loading) with exponential
backoff and translates what is left into :class:`ControlPlaneUnavailable`. Callers never see a
``redis`` exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from services.config import RedisSettings
from services.config.control_plane import SENTINEL_SCHEME
from services.control_plane.errors import ControlPlaneError, ControlPlaneUnavailable
from services.control_plane.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    ConnectionError,
    OSError,
)


@contextlib.contextmanager
def map_redis_errors(what: str) -> Iterator[None]:
    """Translate ``redis`` exceptions raised inside the block into control-plane errors."""
    try:
        yield
    except ControlPlaneError:
        raise
    except redis_errors.AuthenticationError as exc:
        raise ControlPlaneUnavailable(
            f"Redis refused the credentials while trying to {what}: {exc}", reason="auth"
        ) from exc
    except redis_errors.ResponseError as exc:
        raise ControlPlaneError(f"Redis rejected a command while trying to {what}: {exc}") from exc
    except _TRANSIENT as exc:
        raise ControlPlaneUnavailable(f"Redis unreachable while trying to {what}: {exc}") from exc
    except redis_errors.RedisError as exc:
        raise ControlPlaneError(f"Redis error while trying to {what}: {exc}") from exc


def create_redis(settings: RedisSettings, *, decode_responses: bool = False) -> aioredis.Redis:
    """A ``redis.asyncio`` client for ``settings`` (no connection is opened yet)."""
    kwargs: dict[str, object] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
        "decode_responses": decode_responses,
        "health_check_interval": 15,
    }
    if settings.username:
        kwargs["username"] = settings.username
    if settings.password is not None:
        kwargs["password"] = settings.password.get_secret_value()
    if settings.uses_tls and settings.url.startswith(("redis://", SENTINEL_SCHEME)):
        kwargs["ssl"] = True
    if settings.uses_tls:
        if settings.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = str(settings.tls_ca_file)
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            kwargs["ssl_certfile"] = str(settings.tls_cert_file)
            kwargs["ssl_keyfile"] = str(settings.tls_key_file)
    target = settings.sentinel
    if target is not None:
        # redis-py parses no Sentinel URL: the master's client is built from the target. Its
        # pool asks the sentinels for the master on every new connection, so after a
        # failover (a connection error, or READONLY from a demoted master) it reaches the
        # promoted replica through the ordinary retries.
        if target.username and "username" not in kwargs:
            kwargs["username"] = target.username
        if target.password and "password" not in kwargs:
            kwargs["password"] = target.password
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(target.sentinels),
            sentinel_kwargs={
                "socket_timeout": settings.socket_timeout_s,
                "socket_connect_timeout": settings.connect_timeout_s,
            },
            **kwargs,
        )
        master: aioredis.Redis = sentinel.master_for(target.service_name, db=target.db)
        return master
    client: aioredis.Redis = aioredis.Redis.from_url(settings.url, **kwargs)  # type: ignore[arg-type]
    return client


class RedisConnection:
    """One Redis client plus the retry policy and the round-trip counter."""

    def __init__(self, settings: RedisSettings, metrics: ControlPlaneMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.client = create_redis(settings)
        self.round_trips = 0
        """Commands, pipelines and scripts sent (retries included): for the benchmark."""

    async def call(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation`` (one round trip), retrying transient failures with backoff."""
        backoff = self.settings.retry_backoff_s
        attempt = 0
        while True:
            self.round_trips += 1
            try:
                with map_redis_errors(what):
                    return await operation()
            except ControlPlaneUnavailable as exc:
                if exc.reason == "auth" or attempt >= self.settings.retry_attempts:
                    self.metrics.redis_errors.labels(operation=what).inc()
                    raise
                attempt += 1
                self.metrics.redis_retries.labels(operation=what).inc()
                logger.warning(
                    "control plane: %s failed (%s); retry %d/%d in %.2fs",
                    what,
                    exc,
                    attempt,
                    self.settings.retry_attempts,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.retry_backoff_max_s)

    async def close(self) -> None:
        pool = self.client.connection_pool
        await self.client.aclose()
        if isinstance(pool, SentinelConnectionPool):  # its clients of the sentinels too
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()
