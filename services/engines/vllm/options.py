"""What a vLLM engine is started with: :class:`VllmEngineOptions`, the control-plane description
read from the checkpoint's ``config.json`` (:func:`describe_model`), the connector's settings and
vLLM's ``KVTransferConfig`` (:func:`kv_transfer_config`), and how vLLM runs the model's graphs
(:func:`graph_args`). Imports nothing of vLLM (unit-tested on CPU)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.control_plane.wire import (
    KV_LAYOUT_HNC,
    EngineRole,
    compute_compat_hash,
)
from services.engines.backend import (
    BackendDescription,
    EngineRegistration,
    kv_block_bytes,
)
from services.engines.errors import (
    ModelConfigError,
)
from services.engines.vllm.handshake import ConnectorSettings
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    VllmLayout,
    check_local_layout,
)
from services.engines.vllm.platform import Platform, installed_platform
from services.topology import ModelShape

GPU_BLOCK_SIZE = 16
"""vLLM's default block size on GPUs."""
CPU_BLOCK_SIZE = 128
"""vLLM's default block size on CPUs (its CPU attention needs a multiple of 32)."""
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
StartMethod = Literal["fork", "spawn"]
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
"""Where vLLM reads the start method of its processes (``vllm.utils.system_utils``)."""
_CONNECTOR_CLASS = {
    TransferMode.PUSH: "PdservePushConnector",
    TransferMode.PULL: "PdservePullConnector",
}
_ROLE = {
    EngineRole.PREFILL: KVRole.PRODUCER,
    EngineRole.DECODE: KVRole.CONSUMER,
    EngineRole.BOTH: KVRole.BOTH,
}


@dataclass(frozen=True)
class VllmEngineOptions:
    """Options of one vLLM engine (from the service's flags)."""

    model_dir: Path
    """A local HF checkpoint folder (no downloads at run time)."""
    model_name: str | None = None
    pp_size: int = 1
    tp_size: int = 1
    transfer_mode: TransferMode = TransferMode.PUSH
    block_size: int | None = None
    """Tokens per KV block; ``None``: 16 on GPUs, 128 on CPUs (vLLM's CPU attention needs a
    multiple of 32)."""
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    """The KV cache size; ``None``: a share of GPU memory (``gpu_memory_utilization``) on GPUs,
    :data:`DEFAULT_CPU_KV_CACHE_BYTES` on CPUs (vLLM's CPU default is a share of all RAM)."""
    dtype: str = "auto"
    kv_lease_s: int = 30
    """How long a producer holds a request's KV for its consumer (vLLM's ``kv_lease_duration``)."""
    speculative_config: dict[str, Any] | None = None
    enforce_eager: bool = False
    otlp_traces_endpoint: str | None = None
    """Where vLLM exports its OpenTelemetry request spans (vLLM's ``--otlp-traces-endpoint``);
    ``None``: no tracing, and the trace context a request carries is not handed to vLLM."""
    kv_events: bool = True
    """Have vLLM publish its KV-cache events (:func:`kv_events_config`; prefix caching on)."""
    start_method: StartMethod | None = None
    """How vLLM starts its engine core and workers; ``None``: vLLM's choice (``spawn`` on CPUs,
    ``fork`` on GPUs unless a GPU runtime is already initialized). pdserve's engine host asks
    for ``fork`` (``pdserve prefill|decode --start-method``, docs/vllm.md): it has vLLM loaded
    and has run no torch kernel, so there is no OpenMP pool for a child to inherit broken. A
    process that may have run one (a test process that made a model) must not fork."""

    max_loras: int = 0
    """LoRA adapters vLLM runs at once in a batch (vLLM's ``--max-loras``; it then runs with
    ``enable_lora``); 0 = no LoRA: the engine registers no slots and refuses adapters."""
    max_lora_rank: int = 16
    """The largest adapter rank vLLM accepts (``--max-lora-rank``: 1, 8, 16, 32, 64...)."""
    max_cpu_loras: int | None = None
    """Adapters vLLM keeps loaded (its LRU evicts beyond); ``None``: ``max_loras``."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """``(name, path)`` of adapters loaded at start (``--lora-modules name=path``), before the
    engine registers as READY."""

    def served_model_name(self) -> str:
        return self.model_name or Path(self.model_dir).resolve().name

    def resolved_block_size(self, platform: Platform) -> int:
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if platform is Platform.CPU else GPU_BLOCK_SIZE


def graph_args(options: VllmEngineOptions, platform: Platform, config: Any) -> dict[str, Any]:
    """How vLLM runs the model (``config``: the ``vllm.config`` module): compiled by default;
    ``enforce_eager`` without compiled graphs. On a CPU with PP > 1, vLLM 0.32.0's eager mode
    skips the worker's warm-up run when the KV cache size is explicit (it always is here), and
    that run is what allocates the buffers a later PP stage receives its inputs in: the first
    request kills the engine (``assert self.intermediate_tensors is not None``). There, Dynamo
    traces the model once and runs it eagerly (vLLM's own CPU CI setting: no inductor compile,
    the warm-up kept)."""
    if not options.enforce_eager:
        return {}
    if platform is Platform.CPU and options.pp_size > 1:
        mode = config.CompilationMode.DYNAMO_TRACE_ONCE
        return {"compilation_config": config.CompilationConfig(mode=mode, backend="eager")}
    return {"enforce_eager": True}


def lora_args(options: VllmEngineOptions) -> dict[str, Any]:
    """vLLM's LoRA engine arguments: none without slots (``max_loras == 0``)."""
    if options.max_loras <= 0:
        return {}
    return {
        "enable_lora": True,
        "max_loras": options.max_loras,
        "max_lora_rank": options.max_lora_rank,
        "max_cpu_loras": options.max_cpu_loras,
    }


