"""A real Prometheus on a free loopback port, scraping a ``pdserve up`` system (tests, laptops).

The binary is a ``prometheus`` on ``PATH`` when there is one, else the one ``make test`` unpacks
into the virtual environment (``<venv>/prometheus/bin``, see
``services/devtools/install_prometheus.py``). Without either, :func:`find_binary` raises
:class:`PrometheusError` saying how to install it.

Targets come from ``pdserve up``'s ``endpoints.json`` through file-based service discovery
(:func:`file_sd_targets`, written to ``targets.json`` next to ``prometheus.yml``): one target per
``/metrics`` URL, labelled ``namespace`` (the control-plane namespace, where Kubernetes would put
the pod's namespace: the dashboards filter on it) and ``pdserve_process`` (router, prefill-0...).
The rule files given (the chart's recording and alert rules) are loaded. Storage lives in the
work folder; :meth:`LocalPrometheus.stop` ends the process (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx

from services.control_plane.local_redis import free_port
from services.lifetime import parent_death_preexec

logger = logging.getLogger(__name__)

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
RULES_FILE = CHART_DIR / "rules" / "pdserve.rules.yaml"
"""The chart's recording and alert rules (also rendered into its ``PrometheusRule``)."""

INSTALL_HINT = (
    "install Prometheus 2.x: `make prometheus` (unpacks Debian's package into "
    ".venv/prometheus/bin), or put `prometheus` and `promtool` on PATH "
    "(apt-get download prometheus && dpkg -x prometheus_*.deb DIR; the binaries are in "
    "DIR/usr/bin)"
)


class PrometheusError(RuntimeError):
    """Prometheus (or promtool) could not be found or started; the message says why and how
    to install it."""


def find_binary(name: str = "prometheus") -> Path:
    """``name`` (``prometheus`` or ``promtool``): ``PATH`` first, then ``<venv>/prometheus/bin``."""
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    bundled = Path(sys.prefix) / "prometheus" / "bin" / name
    if bundled.is_file():
        return bundled
    raise PrometheusError(f"no {name} on PATH nor at {bundled}: {INSTALL_HINT}")


def file_sd_targets(endpoints: Mapping[str, Any]) -> list[dict[str, Any]]:
    """File-SD target groups for every ``/metrics`` URL of an ``endpoints.json``."""
    metrics = endpoints.get("metrics")
    if not isinstance(metrics, Mapping) or not metrics:
        raise PrometheusError(f"endpoints.json names no metrics URLs: {metrics!r}")
    namespace = str(endpoints.get("namespace", ""))
    groups = []
    for process, url in sorted(metrics.items()):
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise PrometheusError(f"metrics URL of {process} is not http(s)://host:port: {url!r}")
        groups.append(
            {
                "targets": [parts.netloc],
                "labels": {
                    "__scheme__": parts.scheme,
                    "__metrics_path__": parts.path or "/metrics",
                    "namespace": namespace,
                    "pdserve_process": str(process),
                },
            }
        )
    return groups


class LocalPrometheus:
    """One ``prometheus`` child process on ``127.0.0.1:<port>`` with its config in ``work_dir``."""

    def __init__(
        self,
        work_dir: Path,
        *,
        scrape_interval_s: float = 2.0,
        rule_files: Sequence[Path] = (),
        port: int | None = None,
        binary: Path | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.binary = binary or find_binary()
        self.work_dir = work_dir
        self.port = port or free_port()
        self.scrape_interval_s = scrape_interval_s
        self.rule_files = [path.resolve() for path in rule_files]
        self.start_timeout_s = start_timeout_s
        self.config_path = work_dir / "prometheus.yml"
        self.targets_path = work_dir / "targets.json"
        self.log_path = work_dir / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def write_targets(self, endpoints: Mapping[str, Any]) -> None:
        """(Re)write the file-SD targets; a running Prometheus picks them up within seconds."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.targets_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(file_sd_targets(endpoints), indent=2) + "\n")
        temporary.replace(self.targets_path)

    def _write_config(self) -> None:
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        # JSON is YAML: no YAML writer needed for Prometheus's config.
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": "pdserve",
                    "scrape_timeout": interval,
                    "file_sd_configs": [
                        {"files": [str(self.targets_path.resolve())], "refresh_interval": "1s"}
                    ],
                }
            ],
        }
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")
        if not self.targets_path.exists():
            self.targets_path.write_text("[]\n")

    def start(self) -> LocalPrometheus:
        """Start it and wait until ``/-/ready``; :class:`PrometheusError` with its log if not."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the process without waiting for it (call from the main thread: it ends with
        this process, :func:`~services.lifetime.parent_death_preexec`); :meth:`wait_ready`
        waits."""
        if self.running:
            return
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        argv = [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        web = self.binary.parent.parent / "web"
        if (web / "templates").is_dir():  # the UI unpacked next to the binary by make test
            argv.append(f"--web.local-assets={web}/")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # One prctl call, resolved before the fork (services.lifetime): takes no lock.
                preexec_fn=parent_death_preexec(),  # noqa: PLW1509
            )

    def wait_ready(self) -> None:
        """Until ``/-/ready`` answers; :class:`PrometheusError` with its log if it exits or the
        start times out (then it is stopped)."""
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200:
                    logger.info("local prometheus %s serving on %s", self.binary, self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready on {self.url} in time:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
