"""The simulated engine's backend in-process, its sleeps scaled to nothing (``time_scale=0``):
streams with the right tokens, simulated time that follows the profile, queueing seen in
``load()``, abort, drain, failure, and the registry and command line that build it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.cli.main import main
from services.engines.errors import EngineDraining, EngineFailed, EngineOverloaded
from services.engines.registry import EngineOptions, EngineOptionsError, create_backend
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    KVHandle,
    SamplingParams,
    TokenDelta,
)
from services.engines.sim import SimBackend, SimOptions, SimProfileError, load_profile
from services.engines.stub import StubBackend


def _backend(**options: object) -> SimBackend:
    return SimBackend(SimOptions(time_scale=0.0, **options))  # type: ignore[arg-type]


def _request(request_id: str, prompt_len: int, max_tokens: int) -> DecodeRequest:
    return DecodeRequest(
        request_id, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)
    )


async def _collect(backend: SimBackend, request: DecodeRequest) -> list[TokenDelta]:
    return [delta async for delta in backend.decode(request)]


async def test_a_colocated_stream_has_the_stub_tokens_and_the_profile_time() -> None:
    backend = _backend()
    profile = backend.options.profile
    deltas = await _collect(backend, _request("r1", 100, 5))
    tokens = [t for d in deltas for t in d.token_ids]
    first = (sum(range(1, 101)) + 100) % profile.model.vocab_size
    assert tokens == [first + i for i in range(5)]
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 5
    # One prefill step, then four decode steps of one sequence over a growing context.
    expected = profile.prefill_ms(100) + sum(
        profile.decode_step_ms(1, context) for context in range(101, 105)
    )
    assert backend.scheduler.clock_ms == pytest.approx(expected)
    assert backend.load().kv_blocks_free == backend.load().kv_blocks_total
    await backend.stop()


def _pulled(request_id: str, prompt_len: int, max_tokens: int) -> DecodeRequest:
    """A decode whose prompt a (simulated) prefill engine computed."""
    handle = KVHandle("sim-prefill", 1, request_id, (0,), prompt_len, lease_expires_at_s=0.0)
    request = _request(request_id, prompt_len, max_tokens)
    return DecodeRequest(
        request_id, request.prompt_token_ids, request.sampling, handle, first_token_id=7
    )


async def test_a_decode_from_a_handle_waits_for_the_kv_transfer_and_decodes_only() -> None:
    backend = _backend()
    profile = backend.options.profile
    deltas = await _collect(backend, _pulled("r1", 1000, 3))
    assert [t for d in deltas for t in d.token_ids] == [8, 9]  # after the producer's 7
    assert deltas[0].kv_transfer_s == pytest.approx(profile.transfer_ms(1000) / 1000)
    assert deltas[0].kv_transfer_s > 0
    # No prefill here: two decode steps of one sequence.
    expected = profile.decode_step_ms(1, 1001) + profile.decode_step_ms(1, 1002)
    assert backend.scheduler.clock_ms == pytest.approx(expected)
    # Aborted while its KV moves: it ends without being scheduled.
    stream = backend.decode(_pulled("r2", 1000, 3))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert await backend.abort("r2")
    assert (await first).finish_reason is FinishReason.ABORT
    assert backend.scheduler.clock_ms == pytest.approx(expected)
    await backend.stop()


async def test_requests_beyond_the_kv_pool_queue_and_show_in_the_load() -> None:
    backend = _backend(num_kv_blocks=10, block_size=16)
    first = backend.decode(_request("a", 100, 30))  # 7 blocks, growing to 9
    await anext(first)
    task = asyncio.create_task(_collect(backend, _request("b", 100, 2)))
    await asyncio.sleep(0)
    load = backend.load()
    assert (load.queue_depth, load.running_requests) == (1, 1)
    async for _ in first:
        pass
    deltas = await asyncio.wait_for(task, 10)
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert backend.load().kv_blocks_free == 10
    with pytest.raises(EngineOverloaded, match="more KV blocks"):
        await anext(backend.decode(_request("huge", 200, 2)))
    await backend.stop()


async def test_abort_ends_a_stream_and_drain_refuses_new_requests() -> None:
    backend = _backend()
    stream = backend.decode(_request("r1", 10, 1000))
    await anext(stream)
    assert await backend.abort("r1")
    deltas = [delta async for delta in stream]
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert not await backend.abort("r1")
    long = backend.decode(_request("r2", 10, 100_000))
    await anext(long)
    reader = asyncio.create_task(_drain_stream(long))
    assert await backend.drain(0.01) == 1
    assert (await reader) is FinishReason.ABORT
    with pytest.raises(EngineDraining):
        await anext(backend.decode(_request("r3", 10, 2)))
    await backend.stop()


async def _drain_stream(stream: object) -> FinishReason | None:
    last = None
    async for delta in stream:  # type: ignore[attr-defined]
        last = delta.finish_reason
    return last


async def test_a_failed_engine_fails_its_streams_and_says_so_to_the_host() -> None:
    backend = _backend()
    stream = backend.decode(_request("r1", 10, 100_000))
    await anext(stream)
    backend.fail("simulated rank death")
    with pytest.raises(EngineFailed, match="simulated rank death"):
        async for _ in stream:
            pass
    assert backend.failure is not None
    with pytest.raises(EngineFailed):
        await anext(backend.decode(_request("r2", 10, 2)))
    await backend.stop()


def test_the_registry_builds_sim_engines_from_a_profile_and_refuses_other_flags(
    tmp_path: Path,
) -> None:
    data = json.loads(load_profile().model_dump_json())
    data["layout"]["decode"]["pp_size"] = 2
    two_stages = tmp_path / "pp2.json"
    two_stages.write_text(json.dumps(data))
    backend = create_backend(
        "sim", EngineOptions(pp_size=2, num_kv_blocks=64, sim_profile=str(two_stages))
    )
    assert isinstance(backend, SimBackend)
    description = backend.describe()
    assert description.engine_kind == "sim" and description.shape.pp_size == 2
    assert description.model == load_profile().served_model
    block_bytes = load_profile().kv_bytes_per_token * description.shape.block_size
    assert description.kv_block_bytes == block_bytes
    assert backend.load().kv_blocks_total == 64
    assert backend.options.time_scale == 1.0
    slowed = create_backend("sim", EngineOptions(sim_time_scale=2.5))
    assert isinstance(slowed, SimBackend) and slowed.options.time_scale == 2.5
    with pytest.raises(EngineOptionsError, match="--sim-time-scale must be > 0"):
        create_backend("sim", EngineOptions(sim_time_scale=0))
    with pytest.raises(EngineOptionsError, match="does not take --sim-time-scale"):
        create_backend("stub", EngineOptions(sim_time_scale=2.0))
    with pytest.raises(SimProfileError, match="unknown sim profile"):
        create_backend("sim", EngineOptions(sim_profile="h999"))
    with pytest.raises(EngineOptionsError, match="--model"):
        create_backend("sim", EngineOptions(model_dir=Path(".")))
    with pytest.raises(EngineOptionsError, match="--max-model-len"):
        create_backend("sim", EngineOptions(max_model_len=100))
    with pytest.raises(EngineOptionsError, match="pace and vocabulary"):
        create_backend("sim", EngineOptions(stub_vocab_size=100))
    with pytest.raises(EngineOptionsError, match="--sim-profile"):
        create_backend("stub", EngineOptions(sim_profile="llama-3.1-8b-h100"))
    assert isinstance(create_backend("stub", EngineOptions()), StubBackend)


def test_a_profile_of_another_layout_is_refused_naming_both() -> None:
    with pytest.raises(SimProfileError, match=r"nim colocated PP=1 x TP=1.*PP=1 x TP=2"):
        create_backend("sim", EngineOptions(tp_size=2))


def test_a_bad_sim_profile_on_the_command_line_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["decode", "--engine", "sim", "--sim-profile", "nope"]) == 2
    assert "unknown sim profile 'nope'" in capsys.readouterr().err
