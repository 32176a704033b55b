"""Faults injected into a real ``pdserve up`` stack running the reference engine.

One stack for the module (its own Redis, so the test can restart it): prefill-0 (PP=1) and
decode-0/decode-1 (TP=1) on the tiny checkpoint, every request disaggregated. The scenarios
run in file order and each leaves the stack in a known state for the next:

1. a prefill rank stopped (SIGSTOP) for less than any bound, then resumed: requests are
   delayed, none lost;
2. a prefill rank stopped longer than the router's prefill deadline (``PREFILL_TIMEOUT_S``):
   its requests time out and run locally on the decode engines (counted) or fail explicitly;
   once resumed, the router's aborts free its pool and it serves disaggregated again;
3. decode-0's rank stopped mid-stream longer than the router's idle bound
   (``DECODE_IDLE_TIMEOUT_S``): its streams end with an error event (504, counted
   ``engine_timeout``); once resumed, its pool is full again and it serves;
4. kill -9 of decode-0's rank mid-stream: its streams end with an error event, decode-1 serves;
5. kill -9 of prefill-0's rank under load: requests are retried/run locally or fail explicitly;
6. prefill-0 restarted under the same id: a new generation, the old KV handle refused;
7. Redis down for a few seconds under load, then back empty (all keys lost): requests during
   the outage still disaggregate (the decode engine checks producers against the views it
   read last, counted) or fail explicitly; then engines and router reconverge within the
   lease TTL.

The stack runs with ``PDSERVE_ROUTER_MAX_MIGRATIONS=0``: with one prefill engine and requests
that may not move to another decode engine, these scenarios check what the client sees when no
failover is possible (tests/e2e/test_failover_reference.py checks that, with a healthy replica,
none of it reaches the client). Its circuit breakers back off for 1-2 s only, so an engine that
comes back is chosen again within the scenarios' bounds.

A stopped rank is a slow peer, not a dead one: its engine service keeps heartbeating, so only
the router's own bounds end the requests waiting on it (the stack sets them to seconds).

For each: every client call has a bound (``REQUEST_BOUND_S``) and the test asserts it was not
hit; affected requests end within ``FAULT_BOUND_S`` of the fault (plus the router bound that
has to trip first); block pools return to full; the router and engines count what happened on
``/metrics``. A stopped rank is always resumed, even when an assertion fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from services.bench.sse import event_data
from services.control_plane.local_redis import LocalRedisServer
from services.engines import errors as engine_errors
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import DecodeRequest, PrefillResult, SamplingParams
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.e2e.faults.probes import load_of, metric, rank_pids, wait_until
from tests.e2e.up_system import UpSystem
from tests.integration.services.processes import ServiceProcess, start_service

pytestmark = [pytest.mark.e2e, pytest.mark.destructive, pytest.mark.slow]

MODEL = "tiny-model"
REQUEST_BOUND_S = 60.0
"""Client-side bound of every request; hitting it is a hang and fails the test."""
FAULT_BOUND_S = 20.0
"""Requests affected by a fault end (completed or with an explicit error) within this."""
LEASE_TTL_S = 10.0
"""The control plane's default lease TTL (``ControlPlaneSettings.lease_ttl_s``)."""
POOL_BOUND_S = 15.0
"""Block pools are full again within this once the requests ended."""
KV_LEASE_S = 30.0
"""The prefill engines' KV lease (the reference engine's default ``kv_lease_s``)."""
PREFILL_TIMEOUT_S = 10.0
"""The stack's router prefill deadline (``PDSERVE_ROUTER_PREFILL_TIMEOUT_S``)."""
DECODE_IDLE_TIMEOUT_S = 10.0
"""The stack's router decode idle bound (``PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S``)."""
SHORT_STALL_S = 3.0
"""Scenario 1's stall: well under both router bounds, even on a loaded 2-core box."""
REDIS_OUTAGE_S = 4.0
"""Scenario 7's Redis outage: well under the lease TTL and the producer views' max age."""


