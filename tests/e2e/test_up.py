"""``pdserve up`` as a person runs it: starts its Redis, answers ``status``, stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

pytestmark = pytest.mark.e2e


def test_up_serves_a_control_plane_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "up",
            "--no-engines",
            "--work-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url_file = tmp_path / "redis.url"
        deadline = time.monotonic() + 30
        while not url_file.exists():
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "pdserve up did not start its Redis"
            time.sleep(0.1)
        url = url_file.read_text().strip()
        assert redis.Redis.from_url(url).ping()
        status = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "status", "--redis", url, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(status.stdout)["engines"] == []
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert f"control plane Redis at {url}" in output
    assert "stopped the embedded Redis" in output
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
