"""Targets from endpoints.json, and what happens without a Prometheus (a clear failure saying how
to install it, before ``pdserve up --prometheus`` starts anything)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.observability import local_prometheus
from services.observability.local_prometheus import PrometheusError, file_sd_targets, find_binary

ENDPOINTS = {
    "router": "http://127.0.0.1:8000",
    "namespace": "llm",
    "metrics": {
        "router": "http://127.0.0.1:8000/metrics",
        "prefill-0": "http://127.0.0.1:9101/metrics",
    },
}


def test_every_metrics_url_is_one_target_labelled_with_namespace_and_process() -> None:
    groups = file_sd_targets(ENDPOINTS)
    assert groups == [
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "namespace": "llm",
                "pdserve_process": "prefill-0",
            },
        },
        {
            "targets": ["127.0.0.1:8000"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "namespace": "llm",
                "pdserve_process": "router",
            },
        },
    ]


@pytest.mark.parametrize(
    "metrics", [{}, None, {"router": "127.0.0.1:8000/metrics"}, {"router": "ftp://h:1/m"}]
)
def test_endpoints_without_usable_metrics_urls_are_refused(metrics: object) -> None:
    with pytest.raises(PrometheusError):
        file_sd_targets({**ENDPOINTS, "metrics": metrics})


def test_a_missing_binary_fails_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(local_prometheus.sys, "prefix", str(tmp_path))
    with pytest.raises(PrometheusError, match="make prometheus") as raised:
        find_binary("promtool")
    assert "apt-get download prometheus" in str(raised.value)


def test_up_with_prometheus_but_none_installed_exits_before_starting_anything(
    tmp_path: Path,
) -> None:
    probe = (
        "import sys; sys.prefix = sys.argv[1]; from services.cli.main import main; "
        "sys.exit(main(['up', '--prometheus', '--work-dir', sys.argv[2]]))"
    )
    work = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path), str(work)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path)},
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no prometheus on PATH" in done.stderr and "make prometheus" in done.stderr
    assert not (work / "redis.url").exists(), "the embedded Redis was started"
    assert not (work / "logs").exists()
