"""KV-event endpoint addresses: what an engine binds and what its record advertises."""

from __future__ import annotations

import socket

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


def free_tcp_ports(count: int, host: str = "") -> tuple[int, ...]:
    """``count`` distinct TCP ports free on ``host`` (every interface by default) right now,
    for a process that binds them later (vLLM binds its publisher in its engine core): held
    together while chosen, so they differ; another process may still take one before then."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
