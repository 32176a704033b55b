"""KV-event endpoint addresses: what an engine binds and what its record advertises."""

from __future__ import annotations

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]", "::"})


def advertised(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard bind host (``*``, ``0.0.0.0``, ``[::]``) replaced by
    ``host`` (a name or address that others reach the engine at); others unchanged."""
    scheme, sep, rest = endpoint.partition("://")
    bound, _, port = rest.rpartition(":")
    if not sep or bound not in WILDCARD_HOSTS:
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