@dataclass
class Stack:
    up: UpSystem
    redis: LocalRedisServer
    model_dir: Path
    work_dir: Path
    extra: list[ServiceProcess] = field(default_factory=list)
    held: PrefillResult | None = None
    """A prefill of prefill-0's first generation whose KV handle scenario 5 holds for scenario 6."""

    def engine(self, name: str) -> dict[str, str]:
        engine: dict[str, str] = self.up.endpoints["engines"][name]
        return engine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    make_tiny_model(model_dir)
    work_dir = tmp_path_factory.mktemp("up-faults")
    with LocalRedisServer() as redis:
        up = UpSystem(
            work_dir,
            "--redis",
            redis.url,
            "--model",
            str(model_dir),
            "--decode-replicas",
            "2",
            "--no-restart",  # the scenarios kill engines and restart them by hand
            env={
                "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",
                "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": str(PREFILL_TIMEOUT_S),
                "PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S": str(DECODE_IDLE_TIMEOUT_S),
                "PDSERVE_ROUTER_MAX_MIGRATIONS": "0",
                "PDSERVE_ROUTER_CIRCUIT_BACKOFF_S": "1",
                "PDSERVE_ROUTER_CIRCUIT_MAX_BACKOFF_S": "2",
            },
        )
        system = Stack(up, redis, model_dir, work_dir)
        try:
            up.wait_ready()
            yield system
        finally:
            up.stop()
            for service in system.extra:
                service.kill_tree()


@dataclass
class Result:
    ok: bool
    decode_engine: str | None = None
    prefill_engine: str | None = None
    path: str | None = None
    error: str | None = None
    tokens: int = 0
    """Streamed events that carried text (the prefill's token is the first)."""
    started_at: float = 0.0
    ended_at: float = 0.0
    timed_out: bool = False


async def stream(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, result: Result | None = None
) -> Result:
    """One streaming completion with a hard bound; never raises."""
    result = result or Result(ok=False)
    result.started_at = time.monotonic()
    try:
        await asyncio.wait_for(_stream(client, prompt, max_tokens, result), REQUEST_BOUND_S)
    except TimeoutError:
        result.timed_out, result.error = True, "client timeout"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.ended_at = time.monotonic()
    return result


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, result: Result) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        result.decode_engine = reply.headers.get("x-pdserve-decode-engine")
        result.prefill_engine = reply.headers.get("x-pdserve-prefill-engine")
        result.path = reply.headers.get("x-pdserve-execution-path")
        if reply.status_code != 200:
            result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
            return
        finished = False
        async for data in event_data(reply):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = str(event["error"])
                return
            for choice in event.get("choices", []):
                if choice.get("text"):
                    result.tokens += 1
                finished = finished or bool(choice.get("finish_reason"))
        result.ok = finished
        if not finished:
            result.error = "stream ended without a finish reason"


def client_of(stack: Stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.up.url, timeout=REQUEST_BOUND_S)


async def under_load(
    stack: Stack, fault: object, *, workers: int = 6, before_s: float = 1.0, after_s: float = 3.0
) -> tuple[list[Result], float]:
    """Closed-loop load from ``workers`` clients; ``fault()`` runs ``before_s`` in, the load
    goes on ``after_s`` more. Returns every result and when the fault happened."""
    results: list[Result] = []
    stop = asyncio.Event()
    async with client_of(stack) as client:

        async def worker(index: int) -> None:
            count = 0
            while not stop.is_set():
                prompt = f"worker {index} request {count} " + "tokens move over the wire " * 8
                results.append(await stream(client, prompt, 16))
                count += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(workers)]
        await asyncio.sleep(before_s)
        assert callable(fault)
        fault()
        fault_at = time.monotonic()
        await asyncio.sleep(after_s)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 5)
    return results, fault_at


