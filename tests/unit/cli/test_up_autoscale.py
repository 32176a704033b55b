"""``pdserve up --autoscale``'s reading of the planner, the planner's command line, and a
planner that exited or cannot be read changing no pool."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast

import pytest

from services.cli.up_autoscale import autoscale, planner_argv_flags, read_planner
from services.cli.up_supervise import KeptEngines
from services.supervision import ChildProcess, RestartPolicy

PLANNER_METRICS = """\
# HELP pdserve_planner_desired_replicas Engines the planner wants in each pool.
# TYPE pdserve_planner_desired_replicas gauge
pdserve_planner_desired_replicas{pool="prefill"} 2.0
pdserve_planner_desired_replicas{pool="decode"} 3.0
# HELP pdserve_planner_decisions_total Decisions by pool and reason.
# TYPE pdserve_planner_decisions_total counter
pdserve_planner_decisions_total{pool="prefill",reason="scale_up"} 1.0
"""


def test_the_planners_desired_sizes_count_once_it_decided() -> None:
    view = read_planner(PLANNER_METRICS)
    assert view.decided
    assert view.desired == {"prefill": 2, "decode": 3}


def test_before_its_first_decision_the_published_sizes_are_not_acted_on() -> None:
    # At start the planner publishes its bounds' view (the minimum) before any decision.
    text = PLANNER_METRICS.split("# HELP pdserve_planner_decisions_total", maxsplit=1)[0]
    view = read_planner(text)
    assert not view.decided
    assert view.desired == {"prefill": 2, "decode": 3}


def test_the_sim_profile_is_the_planners_unless_one_is_named() -> None:
    assert planner_argv_flags("llama", ["--ttft-ms=300"]) == ["--profile=llama", "--ttft-ms=300"]
    assert planner_argv_flags("llama", ["--profile", "x.json"]) == ["--profile", "x.json"]
    assert planner_argv_flags("llama", ["--profile=x.json"]) == ["--profile=x.json"]
    assert planner_argv_flags(None, []) == []


class _Planner:
    """A planner child as :func:`autoscale` sees it: running or not, and its metrics URL."""

    def __init__(self, *, running: bool, metrics_url: str = "") -> None:
        self.running = running
        self.announced = {"metrics": metrics_url}

    def describe_exit(self) -> str:
        return "planner exited with status 1"


@dataclass
class _Engine:
    name: str
    role: str


def _never_started(role: str, index: int) -> ChildProcess:
    raise AssertionError(f"autoscale started {role}-{index} without a planner decision")


def _kept(stop: asyncio.Event) -> KeptEngines:
    return KeptEngines(stop, policy=RestartPolicy(), ready_timeout_s=1.0, on_change=lambda _: None)


async def test_a_planner_that_exited_changes_no_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32, "a planner that dies changes nothing": the autoscaler ends, the engines stay."""
    children = [_Engine("prefill-0", "prefill"), _Engine("decode-0", "decode")]
    before = list(children)
    await asyncio.wait_for(
        autoscale(
            _kept(asyncio.Event()),
            planner=cast(ChildProcess, _Planner(running=False)),
            children=cast(list[ChildProcess], children),
            new_engine=_never_started,
            poll_s=0.01,
            scale_down_timeout_s=1.0,
        ),
        timeout=60,  # it returns at once; the bound is only against a hang
    )
    assert children == before
    assert "the pools keep their engines" in capsys.readouterr().err


async def test_an_unreadable_planner_holds_the_pools(capsys: pytest.CaptureFixture[str]) -> None:
    """A planner whose metrics port takes connections and answers nothing HTTP: every read
    fails, the pools keep their engines, and the hold is said once. The stop comes after the
    third read, not after a time, so a loaded machine reads as often as a quiet one."""
    stop = asyncio.Event()
    reads = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal reads
        reads += 1
        if reads >= 3:
            stop.set()
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    children = [_Engine("prefill-0", "prefill"), _Engine("decode-0", "decode")]
    before = list(children)
    async with server:
        await asyncio.wait_for(
            autoscale(
                _kept(stop),
                planner=cast(
                    ChildProcess,
                    _Planner(running=True, metrics_url=f"http://127.0.0.1:{port}/metrics"),
                ),
                children=cast(list[ChildProcess], children),
                new_engine=_never_started,
                poll_s=0.02,
                scale_down_timeout_s=1.0,
            ),
            timeout=120,
        )
    assert reads >= 3
    assert children == before
    assert capsys.readouterr().out.count("holding, planner unreadable") == 1
