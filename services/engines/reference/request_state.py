"""One request's state in the reference scheduler, the step it plans, and its block arithmetic.

Plain data shared by the scheduler (:mod:`~services.engines.reference.scheduler`), its token rules
(:mod:`~services.engines.reference.outputs`) and its KV hand-off
(:mod:`~services.engines.reference.kv_handoff`); nothing here changes scheduler state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

import torch

from services.engines.errors import InvalidRequest
from services.engines.reference.batch import SequenceChunk
from services.engines.reference.messages import PullDone
from services.engines.reference.sampling import OutputText, make_generator
from services.engines.requests import (
    Fork,
    KVHandle,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    validate_prompt_length,
)
from services.topology.ranges import RankKey

RequestKind = Literal["generate", "prefill", "remote"]
SinkItem = PrefillResult | TokenDelta | BaseException


class RequestSink(Protocol):
    """Where a request's results go (the backend bridges it to the caller's event loop)."""

    def put(self, item: SinkItem) -> None: ...


class _DiscardSink:
    def put(self, item: SinkItem) -> None:
        pass


ABORTED: RequestSink = _DiscardSink()
"""The sink of a request aborted while its ranks still pull: its results go nowhere."""


class Phase(Enum):
    WAITING = "waiting"
    PULLING = "pulling"
    RUNNING = "running"
    HELD = "held"
    DONE = "done"


@dataclass(frozen=True)
class SchedulerLimits:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_batch_tokens: int
    max_running: int
    max_queue: int
    kv_lease_s: float
    kv_pull_timeout_s: float
    producer_connect_wait_s: float
    prefix_caching: bool = False

    def blocks_needed(self, kind: RequestKind, prompt_len: int, sampling: SamplingParams) -> int:
        """Worst-case blocks: the prompt, plus every generated token but the last (whose KV is
        never computed), capped by the context."""
        if kind == "prefill":
            tokens = prompt_len
        else:
            tokens = min(prompt_len + sampling.max_tokens - 1, self.max_model_len)
        return -(-max(tokens, 1) // self.block_size)

    def blocks_total(
        self, kind: RequestKind, prompt: Sequence[int], sampling: SamplingParams, forks: int
    ) -> int:
        """Worst-case blocks of a request and its further forks (each fork shares the
        prompt's full blocks)."""
        needed = self.blocks_needed(kind, len(prompt), sampling)
        if forks <= 1:
            return needed
        return needed + (forks - 1) * (needed - len(prompt) // self.block_size)

    def check(
        self,
        kind: RequestKind,
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        handle: KVHandle | None,
        first_token_id: int | None,
        forks: tuple[Fork, ...],
    ) -> None:
        """:class:`InvalidRequest` for a request of ``kind`` that these limits cannot run or
        that lacks what its kind needs (the scheduler's intake)."""
        validate_prompt_length(prompt, self.max_model_len)
        if kind == "remote" and (handle is None or first_token_id is None):
            raise InvalidRequest("a remote decode needs a kv_handle and a first_token_id")
        if forks and (kind != "remote" or forks[0].first_token_id != first_token_id):
            raise InvalidRequest("forks need a remote decode whose first_token_id is the first's")
        if sampling.n > 1 and kind != "prefill":
            raise InvalidRequest("n > 1 is for a prefill; a decode forks with forks")
        if self.blocks_total(kind, prompt, sampling, len(forks)) > self.num_blocks:
            raise InvalidRequest(
                f"request needs more KV blocks than the engine has ({self.num_blocks}); "
                "lower max_tokens"
            )


@dataclass(eq=False)
class EngineRequest:
    """One request's state in the scheduler."""

    request_id: str
    kind: RequestKind
    prompt: tuple[int, ...]
    sampling: SamplingParams
    sink: RequestSink
    text: OutputText
    generator: torch.Generator
    handle: KVHandle | None = None
    first_token_id: int | None = None
    phase: Phase = Phase.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    arrived_at: float = 0.0
    admitted_at: float = 0.0
    pull_started_at: float = 0.0
    kv_transfer_s: float | None = None
    pull_reports: dict[RankKey, PullDone] = field(default_factory=dict)
    lease_reports: dict[RankKey, str] = field(default_factory=dict)
    cancelled: bool = False
    """Aborted while ranks still work on its blocks (pull or lease): freed when they report."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With ``sampling.prompt_logprobs``: prompt tokens 1.. as their chunks are computed."""
    prompt_logprobs_sent: bool = False
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    cached_tokens_sent: bool = False
    """A local request's first delta said ``cached_tokens`` (:func:`~.outputs.token_delta`)."""
    cache_write_tokens: int = 0
    """Prompt tokens this request computed into full blocks the prefix cache took (vLLM's
    ``num_cache_creation_tokens``: full prompt blocks less the cached ones)."""
    choice: int = 0
    """The choice this sequence is (a fork's; tags its deltas)."""
    forks: tuple[Fork, ...] = ()
    """A remote request's further forks (``DecodeRequest.forks[1:]``), started once the pull
    succeeded; their blocks are :attr:`reserved` until then."""
    reserved: list[int] = field(default_factory=list)
    parent: str | None = None
    """A fork's: the id of the request it was forked from."""

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the next step must return every new token's logits (prompt logprobs)."""
        return (
            self.sampling.prompt_logprobs is not None
            and self.kind != "remote"
            and self.num_computed < len(self.prompt)
        )

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def pending_tokens(self) -> int:
        return len(self.prompt) + len(self.output) - self.num_computed


@dataclass(frozen=True)
class StepEntry:
    request: EngineRequest
    chunk: SequenceChunk


@dataclass(frozen=True)
class PlannedStep:
    entries: tuple[StepEntry, ...]

    @property
    def chunks(self) -> tuple[SequenceChunk, ...]:
        return tuple(entry.chunk for entry in self.entries)

    @property
    def all_tokens(self) -> bool:
        """Whether the ranks return logits for every new token (``[T, vocab]``) instead of
        each sequence's last: some request wants its prompt's logprobs."""
        return any(entry.request.wants_prompt_logprobs for entry in self.entries)


def forked(
    request: EngineRequest,
    fork: Fork,
    sampling: SamplingParams,
    text: OutputText,
    block_ids: list[int],
    num_computed: int,
) -> EngineRequest:
    """Fork ``fork`` of a pulled remote ``request``, running from its first token on
    ``block_ids`` (the first ``num_computed`` tokens' KV already there)."""
    return EngineRequest(
        request_id=f"{request.request_id}#{fork.choice}",
        kind="remote",
        prompt=request.prompt,
        sampling=sampling,
        sink=request.sink,
        text=text,
        generator=make_generator(sampling.seed),
        first_token_id=fork.first_token_id,
        phase=Phase.RUNNING,
        block_ids=block_ids,
        num_computed=num_computed,
        output=[fork.first_token_id],
        arrived_at=request.arrived_at,
        admitted_at=request.admitted_at,
        choice=fork.choice,
        parent=request.request_id,
    )
