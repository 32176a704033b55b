"""A secured ``pdserve up`` (reference engines, API key, Redis AUTH, DEBUG logs) end to end.

One system on the tiny checkpoint against a password-protected Redis, the password given in the
``--redis`` URL (the discouraged form: ``pdserve up`` must hand it to its children through
their environment, never their argv), with ``PDSERVE_ROUTER_API_KEYS`` set:

- API keys: a missing or wrong key gets 401 as vLLM's server answers it (the router serves
  vLLM's front end), counted ``invalid_api_key``; ``/health`` and ``/metrics`` stay
  open (probes and Prometheus scrape without a key; they reveal no secret).
- A client that disconnects from the router mid-stream: the request is cancelled on the decode
  engine (counted ``CANCELLED``), the router counts ``client_disconnected``, and both engines'
  KV pools return to full.
- A client that disconnects before its first token, while the prefill engine still works on it
  (its rank is held with SIGSTOP so the window is certain): the prefill is cancelled on the
  prefill engine, the decode engine never sees the request, and the pools return to full.
- Secrets: neither the API key nor the Redis password appears in any process's output (DEBUG
  logs of router, engines and ``pdserve up``), in error bodies, in ``pdserve status``, or in
  the command line of any process ``pdserve up`` started (``/proc/<pid>/cmdline`` is readable
  by every local user).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.control_plane.local_redis import LocalRedisServer
from services.engines.reference.tiny_model import make_tiny_model
from tests.e2e.faults.probes import metric, rank_pids
from tests.e2e.up_system import UpSystem, descendants, hang_up_mid_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-pdserve-9f3b71c2e0"
REDIS_PASSWORD = "redis-secret-5a8e44"  # a test secret that must never be printed
WRONG_KEY = "sk-wrong-key-31d7"
MODEL = "tiny-model"
SECRETS = (API_KEY, REDIS_PASSWORD)


@pytest.fixture(scope="module")
def redis() -> Iterator[LocalRedisServer]:
    with LocalRedisServer(password=REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis: LocalRedisServer) -> Iterator[UpSystem]:
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    make_tiny_model(model_dir)
    up = UpSystem(
        tmp_path_factory.mktemp("up-secured"),
        "--model",
        str(model_dir),
        "--redis",
        redis.url.replace("redis://", f"redis://:{REDIS_PASSWORD}@"),
        env={
            "PDSERVE_ROUTER_API_KEYS": json.dumps([API_KEY]),
            "PDSERVE_LOG_LEVEL": "DEBUG",
            "PDSERVE_ROUTER_LOG_LEVEL": "DEBUG",
            # Every prompt disaggregated, so both engines hold KV for the streamed request.
            "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",
        },
    )
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()


def _wait_pools_full(system: UpSystem, timeout_s: float = 30.0) -> dict[str, tuple[float, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        pools = {
            name: (
                metric(url, "pdserve_engine_kv_blocks_free"),
                metric(url, "pdserve_engine_kv_blocks_total"),
            )
            for name, url in system.endpoints["metrics"].items()
            if name != "router"
        }
        if all(free == total > 0 for free, total in pools.values()):
            return pools
        assert time.monotonic() < deadline, f"KV pools not back to full: {pools}"
        time.sleep(0.1)


def test_missing_or_wrong_api_key_gets_401_and_probes_stay_open(system: UpSystem) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    refused_before = metric(
        system.endpoints["metrics"]["router"],
        "pdserve_router_requests_total",
        outcome="invalid_api_key",
    )
    with httpx.Client(base_url=system.url, timeout=60) as client:
        missing = client.post("/v1/completions", json=body)
        wrong = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {WRONG_KEY}"}
        )
        models = client.get("/v1/models", headers={"Authorization": f"Basic {API_KEY}"})
        for response in (missing, wrong):
            # vLLM's server's answer (the router serves vLLM's front end and its --api-key
            # check), not the OpenAI error envelope
            assert response.status_code == 401, response.text
            assert response.json() == {"error": "Unauthorized"}
            assert WRONG_KEY not in response.text and API_KEY not in response.text
        assert models.status_code == 401
        ok = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert ok.status_code == 200, ok.text
        refused = metric(
            system.endpoints["metrics"]["router"],
            "pdserve_router_requests_total",
            outcome="invalid_api_key",
        )
        assert refused == refused_before + 2  # counted as a client's error, not a server's
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "pdserve_router_requests_total" in metrics.text
        assert not any(secret in metrics.text for secret in SECRETS)


def test_client_disconnecting_mid_stream_aborts_on_both_engines_and_frees_blocks(
    system: UpSystem,
) -> None:
    _wait_pools_full(system)
    router_metrics = system.endpoints["metrics"]["router"]
    decode_metrics = system.endpoints["metrics"]["decode-0"]
    cancelled_before = metric(decode_metrics, "pdserve_engine_requests_total", outcome="CANCELLED")
    disconnects_before = metric(
        router_metrics, "pdserve_router_requests_total", outcome="client_disconnected"
    )
    body = {
        "model": MODEL,
        "prompt": "The client goes away after a few tokens of this long answer",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    answered = hang_up_mid_stream(
        system.url, body, events=3, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert answered["x-pdserve-execution-path"] != "local"

    deadline = time.monotonic() + 30
    while (
        metric(decode_metrics, "pdserve_engine_requests_total", outcome="CANCELLED")
        <= cancelled_before
        or metric(router_metrics, "pdserve_router_requests_total", outcome="client_disconnected")
        <= disconnects_before
    ):
        assert time.monotonic() < deadline, "the disconnect was not counted as an abort"
        time.sleep(0.1)
    pools = _wait_pools_full(system)
    assert set(pools) == {"prefill-0", "decode-0"}


def test_client_disconnecting_during_the_prefill_cancels_it_before_any_decode(
    system: UpSystem,
) -> None:
    _wait_pools_full(system)
    router_metrics = system.endpoints["metrics"]["router"]
    prefill_metrics = system.endpoints["metrics"]["prefill-0"]
    decode_metrics = system.endpoints["metrics"]["decode-0"]

    def prefill_cancelled() -> float:
        return metric(
            prefill_metrics, "pdserve_engine_requests_total", rpc="Prefill", outcome="CANCELLED"
        )

    def decodes() -> float:
        return metric(decode_metrics, "pdserve_engine_requests_total", rpc="Decode")

    def in_flight_on_prefill() -> float:
        return metric(router_metrics, "pdserve_router_engine_inflight", engine="prefill-0")

    cancelled_before, decodes_before = prefill_cancelled(), decodes()
    disconnects_before = metric(
        router_metrics, "pdserve_router_requests_total", outcome="client_disconnected"
    )
    ranks = rank_pids(int(system.endpoints["engines"]["prefill-0"]["pid"]))
    assert len(ranks) == 1, ranks
    body = {
        "model": MODEL,
        "prompt": "The client gives up while this prompt is still being prefilled",
        "max_tokens": 50,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    url = httpx.URL(system.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    os.kill(ranks[0], signal.SIGSTOP)
    try:
        # A raw connection: the request is sent, no answer can come while the rank is stopped,
        # and closing the socket is the client hanging up.
        with socket.create_connection((url.host, url.port), timeout=30) as connection:
            connection.sendall(head + payload)
            deadline = time.monotonic() + 30
            while in_flight_on_prefill() < 1:
                assert time.monotonic() < deadline, "the router never called the prefill engine"
                time.sleep(0.05)
            # The router has issued the Prefill call; give it a moment to reach the engine (the
            # engine's host process runs, only its rank is stopped).
            time.sleep(1.0)
        # The router notices at once, stopped rank or not, and cancels its Prefill call.
        deadline = time.monotonic() + 30
        while (
            metric(router_metrics, "pdserve_router_requests_total", outcome="client_disconnected")
            <= disconnects_before
        ):
            assert time.monotonic() < deadline, "the router did not count the disconnect"
            time.sleep(0.1)
    finally:
        os.kill(ranks[0], signal.SIGCONT)
    # The engine aborts the request as soon as its (resumed) loop can, and counts it.
    deadline = time.monotonic() + 30
    while prefill_cancelled() <= cancelled_before:
        assert time.monotonic() < deadline, "the prefill was not cancelled on the engine"
        time.sleep(0.1)
    assert in_flight_on_prefill() == 0
    _wait_pools_full(system)
    assert decodes() == decodes_before  # the decode engine never saw the request


def test_secrets_never_appear_in_logs_errors_or_status(
    system: UpSystem, redis: LocalRedisServer
) -> None:
    processes = descendants(system.process.pid)
    # The router, two engines and their ranks at least.
    assert len(processes) >= 4, processes
    command_lines = {}
    for pid in processes:
        with contextlib.suppress(OSError):
            command_lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert any("--redis" in line for line in command_lines.values()), command_lines
    for pid, line in command_lines.items():
        assert REDIS_PASSWORD not in line, f"the Redis password is in the argv of {pid}"
        assert API_KEY not in line, f"the API key is in the argv of {pid}"
    base = [sys.executable, "-m", "services.cli.main", "status", "--redis", redis.url]
    env = {**os.environ, "PDSERVE_CONTROL_PLANE__REDIS__RETRY_ATTEMPTS": "1"}
    authed = subprocess.run(
        [*base, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, "PDSERVE_CONTROL_PLANE__REDIS__PASSWORD": REDIS_PASSWORD},
    )
    assert authed.returncode == 0, authed.stdout + authed.stderr
    assert {e["engine_id"] for e in json.loads(authed.stdout)["engines"]} == {
        "prefill-0",
        "decode-0",
    }
    refused = subprocess.run(
        base,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, "PDSERVE_CONTROL_PLANE__REDIS__PASSWORD": WRONG_KEY},
    )
    assert refused.returncode != 0
    assert "credentials" in refused.stdout + refused.stderr
    # The same secrets in a URL (discouraged, but accepted) are masked in what status prints.
    in_url = redis.url.replace("redis://", f"redis://:{REDIS_PASSWORD}@")
    url_run = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "status", "--redis", in_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert url_run.returncode == 0, url_run.stdout + url_run.stderr

    assert system.stop() == 0
    outputs = {"pdserve up": system.output()}
    for path in sorted((system.work_dir / "logs").glob("*")):
        outputs[path.name] = path.read_text(errors="replace")
    for label, run in (("status", authed), ("status refused", refused), ("status url", url_run)):
        outputs[label] = run.stdout + run.stderr
    assert len(outputs) >= 6, list(outputs)
    assert sum(len(text) for text in outputs.values()) > 1000  # DEBUG logs were written
    for name, text in outputs.items():
        for secret in (*SECRETS, WRONG_KEY):
            assert secret not in text, f"{secret[:6]}... appears in {name}"
