"""A reference prefill engine (PP=2) whose registration the control plane lost republishes every
rank's handshake under a new generation without restarting: it turns READY at that generation,
a decode engine (real NIXL, its own rank process) re-connects and pulls from it, and a KV handle
of the old generation is refused."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane import ControlPlaneError, EngineState, RedisControlPlane
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineRegistration
from services.engines.errors import ProducerUnavailable
from services.engines.requests import FinishReason, PrefillRequest, SamplingParams
from tests.integration.engines.conftest import (
    PROMPTS,
    READY_TIMEOUT_S,
    collect,
    running_engine,
    wait_until_free,
)

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


async def test_republish_turns_ready_at_the_new_generation_and_decode_pulls_across_it(
    module_cp_settings: ControlPlaneSettings, tiny_model_dir: Path
) -> None:
    control_plane = RedisControlPlane(module_cp_settings)
    async with (
        running_engine(
            module_cp_settings,
            tiny_model_dir,
            engine_id="prefill-rp",
            role=EngineRole.PREFILL,
            pp=2,
        ) as prefill,
        running_engine(
            module_cp_settings, tiny_model_dir, engine_id="decode-rp", role=EngineRole.DECODE
        ) as decode,
    ):
        prompt = prefill.tokenizer.encode(PROMPTS[0])
        colocated, _ = await collect(decode, "colocated", prompt, GREEDY)
        old = await prefill.prefill(PrefillRequest("before", tuple(prompt), GREEDY))
        assert old.kv_handle is not None
        old_generation = old.kv_handle.generation

        # The control plane loses the registration (what a Redis restart without persistence
        # does to every key); the host registers the same spec again and republishes.
        assert prefill.registration is not None
        await control_plane.deregister("prefill-rp", old_generation)
        record = await control_plane.register(
            prefill.describe().spec("prefill-rp", EngineRole.PREFILL, "127.0.0.1:0")
        )
        assert record.generation > old_generation

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(module_cp_settings.heartbeat_interval_s)
                await control_plane.heartbeat("prefill-rp", record.generation, prefill.load())

        beating = asyncio.create_task(heartbeat())
        try:
            registration = EngineRegistration(
                "prefill-rp", record.generation, EngineRole.PREFILL, module_cp_settings
            )
            await asyncio.wait_for(prefill.republish(registration), READY_TIMEOUT_S)
            async with control_plane.watch() as watcher:
                await watcher.wait_for(
                    "prefill-rp", EngineState.READY, READY_TIMEOUT_S, generation=record.generation
                )
            topology = await control_plane.get_topology("prefill-rp")
            assert topology.engine.generation == record.generation
            assert sorted(topology.records) == [(0, 0), (1, 0)]  # both PP ranks republished
            assert {r.generation for r in topology.records.values()} == {record.generation}

            # New handles carry the new generation, and the decode engine pulls them.
            fresh = await prefill.prefill(PrefillRequest("after", tuple(prompt), GREEDY))
            assert fresh.kv_handle is not None
            assert fresh.kv_handle.generation == record.generation
            rest, deltas = await collect(
                decode,
                "after",
                prompt,
                GREEDY,
                kv_handle=fresh.kv_handle,
                first_token_id=fresh.first_token_id,
            )
            assert [fresh.first_token_id, *rest] == colocated
            assert deltas[0].kv_transfer_s is not None and deltas[0].kv_transfer_s > 0
            assert deltas[-1].finish_reason is FinishReason.LENGTH

            # A handle of the old generation is refused, never read.
            with pytest.raises(ProducerUnavailable, match="generation"):
                await collect(
                    decode,
                    "stale",
                    prompt,
                    GREEDY,
                    kv_handle=old.kv_handle,
                    first_token_id=old.first_token_id,
                )
            await prefill.abort("before")  # the old generation's held KV
            await wait_until_free(decode)
            await wait_until_free(prefill)
        finally:
            beating.cancel()
            try:
                # Only the cancellation is expected: a heartbeat that failed (the lease then
                # lapses under the test) raises its error here and fails the test.
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
            finally:
                with contextlib.suppress(ControlPlaneError):
                    await control_plane.deregister("prefill-rp", record.generation)
                await control_plane.close()
