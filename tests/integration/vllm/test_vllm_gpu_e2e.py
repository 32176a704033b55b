"""End to end on a GPU node: a PP=2 prefill and a PP=1 decode vLLM engine behind the control
plane (docs/vllm.md has the runbook). Skipped unless PDSERVE_GPU_TESTS=1 and
PDSERVE_VLLM_MODEL points at a local HF checkpoint (e.g. Qwen2.5-0.5B-Instruct) on a node with at
least 3 GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.base import EngineSpec
from services.control_plane.wire import EngineRole, EngineState
from services.engines.backend import DecodeRequest, EngineRegistration, SamplingParams
from services.engines.vllm.backend import VllmBackend, VllmEngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _spec(engine_id: str, role: EngineRole, backend: VllmBackend) -> EngineSpec:
    d = backend.describe()
    return EngineSpec(
        engine_id=engine_id,
        role=role,
        model=d.model,
        compat_hash=d.compat_hash,
        pp_size=d.pp_size,
        tp_size=d.tp_size,
        num_layers=d.num_layers,
        num_kv_heads=d.num_kv_heads,
        block_size=d.block_size,
        endpoint="127.0.0.1:0",
        engine_kind="vllm",
    )


async def test_pp2_prefill_hands_kv_to_pp1_decode_with_greedy_parity(
    control_plane: RedisControlPlane, cp_settings: ControlPlaneSettings
) -> None:
    model = Path(os.environ["PDSERVE_VLLM_MODEL"])
    prefill = VllmBackend(VllmEngineOptions(model, pp_size=2, gpu_memory_utilization=0.3))
    decode = VllmBackend(VllmEngineOptions(model, pp_size=1, gpu_memory_utilization=0.3))
    p_rec = await control_plane.register(_spec("vllm-prefill", EngineRole.PREFILL, prefill))
    d_rec = await control_plane.register(_spec("vllm-decode", EngineRole.DECODE, decode))
    async with control_plane.watch() as watcher:
        await prefill.start(
            EngineRegistration("vllm-prefill", p_rec.generation, EngineRole.PREFILL, cp_settings)
        )
        await decode.start(
            EngineRegistration("vllm-decode", d_rec.generation, EngineRole.DECODE, cp_settings)
        )
        await watcher.wait_for("vllm-prefill", EngineState.READY, 120)
        await watcher.wait_for("vllm-decode", EngineState.READY, 120)
    try:
        prompt = list(range(100, 164))
        sampling = SamplingParams(max_tokens=16)
        result = await prefill.prefill("req-1", prompt, sampling)
        assert result.kv_handle is not None
        tokens = [result.first_token_id]
        async for delta in decode.decode(
            DecodeRequest("req-1", tuple(prompt), sampling, result.kv_handle, result.first_token_id)
        ):
            tokens.extend(delta.token_ids)
        local = [
            t
            async for d in decode.decode(DecodeRequest("req-2", tuple(prompt), sampling))
            for t in d.token_ids
        ]
        assert tokens == local  # greedy: transferred KV gives the tokens local prefill gives
    finally:
        await prefill.stop()
        await decode.stop()
