"""``pdserve up`` replaces a dead engine: a real stack (reference engine, its own Redis) with two
prefill and two decode engines, under a steady load of concurrent streamed and non-streamed
greedy requests (the load and checks of ``test_failover_reference``).

Each scenario starts from the whole stack (``test_failover_reference.whole``), so they pass in
any order:

0. a fault-free run gives the reference texts (the stack's first run) again;
1. prefill-0's *host* (its engine service process) is killed (SIGKILL) under load: no client
   request fails and every text equals the fault-free run's (its prefills are retried on
   prefill-1); ``pdserve up`` starts prefill-0 again, which registers a new generation, turns
   READY (``pdserve status --json``) and serves prefills again;
2. prefill-1's *rank* is killed: its host exits (a dead rank ends its service) and is restarted
   the same way, with nothing lost;
3. decode-0's *host* is killed mid-stream: its streams migrate to decode-1 (counted), none
   fails, and decode-0 is restarted and decodes again.

Nothing is timed against the wall clock: every wait has a generous bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from services.serving.ready import pdserve_argv
from tests.e2e import test_failover_reference as failover
from tests.e2e.conftest import FAULT_STACK
from tests.e2e.faults.probes import metric
from tests.e2e.test_failover_reference import (
    ENGINES,
    RESTART_BOUND_S,
    Load,
    Stack,
    assert_lost_nothing,
    fault_free_texts,
    finished_after,
    pools_full,
    steady_load,
    streaming_on,
    wait_for,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.destructive,
    pytest.mark.slow,
    pytest.mark.xdist_group(FAULT_STACK),
]


# The stack this module shares with test_failover_reference (``shared_stack``,
# tests/e2e/conftest.py): two prefill and two decode engines, a killed one restarted; ``stack``
# waits until it is whole.
stack = failover.stack


async def wait_long(predicate: Callable[[], bool], what: str) -> None:
    """:func:`wait_for` with the bound of a restart."""
    deadline = asyncio.get_running_loop().time() + RESTART_BOUND_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, (
            f"{what}: not within {RESTART_BOUND_S}s"
        )
        await asyncio.sleep(0.2)


def status_of(stack: Stack, engine: str) -> dict[str, Any]:
    """``engine``'s entry of ``pdserve status --json`` (the control plane's view)."""
    endpoints = stack.up.endpoints
    command = pdserve_argv(
        "status", "--json", "--redis", endpoints["redis"], "--namespace", endpoints["namespace"]
    )
    output = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(output.stdout)
    entries = [e for e in report["engines"] if e["engine_id"] == engine]
    assert len(entries) == 1, report
    entry: dict[str, Any] = entries[0]
    return entry


def restarted(stack: Stack, engine: str, restarts: int) -> bool:
    """Whether ``endpoints.json`` names ``engine``'s ``restarts``-th run as READY (``pdserve
    up`` rewrites it once the restarted engine printed its READY line)."""
    current = stack.up.read_endpoints()
    if current["engines"][engine]["restarts"] < restarts:
        return False
    stack.up.endpoints = current
    return True


def served(stack: Stack, engine: str) -> float:
    """Prefill or Decode RPCs (its role's) ``engine``'s current process answered (its own
    ``/metrics``)."""
    url = str(stack.engine(engine)["metrics"])
    rpc = "Decode" if engine.startswith("decode") else "Prefill"
    return metric(url, "pdserve_engine_requests_total", rpc=rpc, outcome="ok")


@dataclass
class Replaced:
    load: Load
    output: str
    """What ``pdserve up`` printed from the kill on (the stack is shared: earlier scenarios'
    restarts are in its output before that)."""
    restart: int
    """The engine's restart count once it came back."""


async def replaced_under_load(
    stack: Stack, engine: str, kill: Callable[[], int], *, mid_stream: bool = False
) -> Replaced:
    """Kill the pid ``kill`` returns (a process of ``engine``) under load, once ``engine`` is
    chosen again (``mid_stream``: once a stream on it has chunks); wait until ``engine`` runs
    again at a new generation and served its role's calls; nothing lost."""
    before = stack.engine(engine)
    generation = status_of(stack, engine)["generation"]
    assert before["generation"] == generation
    restarts = int(before["restarts"])
    async with steady_load(stack.up.url, workers=6) as load:
        await finished_after(load, 4)
        await wait_for(lambda: stack.closed(engine), f"{engine} chosen")
        if mid_stream:
            await streaming_on(load, engine)
        printed = len(stack.up.output())
        os.kill(kill(), signal.SIGKILL)
        await wait_long(lambda: restarted(stack, engine, restarts + 1), f"{engine} restarted")
        after = stack.engine(engine)
        assert after["pid"] != before["pid"]
        assert after["generation"] > generation
        await wait_long(lambda: served(stack, engine) > 0, f"{engine} serving again")
        await finished_after(load, 4)
    assert_lost_nothing(stack, load)
    entry = status_of(stack, engine)
    assert (entry["state"], entry["generation"]) == ("ready", after["generation"])
    await pools_full(stack, *ENGINES)
    return Replaced(load, stack.up.output()[printed:], restarts + 1)


async def test_0_a_fault_free_run_gives_the_reference_texts(stack: Stack) -> None:
    assert await fault_free_texts(stack) == stack.reference


async def test_1_a_killed_prefill_host_is_restarted_with_a_new_generation(stack: Stack) -> None:
    replaced = await replaced_under_load(
        stack, "prefill-0", lambda: int(stack.engine("prefill-0")["pid"])
    )
    assert f"prefill-0 restarted (restart {replaced.restart}," in replaced.output


async def test_2_a_killed_prefill_rank_ends_its_host_which_is_restarted(stack: Stack) -> None:
    replaced = await replaced_under_load(stack, "prefill-1", lambda: stack.rank("prefill-1"))
    # The host noticed its rank and stopped.
    assert "prefill-1 exited with status 1" in replaced.output
    assert f"prefill-1 restarted (restart {replaced.restart}," in replaced.output


async def test_3_a_killed_decode_host_mid_stream_migrates_and_is_restarted(stack: Stack) -> None:
    """decode-0's host dies with streams on it: they continue on decode-1 (migrated, counted),
    none fails; decode-0 comes back at a new generation and decodes again."""
    migrations = stack.router("pdserve_router_migrations_total")
    replaced = await replaced_under_load(
        stack, "decode-0", lambda: int(stack.engine("decode-0")["pid"]), mid_stream=True
    )
    on_it = [o for o in replaced.load.outcomes if o.decode_engine == "decode-0"]
    assert on_it, "none on decode-0"
    assert stack.router("pdserve_router_migrations_total") > migrations
    assert f"decode-0 restarted (restart {replaced.restart}," in replaced.output
