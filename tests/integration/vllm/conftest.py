"""vLLM's real config, request and scheduler classes on CPU, shared by the module's tests.

vLLM imports slowly (tens of seconds on a busy 2-core box): everything vLLM is imported once
per session, through these fixtures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.engines.reference.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vllm"))


@pytest.fixture(scope="session")
def vllm_modules() -> Any:
    """vLLM's config, scheduler and connector modules (imported once)."""
    from vllm import config  # noqa: PLC0415  (make test installs the vllm extra)

    return config


@pytest.fixture(scope="session")
def make_vllm_config(tiny_model_dir: Path, vllm_modules: Any) -> Any:
    """``make(pp=, tp=, role=, engine_id=, extra=)``: a real ``VllmConfig`` (tiny model, CPU)."""
    config = vllm_modules
    model_config = config.ModelConfig(
        model=str(tiny_model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256
    )

    def make(
        *,
        pp: int,
        tp: int,
        role: str,
        engine_id: str,
        extra: dict[str, Any],
        connector: str = "PdservePushConnector",
    ) -> Any:
        return config.VllmConfig(
            model_config=model_config,
            cache_config=config.CacheConfig(block_size=16),
            parallel_config=config.ParallelConfig(
                pipeline_parallel_size=pp, tensor_parallel_size=tp
            ),
            device_config=config.DeviceConfig("cpu"),
            scheduler_config=config.SchedulerConfig(
                max_model_len=256, is_encoder_decoder=False, max_num_batched_tokens=256
            ),
            kv_transfer_config=config.KVTransferConfig(
                kv_connector=connector,
                kv_connector_module_path="services.engines.vllm.connector",
                kv_role=role,
                engine_id=engine_id,
                kv_connector_extra_config=extra,
            ),
        )

    return make


@pytest.fixture(scope="session")
def kv_cache_config(vllm_modules: Any) -> Any:
    """One full-attention group over the tiny model's 7 layers (2 KV heads of 16, float32)."""
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(7)]
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