async def streams_reaching_decode_0(
    client: httpx.AsyncClient, label: str, *, min_tokens: int
) -> tuple[list[Result], list[asyncio.Task[Result]]]:
    """Six long streams (400 tokens each); returns once one of those the router sent to
    decode-0 has streamed ``min_tokens`` tokens, with every result and task."""
    results = [Result(ok=False) for _ in range(6)]
    prompts = [f"{label} stream {i} " + "decode keeps going " * 4 for i in range(6)]
    tasks = [
        asyncio.create_task(stream(client, prompt, 400, result))
        for prompt, result in zip(prompts, results, strict=True)
    ]
    deadline = time.monotonic() + FAULT_BOUND_S
    while not any(r.decode_engine == "decode-0" and r.tokens >= min_tokens for r in results):
        assert time.monotonic() < deadline, f"no stream got {min_tokens} token(s) from decode-0"
        await asyncio.sleep(0.05)
    return results, tasks


def assert_no_hang(results: list[Result]) -> None:
    assert results
    assert not [r for r in results if r.timed_out], "a request hit the client bound (a hang)"


async def wait_pool_full(grpc_target: str, bound_s: float = POOL_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while True:
        load = await load_of(grpc_target)
        if load.kv_blocks_free == load.kv_blocks_total and load.running_requests == 0:
            return
        assert time.monotonic() < deadline, f"{grpc_target} pool not full: {load}"
        await asyncio.sleep(0.2)


def only_rank(engine_pid: int) -> int:
    ranks = rank_pids(engine_pid)
    assert len(ranks) == 1, ranks
    return ranks[0]


def router_errors(stack: Stack) -> float:
    total = metric(f"{stack.up.url}/metrics", "pdserve_router_requests_total")
    ok = metric(f"{stack.up.url}/metrics", "pdserve_router_requests_total", outcome="ok")
    return total - ok


@contextlib.contextmanager
def resumed_at_exit(rank: int) -> Iterator[None]:
    """SIGCONT ``rank`` on the way out, whatever happened: a stopped rank left behind would
    break every later scenario and the stack's teardown."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGCONT)


def router_metric(stack: Stack, name: str, **labels: str) -> float:
    return metric(f"{stack.up.url}/metrics", name, **labels)


async def test_a_stopped_prefill_rank_delays_requests_but_loses_none(stack: Stack) -> None:
    rank = only_rank(int(stack.engine("prefill-0")["pid"]))
    stall_s = SHORT_STALL_S

    def pause() -> None:
        os.kill(rank, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(stall_s, os.kill, rank, signal.SIGCONT)

    with resumed_at_exit(rank):
        results, paused_at = await under_load(stack, pause, after_s=stall_s + 1)
    assert_no_hang(results)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    delayed = [r for r in results if r.ended_at > paused_at]
    assert delayed and all(r.ended_at - paused_at < stall_s + FAULT_BOUND_S for r in delayed)
    for name in ("prefill-0", "decode-0", "decode-1"):
        await wait_pool_full(stack.engine(name)["grpc"])


async def test_a_prefill_rank_stalled_past_the_deadline_falls_back_then_recovers(
    stack: Stack,
) -> None:
    prefill = stack.engine("prefill-0")
    rank = only_rank(int(prefill["pid"]))
    fallbacks_before = router_metric(stack, "pdserve_router_fallbacks_total")
    timeouts_before = router_metric(
        stack, "pdserve_router_engine_timeouts_total", call="prefill", bound="deadline"
    )
    aborts_before = router_metric(stack, "pdserve_router_aborts_total", role="prefill")
    errors_before = router_errors(stack)
    stall_s = PREFILL_TIMEOUT_S + 4

    def pause() -> None:
        os.kill(rank, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(stall_s, os.kill, rank, signal.SIGCONT)

    with resumed_at_exit(rank):
        results, paused_at = await under_load(stack, pause, after_s=stall_s + 1)
    assert_no_hang(results)
    affected = [r for r in results if r.ended_at > paused_at]
    assert affected
    # Nobody waits on the stopped rank for longer than the router's deadline (plus the bound).
    assert all(r.ended_at - r.started_at < PREFILL_TIMEOUT_S + FAULT_BOUND_S for r in affected)
    fell_back = [r for r in affected if r.ok and r.path == "local"]
    assert fell_back, "no request ran locally after its prefill timed out"
    timeouts = (
        router_metric(
            stack, "pdserve_router_engine_timeouts_total", call="prefill", bound="deadline"
        )
        - timeouts_before
    )
    fallbacks = router_metric(stack, "pdserve_router_fallbacks_total") - fallbacks_before
    # prefill-0 is the only prefill engine: every timed-out prefill runs locally, counted
    # (prefill_failed); after the first timeout its circuit is open and requests run locally
    # without trying it (prefill_circuit_open) until a probe after the back-off.
    assert timeouts >= 1
    assert fallbacks >= len(fell_back)
    assert router_metric(stack, "pdserve_router_aborts_total", role="prefill") > aborts_before
    # Requests whose KV pull waited on the stopped rank may end with an explicit error
    # (engine_timeout from the decode idle bound); each is counted by the router.
    failed = [r for r in affected if not r.ok]
    assert all(r.error for r in failed)
    wait_until(
        lambda: router_errors(stack) - errors_before >= len(failed),
        5,
        f"router counts the {len(failed)} failed request(s)",
    )
    # Resumed: the cancelled prefills and the router's aborts free every block it held.
    for name in ("prefill-0", "decode-0", "decode-1"):
        await wait_pool_full(stack.engine(name)["grpc"])
    async with client_of(stack) as client:
        again = await stream(client, "after the prefill stall " * 4, 8)
    assert again.ok and again.path == "disaggregated", (again.path, again.error)
    assert again.prefill_engine == "prefill-0"


async def test_a_decode_rank_stalled_mid_stream_ends_its_streams_within_the_idle_bound(
    stack: Stack,
) -> None:
    decode = stack.engine("decode-0")
    rank = only_rank(int(decode["pid"]))
    idle_before = router_metric(
        stack, "pdserve_router_engine_timeouts_total", call="decode", bound="idle"
    )
    errors_before = router_errors(stack)
    with resumed_at_exit(rank):
        async with client_of(stack) as client:
            # Mid-stream: decode-0 itself has sent tokens (the first one is the prefill's).
            results, tasks = await streams_reaching_decode_0(client, "stalled", min_tokens=3)
            os.kill(rank, signal.SIGSTOP)
            stopped_at = time.monotonic()
            # Resumed only once every stream ended: the router's idle bound must end them.
            await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 5)
    assert_no_hang(results)
    on_stalled = [r for r in results if r.decode_engine == "decode-0"]
    assert on_stalled
    for r in on_stalled:
        # vLLM's error event (the front end with a checkpoint): the router's words, status 504.
        # The idle bound ends every stream there: one that had decode-0's tokens waited for its
        # next; one still waiting for decode-0's first (a later stream, its KV pull or first
        # step not yet done at SIGSTOP) may only have the prefill's token (or one whose text
        # the detokenizer held back), so either wording fits it.
        assert not r.ok and r.error, r
        waited_for = "next token" if r.tokens >= 2 else "(first|next) token"
        assert re.search(f"sent no {waited_for} within decode_idle_timeout_s", r.error), r
        assert "504" in r.error, r.error
        assert r.ended_at - stopped_at < DECODE_IDLE_TIMEOUT_S + FAULT_BOUND_S
    assert all(r.ok for r in results if r.decode_engine == "decode-1")
    idle = (
        router_metric(stack, "pdserve_router_engine_timeouts_total", call="decode", bound="idle")
        - idle_before
    )
    assert idle >= len(on_stalled)
    wait_until(
        lambda: router_errors(stack) - errors_before >= len(on_stalled),
        5,
        f"router counts the {len(on_stalled)} timed-out stream(s)",
    )
    assert router_metric(stack, "pdserve_router_requests_total", outcome="engine_timeout") >= len(
        on_stalled
    )
    # Resumed: the cancelled streams and the aborts reached decode-0, its pool is full again.
    for name in ("decode-0", "decode-1", "prefill-0"):
        await wait_pool_full(stack.engine(name)["grpc"])
    # The router may still hold decode-0's load from a heartbeat sent during the stall (busy),
    # so it gets requests again once the next heartbeat says otherwise: poll, bounded. Each
    # round's prompts are new: a prompt decode-1 already served is placed there again by its
    # KV events (the decode engine holding the prompt wins), which would never reach decode-0.
    deadline = time.monotonic() + LEASE_TTL_S + 5
    async with client_of(stack) as client:
        for round_ in itertools.count():
            again = await asyncio.gather(
                *(stream(client, f"after the decode stall {round_}.{i} " * 3, 8) for i in range(4))
            )
            assert all(r.ok for r in again), [r.error for r in again]
            if any(r.decode_engine == "decode-0" for r in again):
                break
            assert time.monotonic() < deadline, "decode-0 served nothing after SIGCONT"


async def test_a_killed_decode_rank_ends_its_streams_with_an_error(stack: Stack) -> None:
    errors_before = router_errors(stack)
    decode_rank = only_rank(int(stack.engine("decode-0")["pid"]))
    async with client_of(stack) as client:
        results, tasks = await streams_reaching_decode_0(client, "long", min_tokens=1)
        os.kill(decode_rank, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 5)
    assert_no_hang(results)
    on_killed = [r for r in results if r.decode_engine == "decode-0"]
    assert on_killed and all(not r.ok and r.error for r in on_killed)
    assert all(r.ended_at - killed_at < FAULT_BOUND_S for r in on_killed)
    assert all(r.ok for r in results if r.decode_engine == "decode-1")
    assert router_errors(stack) - errors_before >= len(on_killed)
    wait_until(lambda: "decode-0 exited" in stack.up.output(), FAULT_BOUND_S, "decode-0 exit")
    # The router drops decode-0 (deregistered, or its lease runs out) and serves on decode-1.
    wait_until(
        lambda: (
            metric(f"{stack.up.url}/metrics", "pdserve_router_ready_engines", role="decode") == 1
        ),
        LEASE_TTL_S + 5,
        "router sees one decode engine",
    )
    async with client_of(stack) as client:
        after = await stream(client, "after the decode failure", 8)
    assert after.ok and after.decode_engine == "decode-1", after.error
    for name in ("prefill-0", "decode-1"):
        await wait_pool_full(stack.engine(name)["grpc"])


async def test_a_killed_prefill_rank_is_retried_locally_or_fails_explicitly(
    stack: Stack,
) -> None:
    prefill = stack.engine("prefill-0")
    # A KV handle of the current generation, held for scenario 6 (the restart).
    client = GrpcAioEngineClient(prefill["grpc"])
    try:
        held = await client.prefill(
            "held-before-restart", tuple(range(10, 60)), SamplingParams(max_tokens=8), timeout_s=30
        )
    finally:
        await client.close()
    assert held.kv_handle is not None
    stack.held = held
    rank = only_rank(int(prefill["pid"]))
    router = f"{stack.up.url}/metrics"
    fallbacks_before = metric(router, "pdserve_router_fallbacks_total")
    retries_before = metric(router, "pdserve_router_prefill_retries_total")
    errors_before = router_errors(stack)

    results, killed_at = await under_load(stack, lambda: os.kill(rank, signal.SIGKILL))
    assert_no_hang(results)
    affected = [r for r in results if r.ended_at > killed_at]
    assert affected
    assert all(r.ended_at - killed_at < FAULT_BOUND_S + 3 for r in affected)
    failed = [r for r in affected if not r.ok]
    assert all(r.error for r in failed)
    # Every request after the kill either ran locally (a counted fallback) or failed
    # with an explicit, counted error.
    fallbacks = metric(router, "pdserve_router_fallbacks_total") - fallbacks_before
    retries = metric(router, "pdserve_router_prefill_retries_total") - retries_before
    assert fallbacks + retries + router_errors(stack) - errors_before >= 1
    assert any(r.ok and r.path == "local" for r in affected)
    # Every request of this stack that runs locally is a fallback (no short-prompt or cached
    # rule applies), and every failed one is counted by the router (it counts once the
    # response ended, so its counter may trail the client by a moment).
    assert fallbacks >= len([r for r in affected if r.ok and r.path == "local"])
    wait_until(
        lambda: router_errors(stack) - errors_before >= len(failed),
        5,
        f"router counts the {len(failed)} failed request(s)",
    )
    wait_until(lambda: "prefill-0 exited" in stack.up.output(), FAULT_BOUND_S, "prefill-0 exit")
    await wait_pool_full(stack.engine("decode-1")["grpc"])


async def test_a_restarted_prefill_engine_gets_a_new_generation_and_refuses_old_handles(
    stack: Stack,
) -> None:
    held = stack.held
    if held is None or held.kv_handle is None:
        pytest.fail(
            "no KV handle held from prefill-0's first generation: "
            "test_a_killed_prefill_rank_is_retried_locally_or_fails_explicitly takes it and "
            "must run first (run the whole module, in file order)"
        )
    service = start_service(
        "prefill",
        engine_id="prefill-0",
        redis_url=stack.redis.url,
        namespace=str(stack.up.endpoints["namespace"]),
        work_dir=stack.work_dir,
        args=["--engine", "reference", "--model", str(stack.model_dir), "--metrics-port", "0"],
    )
    stack.extra.append(service)
    endpoints = service.wait_ready(120)
    assert endpoints.generation != held.kv_handle.generation
    decode = stack.engine("decode-1")
    refused_before = engine_failures(decode["metrics"])
    client = GrpcAioEngineClient(decode["grpc"])
    started = time.monotonic()
    try:
        request = DecodeRequest(
            "stale-handle",
            tuple(range(10, 60)),
            SamplingParams(max_tokens=8),
            kv_handle=held.kv_handle,
            first_token_id=held.first_token_id,
        )
        with pytest.raises(
            (
                engine_errors.UnknownKVHandle,
                engine_errors.ProducerUnavailable,
                engine_errors.KVTransferFailed,
                engine_errors.KVLeaseExpired,
            )
        ):
            async for _ in client.decode(request, timeout_s=REQUEST_BOUND_S):
                pass
    finally:
        await client.close()
    assert time.monotonic() - started < FAULT_BOUND_S
    assert engine_failures(decode["metrics"]) > refused_before
    wait_until(
        lambda: (
            metric(f"{stack.up.url}/metrics", "pdserve_router_ready_engines", role="prefill") == 1
        ),
        LEASE_TTL_S + 5,
        "router sees the new prefill-0",
    )
    async with client_of(stack) as http:
        fresh = await stream(http, "served by the new generation " * 4, 8)
    assert fresh.ok and fresh.path == "disaggregated" and fresh.prefill_engine == "prefill-0"
    await wait_pool_full(endpoints.grpc)
    await wait_pool_full(decode["grpc"])


def engine_failures(metrics_url: str) -> float:
    """Decode RPCs the engine service counted with an outcome other than ``ok``."""
    total = metric(metrics_url, "pdserve_engine_requests_total", rpc="Decode")
    return total - metric(metrics_url, "pdserve_engine_requests_total", rpc="Decode", outcome="ok")


async def test_a_redis_outage_under_load_is_ridden_out_then_everyone_reconverges(
    stack: Stack,
) -> None:
    router = f"{stack.up.url}/metrics"
    decode_metrics = stack.engine("decode-1")["metrics"]
    redis_errors_before = metric(router, "pdserve_control_plane_redis_errors_total") + metric(
        router, "pdserve_control_plane_watch_resyncs_total"
    )
    remembered_before = metric(
        decode_metrics, "pdserve_engine_producer_check_fallbacks_total", outcome="last_known"
    )
    exits_before = stack.up.output().count(" exited with status")
    assert stack.extra[0].endpoints.metrics is not None
    expired_before = metric(
        stack.extra[0].endpoints.metrics, "pdserve_kv_transfer_expired_leases_total"
    )
    times: dict[str, float] = {}
    restarts: list[asyncio.Task[None]] = []

    async def start_after_outage() -> None:
        await asyncio.sleep(REDIS_OUTAGE_S)
        await asyncio.to_thread(stack.redis.start)  # same port, no data: every key is lost
        times["back"] = time.monotonic()

    def outage() -> None:
        stack.redis.stop(remove_data=False)
        times["down"] = time.monotonic()
        restarts.append(asyncio.create_task(start_after_outage()))

    try:
        results, _ = await under_load(stack, outage, after_s=REDIS_OUTAGE_S + 3)
        await asyncio.wait_for(asyncio.gather(*restarts), FAULT_BOUND_S)
    finally:
        if not stack.redis.running:
            stack.redis.start()  # every later step (and the teardown) needs it
    assert_no_hang(results)
    assert all(r.ok or r.error for r in results), "a request ended without saying how"
    # Requests that ran entirely while Redis was down: disaggregated through the producer's
    # remembered view (counted on the decode engine), or an explicit error.
    during = [r for r in results if times["down"] < r.started_at and r.ended_at < times["back"]]
    assert during, "no request ran during the outage"
    completed = [r for r in during if r.ok]
    assert len(completed) * 2 > len(during), [r.error for r in during if not r.ok]
    assert [r for r in completed if r.path == "disaggregated"], "nothing disaggregated during it"
    assert (
        metric(
            decode_metrics, "pdserve_engine_producer_check_fallbacks_total", outcome="last_known"
        )
        > remembered_before
    )

    def serves() -> bool:
        async def once() -> bool:
            async with client_of(stack) as http:
                return (await stream(http, "after redis came back", 4)).ok

        return asyncio.run(once())

    await asyncio.to_thread(wait_until, serves, LEASE_TTL_S * 2, "served after Redis restart")
    # Everyone re-registered: both engines READY again within the lease TTL, none exited.
    await asyncio.to_thread(
        wait_until,
        lambda: (
            metric(router, "pdserve_router_ready_engines", role="prefill") == 1
            and metric(router, "pdserve_router_ready_engines", role="decode") == 1
        ),
        LEASE_TTL_S * 2,
        "engines READY again",
    )
    assert time.monotonic() - times["back"] < LEASE_TTL_S * 2
    assert stack.up.output().count(" exited with status") == exits_before
    assert service_alive(stack)
    assert (
        metric(router, "pdserve_control_plane_redis_errors_total")
        + metric(router, "pdserve_control_plane_watch_resyncs_total")
        > redis_errors_before
    )
    await wait_pool_full(stack.engine("decode-1")["grpc"])
    # Redis came back empty: until the producer registered again, the decode engines had
    # dropped it (peer_removed), so a transfer that ended then could not notify it. Its
    # blocks stay held until the lease ends, counted as expired: full within lease + bound,
    # and past the pool bound only through an expired lease.
    producer = stack.extra[0]
    started = time.monotonic()
    await wait_pool_full(producer.grpc, KV_LEASE_S + POOL_BOUND_S)
    if time.monotonic() - started > POOL_BOUND_S:
        producer_metrics = producer.endpoints.metrics
        assert producer_metrics is not None
        # The ranks relay their counters every metrics_interval_s (1 s), after the release.
        await asyncio.to_thread(
            wait_until,
            lambda: (
                metric(producer_metrics, "pdserve_kv_transfer_expired_leases_total")
                > expired_before
            ),
            POOL_BOUND_S,
            "blocks held past the pool bound: an expired lease counted",
        )


def service_alive(stack: Stack) -> bool:
    return all(service.process.poll() is None for service in stack.extra)
