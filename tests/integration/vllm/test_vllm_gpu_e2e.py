"""End to end on a GPU node: a PP=2 prefill and a PP=1 decode vLLM engine behind the control
plane (docs/vllm.md has the runbook). Skipped unless PDSERVE_GPU_TESTS=1; PDSERVE_VLLM_MODEL must
point at a local HF checkpoint (e.g. Qwen2.5-0.5B-Instruct) on a node with at least 3 GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.requests import DecodeRequest, PrefillRequest, SamplingParams
from services.engines.standalone import registered_engine
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.options import VllmEngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

READY_TIMEOUT_S = 120.0


def _model_dir() -> Path:
    value = os.environ.get("PDSERVE_VLLM_MODEL")
    if not value:
        pytest.fail("set PDSERVE_VLLM_MODEL to a local HF checkpoint folder (see docs/vllm.md)")
    return Path(value)


async def test_pp2_prefill_hands_kv_to_pp1_decode_with_greedy_parity(
    cp_settings: ControlPlaneSettings,
) -> None:
    model = _model_dir()
    prefill_backend = VllmBackend(VllmEngineOptions(model, pp_size=2, gpu_memory_utilization=0.3))
    decode_backend = VllmBackend(VllmEngineOptions(model, pp_size=1, gpu_memory_utilization=0.3))
    async with (
        # Registered and heartbeaten as the engine host does (vLLM loads for longer than a
        # lease), started and READY; stopped and deregistered afterwards.
        registered_engine(
            cp_settings,
            prefill_backend,
            engine_id="vllm-prefill",
            role=EngineRole.PREFILL,
            ready_timeout_s=READY_TIMEOUT_S,
        ) as prefill,
        registered_engine(
            cp_settings,
            decode_backend,
            engine_id="vllm-decode",
            role=EngineRole.DECODE,
            ready_timeout_s=READY_TIMEOUT_S,
        ) as decode,
    ):
        prompt = list(range(100, 164))
        sampling = SamplingParams(max_tokens=16)
        result = await prefill.prefill(PrefillRequest("req-1", tuple(prompt), sampling))
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
