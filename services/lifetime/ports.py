"""Fixed ports a command will bind, checked before it starts anything: a taken port is refused
at once, naming the port and, where ``/proc`` tells, the process that holds it (``pdserve up``
would otherwise start every engine and fail only when its router binds, minutes later; a
``pdserve router --workers N`` would share the port of another router silently).

The check binds the port itself with ``SO_REUSEADDR`` and without ``SO_REUSEPORT``: a listener
in ``TIME_WAIT`` leftovers does not count, but another process's listener does, even one that
shares the port through ``SO_REUSEPORT`` (another pdserve router would, and the kernel would
then split connections between two unrelated routers).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterable
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"
"""``st`` of a listening socket in ``/proc/net/tcp``."""


_EPHEMERAL_RANGE = _PROC / "sys" / "net" / "ipv4" / "ip_local_port_range"
LOWEST_CHOSEN_PORT = 10000
"""The lowest port :func:`ports_to_bind_later` chooses (below: well-known services)."""
_DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default ephemeral range, where ``/proc`` does not say."""


def ports_to_bind_later(count: int, host: str = "") -> tuple[int, ...]:
    """``count`` distinct TCP ports free on ``host`` (every interface by default) now, for a
    process that binds them later (vLLM's engine core binds its KV-event publisher; rank 0 of a
    reference engine listens for its group's rendezvous).

    Chosen at random *below the kernel's ephemeral range*: a port from that range (what binding
    port 0 hands out) is handed out again, to the next process that binds port 0 or to the
    source of any outgoing connection, the moment it is released, and once was before vLLM
    bound it ("Address already in use" while a test suite ran two stacks). Below the range only
    another process choosing the same way can take one in between: each is checked free (bound
    with ``SO_REUSEADDR``), and all are held together while chosen, so they differ."""
    low, _ = _ephemeral_range()
    if low - LOWEST_CHOSEN_PORT < 4 * count:  # a machine whose ephemeral range starts low
        return _kernel_chosen(count, host)
    rng = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        for _ in range(64 * count):
            if len(held) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, rng.randrange(LOWEST_CHOSEN_PORT, low)))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        if len(held) < count:
            return _kernel_chosen(count, host)
        return tuple(int(sock.getsockname()[1]) for sock in held)
    finally:
        for sock in held:
            sock.close()


def _ephemeral_range() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        low, high = _EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    return _DEFAULT_EPHEMERAL


def _kernel_chosen(count: int, host: str) -> tuple[int, ...]:
    """Ports from the kernel (port 0), held together while chosen."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


class PortTaken(Exception):
    """A fixed port is in use; the message names it and, where it can be read, its holder."""


def check_free(ports: Iterable[tuple[str, str, int]]) -> None:
    """Raise :class:`PortTaken` for the first ``(what, host, port)`` whose port cannot be bound
    (port 0, "any free one", is skipped)."""
    for what, host, port in ports:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                holder = port_holder(port)
                held = f" (held by {holder})" if holder else ""
                raise PortTaken(
                    f"{what} port {port} on {host} is taken{held}: {exc.strerror}; stop that "
                    f"process or choose another port"
                ) from None


def port_holder(port: int) -> str | None:
    """``pid N: command line`` of a process listening on TCP ``port``, when ``/proc`` shows
    it (Linux, and a process of this user), else ``None``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return f"pid {entry.name}: {_command_line(entry)}"
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (_PROC / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _LISTEN:
                    local_port = int(fields[1].rsplit(":", 1)[1], 16)
                    if local_port == port:
                        inodes.add(fields[9])
    return inodes


def _command_line(process: Path) -> str:
    with contextlib.suppress(OSError):
        words = (process / "cmdline").read_bytes().split(b"\0")
        line = " ".join(word.decode(errors="replace") for word in words if word)
        return line if len(line) <= 200 else line[:197] + "..."
    return "?"
