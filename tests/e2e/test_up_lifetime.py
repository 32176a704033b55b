"""Nothing of a ``pdserve up`` stack outlives it, with the reference engine (issue 35; the vLLM
stack's SIGKILL is checked by tests/e2e/test_vllm_pd.py's push-stack teardown):

- an engine host told to stop while its Redis hangs (SIGSTOP: every call waits its socket
  timeout) stops within its drain bound plus :data:`STOP_OVERRUN_S`, on its own (status 0, not
  the stop bound's SIGKILL);
- SIGKILL of ``pdserve up`` itself: every process of the stack (Redis, engine hosts, their
  ranks, the router) is gone within a bound;
- ``pdserve up`` on a taken port is refused before it starts anything.

A private stack: the first test kills its processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.engine import STOP_OVERRUN_S
from services.serving.ready import pdserve_argv
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from tests.e2e.faults.probes import rank_pids, wait_until
from tests.e2e.up_system import UpSystem, process_tree, still_running, wait_all_gone

pytestmark = [pytest.mark.e2e, pytest.mark.destructive]

DRAIN_S = 5.0
"""The engines' drain bound (``--drain-timeout-s``)."""
GONE_S = 120.0
"""Generous: engine hosts drain and stop their ranks on a loaded machine."""


@pytest.fixture
def system(tmp_path: Path) -> Iterator[UpSystem]:
    system = UpSystem(
        tmp_path / "up",
        "--prefill-pp",
        "2",
        "--no-restart",  # a stopped engine stays stopped
        f"--engine-arg=--drain-timeout-s={DRAIN_S}",
    )
    try:
        system.wait_ready()
        yield system
    finally:
        system.stop()


def commands(tree: dict[int, str]) -> list[str]:
    return list(still_running(tree).values())


def test_a_host_stops_within_its_bound_with_redis_hung_and_nothing_outlives_up(
    system: UpSystem,
) -> None:
    tree = process_tree(system.process.pid)
    running = commands(tree)
    for part in ("redis-server", "main prefill", "main decode", "main router"):
        assert any(part in command for command in running), (part, running)
    # Ranks (the hosts' children, forked): two prefill stages and one decode rank.
    engines = system.endpoints["engines"]
    ranks = {name: rank_pids(int(engines[name]["pid"])) for name in ("prefill-0", "decode-0")}
    assert [len(ranks["prefill-0"]), len(ranks["decode-0"])] == [2, 1], (ranks, running)
    assert set(ranks["prefill-0"] + ranks["decode-0"]) <= set(still_running(tree)), ranks

    redis = next(pid for pid, command in still_running(tree).items() if "redis-server" in command)
    prefill = int(system.endpoints["engines"]["prefill-0"]["pid"])
    prefill_tree = process_tree(prefill)
    os.kill(redis, signal.SIGSTOP)
    try:
        os.kill(prefill, signal.SIGTERM)
        bound_s = DRAIN_S + STOP_OVERRUN_S
        wait_all_gone(prefill_tree, bound_s)  # the host and its ranks
        wait_until(
            lambda: "prefill-0 exited with status" in system.output(),
            GONE_S,
            "pdserve up reports prefill-0's exit",
        )
        # On its own: a stop killed at the bound would be "status -9".
        assert "prefill-0 exited with status 0" in system.output(), system.output()[-3000:]
        log = (system.work_dir / "logs" / "prefill-0.log").read_text()
        assert "leaving it to its lease" in log  # the deregistration gave up, logged
    finally:
        os.kill(redis, signal.SIGCONT)

    # SIGKILL of pdserve up: Redis, the decode host and its rank, and the router end too.
    rest = process_tree(system.process.pid)
    os.kill(system.process.pid, signal.SIGKILL)
    wait_all_gone(rest, GONE_S)


@contextlib.contextmanager
def held_port() -> Iterator[str]:
    """A listening port held as a pdserve router holds its port (``SO_REUSEPORT``: a router
    binding the same way would share it silently)."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield str(taken.getsockname()[1])


def refused_on_a_held_port(*command: str) -> None:
    """``pdserve <command> --port P`` with P held here exits 2 naming this process."""
    with held_port() as port:
        run = subprocess.run(
            pdserve_argv(*command, "--port", port),
            capture_output=True,
            text=True,
            timeout=GONE_S,
            check=False,
        )
    assert run.returncode == 2, run.stderr
    assert f"router port {port} on 127.0.0.1 is taken (held by pid {os.getpid()}: " in run.stderr


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    work_dir = tmp_path / "second"
    refused_on_a_held_port("up", "--work-dir", str(work_dir))
    assert not work_dir.exists(), "it started something (its work folder exists)"


def test_router_workers_refuse_a_port_another_process_holds(tmp_path: Path) -> None:
    checkpoint = write_synthetic_checkpoint(tmp_path / "stub", vocab_size=512, max_model_len=64)
    refused_on_a_held_port(
        "router", "--redis", "redis://127.0.0.1:1/0", "--workers", "2",
        "--tokenizer", str(checkpoint),
    )  # fmt: skip
