"""The vllm backend's load recorder is the one stat logger vLLM's ``AsyncLLM`` builds: vLLM adds
no Prometheus logger of its own (it recorded every engine step into a registry no endpoint of
the engine serves) and no logging one, and the recorder still keeps the engine's load.

vLLM's own ``StatLoggerManager`` is built here as ``AsyncLLM`` builds it from what the backend
passes (``stat_loggers`` and ``disable_log_stats``), over a configuration that holds only the
KV-cache size: any logger of vLLM's own would fail to build on it, or show in the list.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
from vllm.v1.metrics.stats import SchedulerStats

from services.engines.reference.tiny_model import make_tiny_model
from services.engines.vllm.backend import VllmBackend, load_recorder
from services.engines.vllm.options import VllmEngineOptions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def async_llm_arguments(backend: VllmBackend, stat_loggers: list[Any]) -> dict[str, Any]:
    """The keywords the backend builds ``AsyncLLM`` with (``from_vllm_config`` recorded)."""
    calls: list[dict[str, Any]] = []

    def from_vllm_config(vllm_config: Any, **kwargs: Any) -> str:
        calls.append(kwargs)
        return "engine"

    modules: Any = SimpleNamespace(
        async_llm=SimpleNamespace(AsyncLLM=SimpleNamespace(from_vllm_config=from_vllm_config))
    )
    args = SimpleNamespace(create_engine_config=lambda: "config")
    assert backend._start_async_llm(modules, args, stat_loggers) == "engine"
    (kwargs,) = calls
    return kwargs


def test_vllm_builds_the_load_recorder_and_no_stat_logger_of_its_own(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM adds its logging stat logger only when its logger would log at INFO.
    caplog.set_level(logging.INFO, logger="vllm.v1.metrics.loggers")
    backend = VllmBackend(VllmEngineOptions(model_dir))
    recorder = load_recorder(backend, PrometheusStatLogger)
    kwargs = async_llm_arguments(backend, [recorder])
    assert kwargs["stat_loggers"] == [recorder]
    # AsyncLLM: vLLM's default loggers only without disable_log_stats.
    manager = StatLoggerManager(
        SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=100)),
        custom_stat_loggers=kwargs["stat_loggers"],
        enable_default_loggers=not kwargs.get("disable_log_stats", False),
    )
    assert [type(logger) for logger in manager.stat_loggers] == [recorder]

    manager.record(
        scheduler_stats=SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25),
        iteration_stats=None,
        engine_idx=0,
    )
    manager.log()
    manager.record_sleep_state(0, 0)
    manager.record_admission_rejection("full")
    load = backend.load()
    assert (load.running_requests, load.queue_depth) == (3, 2)
    assert (load.kv_blocks_total, load.kv_blocks_free) == (100, 75)
