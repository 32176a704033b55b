"""Nothing a process starts outlives it, with real processes: a child started through
``parent_death_preexec`` (what ``pdserve up`` gives its engines, router, Redis and Prometheus),
a ``multiprocessing`` child that calls ``exit_with_parent`` (reference ranks, vLLM's engine
core), the stop bound of ``end_stop_within``, the busy-port check of ``pdserve up``, and the
fast exit of ``end_process`` (what an engine host ends with after a clean stop)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.lifetime import PortTaken, check_free, ports_to_bind_later
from services.lifetime import ports as lifetime_ports
from tests.e2e.up_system import process_tree, wait_all_gone

pytestmark = pytest.mark.integration

BOUND_S = 60.0
"""Generous: the machine is loaded (the watch itself reacts within a second)."""


def killed_middle(code: str, tmp_path: Path) -> dict[int, str]:
    """Run ``code`` (a script that starts children and prints their pids on one line) in a
    process, SIGKILL that process once the line is out; the children as they ran before."""
    script = tmp_path / "middle.py"
    script.write_text(textwrap.dedent(code))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    with process.stdout:
        line = process.stdout.readline()
    children = {}
    for pid in line.split():
        children |= process_tree(int(pid))
    process.kill()
    assert line, f"the middle process exited with {process.wait(BOUND_S)} before its children"
    process.wait(BOUND_S)
    assert len(children) == len(line.split()), f"not all running: {line}"
    return children


def test_an_execd_child_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    children = killed_middle(
        """
        import subprocess, time
        from services.lifetime import parent_death_preexec
        child = subprocess.Popen(["sleep", "600"], preexec_fn=parent_death_preexec())
        print(child.pid, flush=True)
        time.sleep(600)
        """,
        tmp_path,
    )
    wait_all_gone(children, BOUND_S)


def test_a_spawned_child_stops_when_its_parent_is_killed_and_is_killed_if_it_ignores_it(
    tmp_path: Path,
) -> None:
    # One child stops on SIGTERM (Python's default); the other ignores SIGTERM, so only the
    # SIGKILL after the grace ends it.
    children = killed_middle(
        """
        import multiprocessing, signal, time

        def run(ignore_term):
            from services.lifetime import exit_with_parent
            if ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            exit_with_parent(1.0, name="test child")
            time.sleep(600)

        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            children = [context.Process(target=run, args=(flag,)) for flag in (False, True)]
            for child in children:
                child.start()
            time.sleep(2.0)  # both watching
            print(*(child.pid for child in children), flush=True)
            time.sleep(600)
        """,
        tmp_path,
    )
    assert len(children) == 2
    wait_all_gone(children, BOUND_S)


def test_a_stop_that_overruns_its_bound_is_killed() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from services.lifetime import end_stop_within\n"
            "end_stop_within(0.5, name='hung stop')\n"
            "time.sleep(600)\n",
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # it leads its group: the group is killed with it
    )
    _, stderr = process.communicate(timeout=BOUND_S)
    assert process.returncode == -signal.SIGKILL
    assert "hung stop did not stop within 0s of being told to; killing it" in stderr


def test_end_process_exits_as_python_would_less_the_finalization(tmp_path: Path) -> None:
    # What a normal exit does that anyone sees: a non-daemon thread finishes, an executor never
    # shut down lets its idle worker go (a plain join of it would wait forever), atexit handlers
    # run (logging.shutdown flushes a buffering handler), stdout in a pipe is flushed. What it
    # skips: a module global's __del__ (the interpreter's module teardown).
    log = tmp_path / "buffered.log"
    script = textwrap.dedent(
        f"""
        import atexit, concurrent.futures, logging, logging.handlers, sys, threading, time
        from services.lifetime import end_process

        class Finalized:
            def __del__(self):
                print("finalized", flush=True)

        kept = Finalized()
        buffered = logging.handlers.MemoryHandler(
            1000, flushLevel=logging.CRITICAL, target=logging.FileHandler({str(log)!r})
        )
        logging.getLogger().addHandler(buffered)
        logging.getLogger().warning("logged before the exit")
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        idle = concurrent.futures.ThreadPoolExecutor(1)
        idle.submit(print, "executor ran").result()
        sys.stdout.write("unflushed")
        end_process(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["executor ran", "unflushedthread done", "atexit ran"]
    assert log.read_text() == "logged before the exit\n"


def test_a_taken_port_is_refused_naming_its_holder() -> None:
    with socket.socket() as taken:
        # SO_REUSEPORT, as a pdserve router binds: a second bind with it would succeed.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortTaken) as refused:
            check_free([("router", "127.0.0.1", 0), ("router", "127.0.0.1", port)])
        message = str(refused.value)
        assert f"router port {port} on 127.0.0.1 is taken" in message
        assert f"held by pid {os.getpid()}: " in message
        assert "pytest" in message or sys.executable in message
    started = time.monotonic()
    check_free([("router", "127.0.0.1", port)])  # free again
    assert time.monotonic() - started < BOUND_S


def test_ports_chosen_for_a_later_bind_are_distinct_free_and_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = ports_to_bind_later(8, "127.0.0.1")
    assert len(set(ports)) == 8
    assert all(lifetime_ports.LOWEST_CHOSEN_PORT <= port < low for port in ports)
    for port in ports:  # each one binds now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    # A machine whose ephemeral range leaves no room below it: the kernel's choice instead.
    squeezed = tmp_path / "ip_local_port_range"
    squeezed.write_text(f"{lifetime_ports.LOWEST_CHOSEN_PORT + 3}\t60999\n")
    monkeypatch.setattr(lifetime_ports, "_EPHEMERAL_RANGE", squeezed)
    assert len(set(ports_to_bind_later(2, "127.0.0.1"))) == 2
