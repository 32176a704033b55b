"""One generation as the router runs it: the request, the chunks it yields, what the run decided.

:class:`GenerationRequest` is built by the front end's engine client
(:mod:`services.router.frontend.vllm.engine_client`) and run by the executor
(:mod:`services.router.execution.executor`; for ``n > 1`` on engines that fork, each choice's
first leg is shared, :mod:`services.router.execution.fork`): it yields :class:`Chunk` and fills
a :class:`RunInfo`, which the front end turns into vLLM's outputs, headers, usage and metrics.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from services.engines.lora import LoRAAdapter
from services.engines.requests import FinishReason, SamplingParams, TokenLogprobs
from services.engines.trace_context import TraceContext
from services.router.scheduling.policies import PromptInfo


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_s: float
    """``time.perf_counter()`` when the HTTP request arrived."""
    stream: bool = True
    """Whether the client receives tokens as they come. A request that is not streamed decodes
    with one unary call (see :mod:`services.router.execution.engine_calls`)."""
    trace: TraceContext | None = None
    """The W3C trace context of the HTTP request (valid; ``None`` when it had none or an
    invalid one): every engine call of the request sends it as gRPC metadata."""
    lora: LoRAAdapter | None = None
    """The LoRA adapter the request runs with on every engine (prefill, decode, each leg);
    ``None``: the base model ``model``."""

    def prompt_info(self) -> PromptInfo:
        """The request as placement reads it (a fresh one per leg: its block hashes are
        cached)."""
        return PromptInfo(
            self.prompt_token_ids,
            context_tokens=len(self.prompt_token_ids) + self.sampling.max_tokens,
            lora_name=None if self.lora is None else self.lora.name,
        )


@dataclass(frozen=True)
class Chunk:
    """New output text and how many tokens produced it; the last one has ``finish_reason``."""

    text: str
    num_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token, when the request asked for logprobs."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """On the first chunk, when the request asked for prompt logprobs (tokens 1..)."""
    token_ids: tuple[int, ...] = ()
    """The ``num_tokens`` token ids (vLLM's front end detokenizes them itself)."""


@dataclass
class RunInfo:
    """What a run decided and measured, filled as it goes (headers, usage, metrics)."""

    path: str | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    """Prompt tokens the prefill (or local) engine wrote to its prefix cache (Usage)."""
    engine_wait_s: float = 0.0
    migrations: int = 0
    """Times the request moved to another engine pair mid-stream
    (services.router.execution.migration)."""


class ChunkStream(Protocol):
    """One choice's chunks, as the front end's engine client reads them: an executor run
    (:meth:`~services.router.execution.executor.Executor.generate`), wrapped as a
    :class:`~services.router.execution.fork.ForkedChoice` where its first leg is shared."""

    def __anext__(self) -> Coroutine[Any, Any, Chunk]: ...

    async def aclose(self) -> None: ...
