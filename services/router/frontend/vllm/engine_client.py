"""vLLM's ``EngineClient`` over pdserve's executor: vLLM's OpenAI front end runs requests on PD.

The seam: above it, vLLM's serving classes (``OpenAIServingChat``, ``OpenAIServingCompletion``,
``OpenAIServingResponses``...) render the request (chat template, tools), build vLLM's
``SamplingParams`` and format the answer from ``RequestOutput``s, parsers included. Below it,
pdserve's :class:`~services.router.execution.Executor` places the prompt on a prefill and a
decode engine and streams token ids back, with failover, migration and counted fallbacks.
What crosses: a rendered prompt (token ids) and vLLM's ``SamplingParams`` going down, converted
once into pdserve's :class:`~services.engines.requests.SamplingParams` (the proto's spelling);
token ids, logprobs and the finish reason coming up as vLLM's ``EngineCoreOutput``.

:meth:`PdserveEngineClient.generate` is ``AsyncLLM.generate`` with the engine core replaced:
vLLM's ``InputProcessor`` validates the request (context length, token ids, sampling limits);
vLLM's ``OutputProcessor`` detokenizes, applies stop strings, builds logprobs and the
``RequestOutput``s in the requested ``output_kind``; ``n > 1`` fans out as vLLM's
``ParentRequest`` does (choice ``i`` seeded ``seed + i``), forked on engines that fork
(:mod:`services.router.execution.fork`). Engines also get the stop strings (so a non-streamed
request stops where the text does); the router's detokenizer decides where the text ends.

Each generation's :class:`~services.router.execution.generation.RunInfo`, and the code of a
router error it answers with, go to the :class:`HttpRequestRuns` in :data:`REQUEST_RUNS` when
the caller set one (the HTTP middleware that writes the ``x-pdserve-*`` headers and counts the
request).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from copy import copy
from http import HTTPStatus
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine import FinishReason as VllmFinish
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import PrefillStats
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

from services.engines.requests import FinishReason, SamplingParams, TokenLogprobs
from services.engines.sampling_fields import from_vllm
from services.router.errors import InvalidRequestError, RouterError
from services.router.execution.generation import ChunkStream, GenerationRequest, RunInfo
from services.router.frontend import trace_headers as trace_of
from services.router.frontend.engine_support import check_engines
from services.router.frontend.served_names import ServedNames
from services.router.frontend.vllm.config import Frontend
from services.router.frontend.vllm.lora import LoRAFanout, lora_refusal
from services.router.metrics import RouterMetrics
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HttpRequestRuns:
    """What the runs of one HTTP request left for its answer's headers and metrics."""

    infos: list[RunInfo] = dataclasses.field(default_factory=list)
    """Each choice's run, in the order they started."""
    error_code: str | None = None
    """The code of the first router error the request was answered with (its ``outcome``)."""
    metrics: RouterMetrics | None = None
    """The router's metrics (the request's ignored fields are counted there)."""


REQUEST_RUNS: contextvars.ContextVar[HttpRequestRuns | None] = contextvars.ContextVar(
    "pdserve_request_runs", default=None
)
"""Where :meth:`PdserveEngineClient.generate` leaves the runs of the HTTP request it serves."""

UNSUPPORTED_SAMPLING: dict[str, str] = {
    "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids",
    "thinking_token_budget": "thinking_token_budget",
    "logprob_token_ids": "logprob_token_ids",
    "prompt_logprob_token_ids": "prompt_logprob_token_ids",
    "prompt_logprob_start": "prompt_logprob_start",
    "extra_args": "vllm_xargs",
    "repetition_detection": "repetition_detection",
    "routed_experts_prompt_start": "routed_experts_prompt_start",
    "trace_decode_token_ids": "trace_decode_token_ids",
}
"""vLLM sampling fields that act in the engine and that pdserve's engine protocol does not carry
yet, each with the request parameter a client sets it by: a request that sets one to anything
but vLLM's default is refused (400 naming the parameter), never run without it."""

