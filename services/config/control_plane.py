"""Settings of the Redis connection and of the control plane's leases."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class RedisSettings(BaseModel):
    """How to reach the control plane's Redis."""

    # Validation errors would otherwise echo the input, password (in ``url``) included.
    model_config = ConfigDict(hide_input_in_errors=True)

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://`` or ``rediss://`` (TLS) URL, or through Redis Sentinel
    ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`` (the
    sentinels' addresses; the client asks them for the service's master and again after a
    failover; the credentials and TLS settings are the master's, the sentinels take none). A
    password in the URL is accepted but ``password`` is preferred, since URLs end up in
    logs."""
    username: str | None = None
    """ACL user name (Redis 6+), with ``password``."""
    password: SecretStr | None = None
    """AUTH password; never logged."""
    tls: bool = False
    """Use TLS even when the URL says ``redis://``."""
    tls_ca_file: Path | None = None
    """CA bundle that signs the server certificate."""
    tls_cert_file: Path | None = None
    """Client certificate, for mutual TLS."""
    tls_key_file: Path | None = None
    """Client key, for mutual TLS."""
    socket_timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of one command."""
    connect_timeout_s: float = Field(default=2.0, gt=0)
    """Timeout of establishing a connection."""
    retry_attempts: int = Field(default=5, ge=0)
    """Retries of a failed command (connection lost, timeout, Redis loading) before giving up
    with ``ControlPlaneUnavailable``."""
    retry_backoff_s: float = Field(default=0.05, gt=0)
    """First backoff; doubles per attempt up to ``retry_backoff_max_s``."""
    retry_backoff_max_s: float = Field(default=2.0, gt=0)
    """Largest backoff between two retries."""

    @model_validator(mode="after")
    def _check(self) -> RedisSettings:
        if not self.url.startswith(("redis://", "rediss://", "unix://", SENTINEL_SCHEME)):
            raise ValueError(
                "redis url must start with redis://, rediss://, unix:// or "
                f"{SENTINEL_SCHEME}: {redact_url(self.url)}"
            )
        if self.url.startswith(SENTINEL_SCHEME):
            try:
                parse_sentinel_url(self.url)
            except ValueError as exc:  # its messages never carry the credentials
                raise ValueError(
                    f"redis url is not a valid sentinel URL: {redact_url(self.url)}: {exc}"
                ) from None
        else:
            try:
                urlsplit(self.url).port  # noqa: B018 (parsing is the check)
            except ValueError:
                raise ValueError(f"redis url is not a valid URL: {redact_url(self.url)}") from None
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError("retry_backoff_max_s must be >= retry_backoff_s")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.url.startswith("rediss://")

    @property
    def sentinel(self) -> SentinelTarget | None:
        """The Sentinel target of a ``redis+sentinel://`` URL, else ``None``."""
        return parse_sentinel_url(self.url) if self.url.startswith(SENTINEL_SCHEME) else None

    @property
    def display_url(self) -> str:
        """``url`` with any password replaced by ``***``: the form to print or log."""
        return redact_url(self.url)


SENTINEL_SCHEME = "redis+sentinel://"


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL names (see ``RedisSettings.url``)."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelTarget:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]``;
    :class:`ValueError` naming what is wrong (redis-py parses no such URL)."""
    if not url.startswith(SENTINEL_SCHEME):
        raise ValueError(f"not a {SENTINEL_SCHEME} URL")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError("a sentinel URL takes no query or fragment")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {address!r} is not host:port")
        sentinels.append((host, int(port)))
    path = [piece for piece in parts.path.split("/") if piece]
    if not path or len(path) > 2:
        raise ValueError("the path must be /service_name or /service_name/db")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"db {path[1]!r} is not a number")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon and secret else None
    return SentinelTarget(
        tuple(sentinels),
        unquote(path[0]),
        int(path[1]) if len(path) == 2 else 0,
        username,
        password,
    )


def redact_url(url: str) -> str:
    """``url`` with its password (user-info ``user:password@`` or redis-py's ``?password=``
    query option) masked as ``***``: the form to print or log."""
    try:
        return _rewrite_password(url, "***")[0]
    except ValueError:
        return "<unparseable url>"


def split_url_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password (user-info or ``?password=``), and that password (``None``
    when it has none): a child process gets the URL in its argv, where any local user can read
    it, and the password in its environment (``PDSERVE_CONTROL_PLANE__REDIS__PASSWORD``)."""
    return _rewrite_password(url, None)


def _rewrite_password(url: str, replacement: str | None) -> tuple[str, str | None]:
    """``url`` with its password replaced by ``replacement`` (dropped when ``None``), and the
    password it had. The URL is untouched when it has none."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    in_query = [value for key, value in query if key == "password"]
    password = parts.password or (in_query[-1] if in_query else None)
    if not password:
        return url, None
    netloc = parts.netloc
    if parts.password:
        user = parts.username or ""
        host = netloc.rpartition("@")[2]
        if replacement is not None:
            netloc = f"{user}:{replacement}@{host}"
        else:
            netloc = f"{user}@{host}" if user else host
    if in_query:
        kept = [(key, value) for key, value in query if key != "password"]
        if replacement is not None:
            kept.append(("password", replacement))
        query_text = urlencode(kept, safe="*")
    else:
        query_text = parts.query
    rewritten = f"{parts.scheme}://{netloc}{parts.path}"
    if query_text:
        rewritten += f"?{query_text}"
    if parts.fragment:
        rewritten += f"#{parts.fragment}"
    return rewritten, password


class ControlPlaneSettings(BaseModel):
    """Leases, namespaces and watching."""

    redis: RedisSettings = Field(default_factory=RedisSettings)
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Key prefix ``pdserve:<namespace>:``: several deployments can share one Redis."""
    lease_ttl_s: float = Field(default=10.0, gt=0)
    """An engine that has not heartbeated for this long is gone (its records expire)."""
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    """How often an engine renews its lease; well under ``lease_ttl_s``."""
    resync_interval_s: float = Field(default=2.0, gt=0)
    """Watchers re-read everything this often (pub/sub is lossy; leases expire silently)."""

    @model_validator(mode="after")
    def _check(self) -> ControlPlaneSettings:
        if self.heartbeat_interval_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most half of "
                f"lease_ttl_s ({self.lease_ttl_s}) so one lost heartbeat does not expire the lease"
            )
        return self
