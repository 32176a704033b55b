"""Simulated engines (``--engine sim``) behind the real router: a sim prefill and a sim decode
engine hosted in-process (real gRPC servers, real Redis control plane) turn READY, and a
streamed completion crosses the router with the right number of tokens, taking at least the
time the profile gives its steps (a lower bound: load only adds), while each engine's simulated
clock equals the profile's figure for what it computed. Colocated, a long prompt arriving
mid-stream lengthens one of the stream's steps by its prefill (the interference PD removes)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import pytest

from services.bench.sse import completion_events, event_data
from services.bench.trace import SHIPPED_TRACE, add_arguments, load_workload, replay
from services.bench.trace_figures import summarize
from services.bench.trace_file import oracle_tokens
from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.requests import DecodeRequest, FinishReason, SamplingParams
from services.engines.sim import SimBackend, SimOptions, load_profile
from services.router.config import RouterSettings
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

PROMPT_LEN = 512
MAX_TOKENS = 20


async def test_a_stream_through_the_router_follows_the_profile(
    cp_settings: ControlPlaneSettings, sim_checkpoint: Path
) -> None:
    profile = load_profile()
    prefill, decode = SimBackend(SimOptions(profile)), SimBackend(SimOptions(profile))
    settings = service_settings(cp_settings)
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=sim_checkpoint,
        served_model_name=profile.served_model,
        prefill_timeout_s=10,
        decode_timeout_s=10,
    )
    body = {
        "model": profile.served_model,
        "prompt": [1 + i % 250 for i in range(PROMPT_LEN)],  # byte tokens of the checkpoint
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    async with (
        hosted(settings, prefill, engine_id="sim-prefill", role=EngineRole.PREFILL),
        hosted(settings, decode, engine_id="sim-decode", role=EngineRole.DECODE),
        serving_router(router) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [profile.served_model]
        started = time.monotonic()
        texts: list[str] = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["x-pdserve-prefill-engine"] == "sim-prefill"
            assert response.headers["x-pdserve-decode-engine"] == "sim-decode"
            async for event in completion_events(response):
                texts.extend(c["text"] for c in event["choices"])
        elapsed_ms = (time.monotonic() - started) * 1000
        assert len("".join(texts).split()) == MAX_TOKENS

    # The prefill engine ran one step of the whole prompt; the decode engine one step per
    # token after the producer's first, a batch of one over a growing context.
    prefill_ms = profile.prefill_ms(PROMPT_LEN)
    decode_ms = sum(
        profile.decode_step_ms(1, PROMPT_LEN + 1 + step) for step in range(MAX_TOKENS - 1)
    )
    assert prefill.scheduler.clock_ms == pytest.approx(prefill_ms)
    assert decode.scheduler.clock_ms == pytest.approx(decode_ms)
    # Between them the prompt's KV moved over the profile's link, before the decode began.
    assert elapsed_ms >= prefill_ms + profile.transfer_ms(PROMPT_LEN) + decode_ms


async def test_colocated_a_new_prompt_lengthens_the_running_streams_step(
    cp_settings: ControlPlaneSettings, sim_checkpoint: Path
) -> None:
    """A colocated router on one sim decode engine: a long prompt that arrives while a stream
    decodes is prefilled in the stream's steps (chunked prefill), so one of the stream's steps
    takes at least the whole prompt's prefill time; every step it would take alone is short."""
    profile = load_profile()
    decode = SimBackend(SimOptions(profile))
    settings = service_settings(cp_settings)
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=sim_checkpoint,
        served_model_name=profile.served_model,
        colocated=True,
        prefill_timeout_s=10,
        decode_timeout_s=30,
    )

    def body(
        prompt_len: int, max_tokens: int, *, stream: bool, first: int = 1
    ) -> dict[str, object]:
        # (another first token: a prompt that shares no cached prefix with the others)
        prompt = [1 + (first - 1 + i) % 250 for i in range(prompt_len)]
        return {
            "model": profile.served_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": stream,
        }

    long_prompt = 4000
    async with (
        hosted(settings, decode, engine_id="sim-colocated", role=EngineRole.DECODE),
        serving_router(router) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        # 2000 tokens: at least 9 s of simulated decode, and wall time is never shorter.
        first = body(PROMPT_LEN, 2000, stream=True)
        async with client.stream("POST", "/v1/completions", json=first) as streaming:
            assert streaming.status_code == 200
            assert streaming.headers["x-pdserve-execution-path"] != "disaggregated"
            events = event_data(streaming)  # held: closing it would end the stream
            await anext(events)
            second = await client.post(
                "/v1/completions", json=body(long_prompt, 2, stream=False, first=8)
            )
            assert second.status_code == 200, second.text
            assert second.json()["usage"]["completion_tokens"] == 2
            assert decode.load().running_requests == 1  # the first is still decoding
        # Closing the stream aborted the first request.

    alone_longest = profile.decode_step_ms(2, PROMPT_LEN + 2000 + long_prompt + 2)
    assert decode.scheduler.stats.mixed_steps >= 1
    assert decode.scheduler.stats.longest_decode_step_ms >= profile.prefill_ms(long_prompt)
    assert profile.prefill_ms(long_prompt) > 10 * alone_longest


async def test_a_failed_sim_engine_ends_its_stream_and_its_host_exits_1(
    cp_settings: ControlPlaneSettings,
) -> None:
    settings = service_settings(cp_settings)
    backend = SimBackend(SimOptions(load_profile()))
    async with hosted(settings, backend, engine_id="sim-dies", role=EngineRole.DECODE) as dec:
        client = GrpcAioEngineClient(dec.endpoints.grpc)
        request = DecodeRequest("req-1", (1, 2, 3), SamplingParams(max_tokens=100_000))
        stream = client.decode(request)
        first = await anext(stream)
        assert first.token_ids
        backend.fail("simulated GPU fault")
        last = first
        async for delta in stream:
            last = delta
        assert last.finish_reason is FinishReason.ERROR
        assert await dec.exit_code() == 1
        await client.close()


async def test_a_trace_replayed_through_the_router_finds_its_reuse_cached(
    cp_settings: ControlPlaneSettings, sim_checkpoint: Path
) -> None:
    """``pdserve bench trace``'s replay and figures over the shipped synthetic trace's first
    requests (20 times faster, 4 tokens each) on a sim prefill and a sim decode engine: the
    engines' prefix caches hold what the trace reuses and the answers say so. Fails when the
    bench's headline figure, the cached share, goes to zero (engines that cache nothing, usage
    that reports nothing)."""
    profile = load_profile()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--max-requests", "20", "--time-scale", "0.05", "--max-output-tokens", "4"]
    args = parser.parse_args([str(SHIPPED_TRACE), *flags])
    workload = load_workload(args, profile)
    capacity = profile.kv_cache.num_blocks * profile.kv_cache.block_size
    oracle = oracle_tokens(workload.requests, 1, capacity, engine_block=profile.kv_cache.block_size)
    prefill, decode = SimBackend(SimOptions(profile)), SimBackend(SimOptions(profile))
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=sim_checkpoint,
        served_model_name=profile.served_model,
        frontend_args=["--enable-prompt-tokens-details"],
    )
    settings = service_settings(cp_settings)
    async with (
        hosted(settings, prefill, engine_id="sim-trace-prefill", role=EngineRole.PREFILL),
        hosted(settings, decode, engine_id="sim-trace-decode", role=EngineRole.DECODE),
        serving_router(router) as url,
    ):
        sent = await replay(args, url, profile.served_model, workload, oracle)
    figures = summarize(sent, args, elapsed_s=1.0)
    assert figures["errors"] == 0, figures["first_errors"]
    assert figures["reusable_tokens"] > 0, figures
    # One prefill engine holds every prefix (arrivals while a prefix is still computing
    # miss it): most of the reuse is found, and reported.
    assert figures["cached_share"] > 0.5 and not figures["problems"], figures