ROUTER_SIDE_SAMPLING: frozenset[str] = frozenset(
    {
        # The router fans ``n`` out as vLLM's ParentRequest does; vLLM's OutputProcessor in the
        # router applies the rest (or vLLM's input processor sets them from the request and the
        # tokenizer).
        "n",
        "detokenize",
        "output_kind",
        "stream_interval",
        "flat_logprobs",
        "output_text_buffer_length",
        "skip_clone",
        "_eos_token_id",
        "_all_stop_token_ids",
        "_bad_words_token_ids",
        "_watermarking_skipped",
        # vLLM's input processor resolves it against the router's config, which configures no
        # watermark: False, as on vLLM's server without one.
        "watermarking",
        # Derived by vLLM from ``prompt_logprobs``, which pdserve's engines get.
        "skip_reading_prefix_cache",
    }
)
"""vLLM sampling fields the router applies itself (or that follow from carried ones): never sent
to an engine, and never a reason to refuse. Every field of vLLM's ``SamplingParams`` is carried
(:mod:`services.engines.sampling_fields`), router-side, or in :data:`UNSUPPORTED_SAMPLING`;
``tests/unit/router/test_vllm_frontend.py`` holds vLLM's list to that."""

_VLLM_DEFAULTS: dict[str, Any] = {
    name: getattr(VllmSamplingParams(), name) for name in UNSUPPORTED_SAMPLING
}


HAND_OFF_ARGS = ("kv_transfer_params", "ec_transfer_params")
"""Request fields vLLM's front end passes in ``extra_args`` for vLLM's own PD connectors. pdserve
makes its own hand-off and never dials what a client names (``tests/security/test_ssrf.py``):
a client's are ignored, as unknown fields are, and counted in
``pdserve_router_ignored_fields_total``."""


def _unset(name: str, value: Any) -> bool:
    """Whether ``value`` leaves field ``name`` as vLLM's default (an empty collection too)."""
    return not value or value == _VLLM_DEFAULTS[name]


def _without_hand_off(params: Any) -> None:
    """Drop (and count) the client's hand-off fields from ``params.extra_args``."""
    extra = getattr(params, "extra_args", None)
    if not extra or not any(name in extra for name in HAND_OFF_ARGS):
        return
    dropped = [name for name in HAND_OFF_ARGS if name in extra]
    params.extra_args = {k: v for k, v in extra.items() if k not in HAND_OFF_ARGS} or None
    runs = REQUEST_RUNS.get()
    if runs is not None and runs.metrics is not None:
        new = runs.metrics.ignored(dropped)
        if new:
            logger.warning(
                "request fields ignored: pdserve makes its own KV hand-off (counted in "
                "pdserve_router_ignored_fields_total; logged once): %s",
                ", ".join(new),
            )


def engine_sampling(params: Any) -> SamplingParams:
    """pdserve's sampling parameters (the proto's spelling) for vLLM's ``SamplingParams`` of
    one choice, field by field as :mod:`services.engines.sampling_fields` maps them.
    Detokenization options stay in the router (vLLM's detokenizer runs here)."""
    for name, param in UNSUPPORTED_SAMPLING.items():
        if not _unset(name, getattr(params, name, None)):
            raise InvalidRequestError(
                f"{param} is not supported through pdserve's engines yet", param=param
            )
    return from_vllm(params)


def vllm_error(error: RouterError) -> Exception:
    """The vLLM exception vLLM's serving classes answer as ``error`` would be answered:
    a 400 names its parameter; every other status is kept. The request's
    :data:`REQUEST_RUNS` keeps ``error``'s code, the request's ``outcome``."""
    runs = REQUEST_RUNS.get()
    if runs is not None and runs.error_code is None:
        runs.error_code = error.code
    translated: Exception
    if isinstance(error, InvalidRequestError):
        translated = VLLMValidationError(error.message, parameter=error.param)
    else:
        translated = GracefulHTTPError(error.message, HTTPStatus(error.status_code))
    return translated