def read_model_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return raw


def describe_model(options: VllmEngineOptions) -> BackendDescription:
    """The control-plane spec fields, from ``config.json`` alone."""
    config = read_model_config(options.model_dir)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_size = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        vocab = int(config["vocab_size"])
        max_len = int(options.max_model_len or config.get("max_position_embeddings", 2048))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"config.json lacks a field vLLM needs: {exc}") from exc
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    dtype = options.dtype if options.dtype != "auto" else str(config.get("torch_dtype", "bfloat16"))
    model = options.served_model_name()
    platform = installed_platform()
    shape = ModelShape(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=dtype,
        vocab_size=vocab,
        max_model_len=max_len,
        block_size=options.resolved_block_size(platform),
        pp_size=options.pp_size,
        tp_size=options.tp_size,
    )
    return BackendDescription(
        model=model,
        compat_hash=compute_compat_hash(
            shape, model=model, kv_layout=KV_LAYOUT_HNC, engine_kind="vllm"
        ),
        shape=shape,
        eos_token_ids=eos_ids,
        pp_aware=True,
        engine_kind="vllm",
        kv_block_bytes=kv_block_bytes(shape),
        max_loras=max(0, options.max_loras),
    )


def connector_settings(
    options: VllmEngineOptions, registration: EngineRegistration, compat_hash: str
) -> ConnectorSettings:
    """The settings pdserve's connector in vLLM's processes gets for this engine
    (``compat_hash``: its :func:`describe_model`'s)."""
    return ConnectorSettings(
        registration.engine_id,
        registration.generation,
        registration.control_plane,
        options.transfer_mode,
        compat_hash,
    )


def kv_transfer_config(
    options: VllmEngineOptions, registration: EngineRegistration, compat_hash: str
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for this engine: pdserve's connector, role, generation
    (``compat_hash``: its :func:`describe_model`'s)."""
    role = _ROLE[registration.role]
    check_local_layout(VllmLayout(role, options.transfer_mode, options.pp_size, options.tp_size))
    settings = connector_settings(options, registration, compat_hash)
    extra = settings.to_extra_config()
    extra["kv_lease_duration"] = options.kv_lease_s
    return {
        "kv_connector": _CONNECTOR_CLASS[options.transfer_mode],
        "kv_connector_module_path": "services.engines.vllm.connector",
        "kv_role": role.value,
        "engine_id": settings.vllm_engine_id,
        "kv_connector_extra_config": extra,
    }


def kv_events_config(events_port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's ``kv_events_config``: its ZMQ publisher (``ZmqEventPublisher``, in the engine core:
    one per engine whatever its PP x TP) bound on every interface at ``events_port``, with
    the replay endpoint at ``replay_port`` (both chosen free before launch; the record
    advertises them at the host's address)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
