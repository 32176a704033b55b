"""The router through real processes (``pdserve up --engine stub``) with the ``openai`` client.

Stub engines answer instantly with deterministic tokens, so this checks the router's HTTP
surface, headers, API keys, metrics and retries across real gRPC and HTTP, fast, with each of
the router's gRPC clients (``h2``, the default, and ``grpcio``). Model output
(stop strings, sampling with seeds, PD vs colocated) is checked on the reference engine in
test_router_reference.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.up_system import UpSystem, no_processes_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "e2e-secret-key"
MODEL = "stub"


@pytest.fixture(scope="module", params=["h2", "grpcio"])
def system(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[UpSystem]:
    """The stack, once with each of the router's gRPC clients (the same tests pass on both)."""
    work_dir = tmp_path_factory.mktemp("up-stub")
    up = UpSystem(
        work_dir,
        "--engine",
        "stub",
        "--prefill-replicas",
        "2",
        "--no-restart",  # prefill-0 is killed below and must stay dead
        "--frontend-arg=--enable-prompt-tokens-details",  # usage's cached tokens, as vLLM's
        env={
            "PDSERVE_ROUTER_API_KEYS": f'["{API_KEY}"]',
            "PDSERVE_ROUTER_POLICY": "least_loaded",
            "PDSERVE_ROUTER_ENGINE_GRPC__CLIENT": request.param,
        },
    )
    try:
        up.wait_ready()
        assert up.metric("pdserve_router_engine_grpc_client", client=request.param) == 1
        yield up
    finally:
        pids = [engine["pid"] for engine in up.endpoints.get("engines", {}).values()]
        status = up.stop()
        assert status == 0, up.output()
        assert "stopped the embedded Redis" in up.output()
        assert no_processes_left(pids) == []


@pytest.fixture(scope="module")
def client(system: UpSystem) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key=API_KEY, max_retries=0)


def test_endpoints_file_names_the_router_and_every_metrics_url(system: UpSystem) -> None:
    metrics = system.endpoints["metrics"]
    assert set(metrics) == {"router", "prefill-0", "prefill-1", "decode-0"}
    for url in metrics.values():
        response = httpx.get(url, timeout=10)
        assert response.status_code == 200
        assert "pdserve_" in response.text


def test_completion_runs_on_a_prefill_and_a_decode_engine(
    client: openai.OpenAI, system: UpSystem
) -> None:
    tokens = (
        "pdserve_router_request_prompt_tokens_sum",
        "pdserve_router_request_generation_tokens_sum",
        "pdserve_router_request_prompt_tokens_count",
    )
    before = [system.metric(name) for name in tokens]
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello, world!", max_tokens=5, temperature=0
    )
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    # The router's token figures (what the planner reads) move by the request's usage.
    after = [system.metric(name) for name in tokens]
    usage = completion.usage
    assert [b - a for a, b in zip(before, after, strict=True)] == [
        usage.prompt_tokens,
        usage.completion_tokens,
        1,
    ]
    assert len(completion.choices[0].text.split()) == 5
    assert raw.headers["x-pdserve-prefill-engine"] in {"prefill-0", "prefill-1"}
    assert raw.headers["x-pdserve-decode-engine"] == "decode-0"
    assert system.metric("pdserve_router_execution_path_total", path="disaggregated") >= 1


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_completion_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert len("".join(pieces).split()) == 4
    assert usage is not None and usage.completion_tokens == 4 and usage.prompt_tokens > 0
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_models_and_health(system: UpSystem, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert httpx.get(f"{system.url}/health", timeout=10).status_code == 200


def test_errors_come_back_as_openai_errors(system: UpSystem, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="a", temperature=5)
    # n > 1 is served; n < 1 is not (vLLM's message, which names no param)
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.completions.create(model=MODEL, prompt="a", n=0)
    anonymous = openai.OpenAI(base_url=f"{system.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model=MODEL, prompt="a", max_tokens=2)
    raw = httpx.post(f"{system.url}/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert raw.status_code == 401, raw.text
    counted = {"endpoint": "/v1/completions", "outcome": "invalid_api_key"}
    assert system.metric("pdserve_router_requests_total", **counted) >= 2


def test_a_dead_prefill_engine_is_retried_elsewhere_and_counted(
    system: UpSystem, client: openai.OpenAI
) -> None:
    """prefill-0 dies (SIGKILL, its lease still valid for seconds): requests the router sends
    it fail to connect and are retried on prefill-1, each retry counted. Runs last: it kills an
    engine of the shared system."""
    before = system.metric(
        "pdserve_router_prefill_retries_total", phase="connect", reason="engine_unreachable"
    )
    os.killpg(system.endpoints["engines"]["prefill-0"]["pid"], signal.SIGKILL)
    for index in range(4):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"request {index}", max_tokens=3
        )
        assert raw.parse().choices[0].finish_reason == "length"
        assert raw.headers["x-pdserve-prefill-engine"] == "prefill-1"
    retries = system.metric(
        "pdserve_router_prefill_retries_total", phase="connect", reason="engine_unreachable"
    )
    assert retries - before >= 1
    assert system.metric("pdserve_router_execution_path_total", path="retried") >= 1
    assert "prefill-0 exited" in system.output()