def _logprob_rows(
    rows: Iterable[TokenLogprobs],
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """vLLM's logprob rows: the chosen token first, then the most likely ones."""
    ids, values, ranks = [], [], []
    for row in rows:
        ids.append([row.token_id, *(token for token, _ in row.top)])
        values.append([row.logprob, *(value for _, value in row.top)])
        ranks.append(row.rank)
    return ids, values, ranks


class PdserveEngineClient(EngineClient):  # type: ignore[misc]  # (vLLM is untyped here)
    """vLLM's ``EngineClient`` (``vllm/engine/protocol.py``) over pdserve's executor."""

    def __init__(
        self, frontend: Frontend, runtime: RouterRuntime, names: ServedNames | None = None
    ) -> None:
        self.vllm_config = frontend.vllm_config
        self.model_config = frontend.vllm_config.model_config
        self.renderer = frontend.renderer
        self.input_processor = frontend.input_processor
        self.runtime = runtime
        self.model = frontend.served_model_name
        self.names = names if names is not None else ServedNames()
        """What a request's ``model`` runs on (the router's one name table, shared by every
        base model's client when several are served)."""
        self.names.add_base(self.model, self.model)
        self.loras = LoRAFanout(runtime.pool, self.names, runtime.metrics, self.model)
        self._outputs = OutputProcessor(frontend.renderer.tokenizer, log_stats=False)

    # --- what vLLM's serving classes call per request ---------------------------------------

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("pdserve's router has no engine process to die")

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Engines queue: the router admits every request (placement may still refuse it)."""

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """``AsyncLLM.generate``'s contract (see the module docstring): ``RequestOutput``s
        until one is finished; closing the generator aborts every choice on the engines."""
        arrival_s = time.perf_counter()
        if not (isinstance(prompt, dict) and "type" in prompt):
            raise TypeError("pdserve's engine client takes rendered prompts only")
        request = self.input_processor.process_inputs(
            request_id,
            prompt,
            sampling_params,
            supported_tasks=("generate",),
            arrival_time=time.time(),
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
            trace_headers=trace_headers,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            session_id=session_id,
            kv_hints=kv_hints,
        )
        if prompt_text is None:
            prompt_text, _, _ = extract_prompt_components(self.model_config, prompt)
        self.input_processor.assign_request_id(request)
        params = request.sampling_params
        _without_hand_off(params)
        children: list[tuple[Any, Any]] = []
        parent = None
        if params.n == 1:
            children.append((request, None))
        else:
            parent = ParentRequest(request)
            for index in range(params.n):
                child_id, child_params = parent.get_child_info(index)
                child = request if index == params.n - 1 else copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                children.append((child, parent))
        generations = self._generations(
            [child for child, _ in children],
            arrival_s,
            params.output_kind.name != "FINAL_ONLY",
            lora_request,
            trace_headers,
        )
        queue = RequestOutputCollector(params.output_kind, request.request_id)
        for index, (child, child_parent) in enumerate(children):
            self._outputs.add_request(child, prompt_text, child_parent, index, queue)
        infos = [RunInfo() for _ in children]
        runs = REQUEST_RUNS.get()
        if runs is not None:
            runs.infos.extend(infos)
        streams = self.runtime.executor.runs(generations, infos)
        taken = asyncio.Event()  # set each time the caller takes an output from ``queue``
        tasks = [
            asyncio.create_task(self._feed(child, stream, info, queue, taken))
            for (child, _), stream, info in zip(children, streams, infos, strict=True)
        ]
        try:
            finished = False
            while not finished:
                output = queue.get_nowait() or await queue.get()
                taken.set()
                finished = output.finished
                yield output
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._outputs.abort_requests(
                [parent.request_id] if parent is not None else [request.request_id],
                internal=True,
            )

    async def _feed(
        self, request: Any, stream: ChunkStream, info: RunInfo, queue: Any, taken: asyncio.Event
    ) -> None:
        """Turn one choice's chunks into ``EngineCoreOutput``s for vLLM's output processor;
        an error goes to the caller through ``queue``. Returns (closing ``stream``, which
        aborts the engines) once the output processor finished the choice. It reads the next
        chunk only once the caller took what ``queue`` holds (``taken``): a client that stops
        reading stops the engine's stream (backpressure), instead of the router merging every
        token it generates into ``queue``."""
        request_id = request.request_id
        first = True
        try:
            params = request.sampling_params
            stop_ids = set(params.stop_token_ids or ())
            eos = params.eos_token_id  # None with ignore_eos
            while True:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                output = EngineCoreOutput(
                    request_id=request_id, new_token_ids=list(chunk.token_ids)
                )
                if chunk.logprobs:
                    ids, values, ranks = _logprob_rows(chunk.logprobs)
                    output.new_logprobs = LogprobsLists(
                        np.array(ids, dtype=np.int64),
                        np.array(values, dtype=np.float32),
                        np.array(ranks, dtype=np.int64),
                    )
                if first:
                    first = False
                    output.prefill_stats = PrefillStats(
                        num_prompt_tokens=info.prompt_tokens,
                        num_computed_tokens=info.prompt_tokens - info.cached_tokens,
                        num_cached_tokens=info.cached_tokens,
                        num_cache_creation_tokens=info.cache_write_tokens,
                    )
                    if params.prompt_logprobs is not None and chunk.prompt_logprobs:
                        ids, values, ranks = _logprob_rows(chunk.prompt_logprobs)
                        output.new_prompt_logprobs_tensors = LogprobsTensors(
                            torch.tensor(ids, dtype=torch.int64).reshape(len(ids), -1),
                            torch.tensor(values, dtype=torch.float32).reshape(len(ids), -1),
                            torch.tensor(ranks, dtype=torch.int64),
                        )
                finish = chunk.finish_reason
                if finish is FinishReason.LENGTH:
                    output.finish_reason = VllmFinish.LENGTH
                elif finish is FinishReason.ABORT:
                    output.finish_reason = VllmFinish.ABORT
                elif finish is FinishReason.ERROR:  # (the executor raises these; defensive)
                    output.finish_reason = VllmFinish.ERROR
                elif finish is FinishReason.STOP and chunk.token_ids:
                    last = chunk.token_ids[-1]
                    if last == eos:
                        output.finish_reason = VllmFinish.STOP
                    elif last in stop_ids:
                        output.finish_reason = VllmFinish.STOP
                        output.stop_reason = last
                    # else: a stop string, which the detokenizer below finds
                result = self._outputs.process_outputs([output])
                if result.reqs_to_abort or output.finish_reason is not None:
                    return
                while queue.output is not None:
                    taken.clear()
                    await taken.wait()
            if self._outputs.has_request(request_id):
                # The engine ended the choice without a token that says so (a stop string
                # the router's detokenizer saw elsewhere, a continuation that was complete).
                self._outputs.process_outputs(
                    [
                        EngineCoreOutput(
                            request_id=request_id, new_token_ids=[], finish_reason=VllmFinish.STOP
                        )
                    ]
                )
        except RouterError as error:
            queue.put(vllm_error(error))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the caller answers it (vLLM: a 500)
            logger.exception("request %s failed in the router", request_id)
            queue.put(error)
        finally:
            await stream.aclose()

    def _generations(
        self,
        children: list[Any],
        arrival_s: float,
        stream: bool,
        lora_request: Any,
        trace_headers: Mapping[str, str] | None,
    ) -> list[GenerationRequest]:
        """The request's choices (vLLM's requests, ``children``) as pdserve runs them: its
        sampling in the engines' spelling, its trace context checked, what it is served by (the
        base model, or the adapter vLLM's front end resolved, ``lora_request``, in the router's
        name table); refused (as vLLM's error) when an engine that may serve it cannot honour
        it."""
        trace = trace_of.from_vllm(trace_headers, self.runtime.metrics)
        name = self.model if lora_request is None else str(lora_request.lora_name)
        served = self.names.resolve(name)
        if served is None:  # unloaded between vLLM's check and here
            raise GracefulHTTPError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND)
        try:
            generations = [
                GenerationRequest(
                    request_id=child.request_id,
                    model=served.model,
                    prompt_token_ids=tuple(child.prompt_token_ids),
                    sampling=engine_sampling(child.sampling_params),
                    arrival_s=arrival_s,
                    stream=stream,
                    trace=trace,
                    lora=served.adapter,
                )
                for child in children
            ]
            records = [
                slot.record
                for slot in self.runtime.pool.slots()
                if slot.record.model == served.model
            ]
            check_engines(records, generations[0].sampling)
            refusal = None if served.adapter is None else lora_refusal(records, served.name)
            if refusal is not None:
                raise InvalidRequestError(refusal, param="model", code="unsupported_parameter")
        except RouterError as error:
            raise vllm_error(error) from error
        return generations

    async def add_lora(self, lora_request: Any) -> bool:
        """vLLM's ``add_lora`` (``--lora-modules``, ``/v1/load_lora_adapter``): loaded on every
        engine of the adapter's base model (:class:`~.lora.LoRAFanout`)."""
        await self.loras.load(lora_request)
        return True

    # --- the rest of vLLM's EngineClient: not offered through the router -------------------

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._outputs.abort_requests(ids, internal=False)

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        if not self.runtime.pool.ready_models():
            raise RuntimeError("no READY engine")

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def shutdown(self, timeout: float | None = None) -> None:
        return None

    async def _not_served(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not offered by pdserve's router (an engine-side operation)")

    encode = start_profile = stop_profile = reset_mm_cache = reset_encoder_cache = _not_served
    reset_prefix_cache = sleep = release_kv_cache_memory = wake_up = _not_served
    is_sleeping = pause_generation = resume_generation = is_paused = _not_served
