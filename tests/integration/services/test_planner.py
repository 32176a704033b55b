"""``pdserve planner`` as a subprocess against a real router over stub engine hosts (real gRPC,
real Redis control plane, in the test's event loop): it announces its ``/metrics``, reads the
router's figures for two intervals with requests in them, and publishes a desired count for
both pools within their bounds, with the reasons counted."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.bench.sse import event_data
from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.sim.profile import load_profile
from services.engines.stub import StubBackend
from services.router.config import RouterSettings
from services.serving.ready import parse_ready_line, pdserve_argv
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

LINE_TIMEOUT_S = 30.0
"""Bound on each line the planner prints (its start included)."""
BOUNDS = {"prefill": (1, 3), "decode": (2, 4)}


async def _completions(client: httpx.AsyncClient, count: int) -> None:
    for _ in range(count):
        body = {"model": "stub", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for _data in event_data(response):
                pass


@pytest.fixture
async def planner_process() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Holds the planner once started; terminated (killed past a bound) when the test ends."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), LINE_TIMEOUT_S)
    assert line, f"the planner exited ({await process.wait()}) before printing"
    return line.decode()


def _stub_profile(directory: Path) -> Path:
    """The shipped profile's timing, as if measured on the stub engines' model (the planner
    refuses a profile of another model than the router serves)."""
    data = json.loads(load_profile().model_dump_json())
    data["model"]["name"] = "stub"
    path = directory / "stub.json"
    path.write_text(json.dumps(data))
    return path


async def test_planner_publishes_a_desired_count_per_pool_within_bounds(
    cp_settings: ControlPlaneSettings,
    planner_process: list[asyncio.subprocess.Process],
    tmp_path: Path,
    stub_checkpoint: Path,
) -> None:
    settings = service_settings(cp_settings)
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=stub_checkpoint,
        served_model_name="stub",
        prefill_timeout_s=10,
        decode_timeout_s=10,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_PLANNER_")}
    async with (
        hosted(settings, StubBackend(), engine_id="plan-prefill", role=EngineRole.PREFILL),
        hosted(settings, StubBackend(), engine_id="plan-decode", role=EngineRole.DECODE),
        serving_router(router) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        await _completions(client, 2)
        argv = pdserve_argv(
            "planner",
            "--router-url", url,
            "--profile", str(_stub_profile(tmp_path)),
            "--interval-s", "0.5",
            "--metrics-port", "0",
            "--ttft-ms", "200",
            "--itl-ms", "20",
            "--prefill-min", str(BOUNDS["prefill"][0]),
            "--prefill-max", str(BOUNDS["prefill"][1]),
            "--decode-min", str(BOUNDS["decode"][0]),
            "--decode-max", str(BOUNDS["decode"][1]),
        )  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, env=env
        )
        planner_process.append(process)
        ready = parse_ready_line(await _line(process))
        assert ready is not None
        # The first read is the baseline; the two after it are intervals with requests.
        records = [json.loads(await _line(process))]
        for _ in range(2):
            await _completions(client, 3)
            records.append(json.loads(await _line(process)))
        async with httpx.AsyncClient(timeout=10) as plain:
            exposition = (await plain.get(ready["metrics"])).text

    assert records[0]["decode"]["reason"] == "no_metrics"
    assert records[0]["decode"]["desired"] == BOUNDS["decode"][0]  # one ready, min 2
    for record in records[1:]:
        assert record["observed"]["rate_rps"] >= 0
        # The mean lengths are the router's token figures: 3 prompt tokens, 4 generated.
        assert record["predicted"]["lengths"] == "router", record
        assert (record["predicted"]["input_tokens"], record["predicted"]["output_tokens"]) == (
            3,
            4,
        )
        for pool in BOUNDS:
            assert record[pool]["reason"] != "no_metrics", record
            assert "tokens_per_s_per_engine" in record[pool]
            # The engines' load, as the router relays it, is read for each pool.
            assert record[pool]["queue_depth"] == 0, record

    desired: dict[str, float] = {}
    decisions: dict[tuple[str, str], float] = {}
    queued: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "pdserve_planner_desired_replicas":
                desired[sample.labels["pool"]] = sample.value
            elif sample.name == "pdserve_planner_queued_requests":
                queued[sample.labels["pool"]] = sample.value
            elif sample.name == "pdserve_planner_decisions_total":
                decisions[(sample.labels["pool"], sample.labels["reason"])] = sample.value
    assert set(desired) == set(BOUNDS)
    assert queued == {"prefill": 0, "decode": 0}
    for pool, (low, high) in BOUNDS.items():
        assert low <= desired[pool] <= high
        counted = sum(v for (p, r), v in decisions.items() if p == pool and r != "no_metrics")
        assert counted >= 2
