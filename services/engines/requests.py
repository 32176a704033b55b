"""The engine requests and responses: what a host asks of an engine and what it answers.

:class:`PrefillRequest` / :class:`DecodeRequest` and their :class:`SamplingParams` go in;
:class:`PrefillResult` (with its :class:`KVHandle`) and a stream of :class:`TokenDelta` come
out. Each request is validated once, by the host, against the engine's :class:`RequestLimits`
(:func:`validate_prompt`, :meth:`SamplingParams.validate`); everything after trusts it. The
seam these travel through is :class:`~services.engines.backend.EngineBackend`; the wire
conversions are :mod:`services.serving.wire`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from services.control_plane.wire import EngineId, Generation
from services.engines.errors import InvalidRequest, LoRANotServed
from services.engines.lora import LoRAAdapter
from services.engines.trace_context import TraceContext

if TYPE_CHECKING:
    from services.engines.backend import BackendDescription

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
"""Most top logprobs per token (``logprobs`` / ``prompt_logprobs``), vLLM's default
``max_logprobs``."""
MAX_LOGIT_BIAS = 1024
MAX_N = 128
"""Most choices of one prefill (``SamplingParams.n``) and forks of one decode."""
MAX_STRUCTURED_OUTPUTS_CHARS = 256 * 1024
"""Bound of ``SamplingParams.structured_outputs`` (a JSON schema or grammar)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (``top_p``/``top_k`` then ignored).

    ``seed`` makes a sampled request reproducible on any layout: the engine draws from a
    generator seeded per request, never from a shared one. ``stop`` strings end generation
    when the detokenized output contains one (the stop string is not returned);
    ``stop_token_ids`` end it on those ids (the id is not returned); EOS ends it unless
    ``ignore_eos``.

    The rest follow vLLM's ``SamplingParams``: ``presence_penalty`` / ``frequency_penalty``
    (OpenAI's, over the output so far) and ``repetition_penalty`` (over prompt and output;
    1 = off) apply before temperature; ``min_p`` drops tokens below ``min_p`` times the top
    probability; EOS and ``stop_token_ids`` cannot end generation before ``min_tokens``
    tokens; ``logit_bias`` adds to the raw logits. ``logprobs``: return the sampled token's
    logprob and the ``logprobs`` most likely (of the distribution before penalties and
    temperature, as vLLM's default ``raw_logprobs``); ``prompt_logprobs`` likewise for every
    prompt token after the first.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs, bias clamped to [-100, 100] as vLLM does."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    """Prefill only: first tokens (choices) to sample from the prompt; choice ``i`` of a
    seeded request samples as one seeded with ``seed + i`` (vLLM's rule for ``n > 1``). A
    decode forks with :attr:`DecodeRequest.forks` instead and keeps ``n == 1``."""
    output_tokens_in_prompt: int = 0
    """A continuation (the router's next leg of a request that broke on another engine): the
    last this-many prompt tokens are output the request already produced. The frequency and
    presence penalties count them as output and a seeded request's random stream continues
    after their draws, so the leg samples what an unbroken run would (``min_tokens`` and
    ``max_tokens`` are the leg's own: the caller subtracts). At most the prompt's length
    (:func:`validate_continuation`)."""
    structured_outputs: str = ""
    """A JSON object of vLLM's ``StructuredOutputsParams`` fields (``json``, ``regex``,
    ``choice``, ``grammar``, ``json_object``...): every token sampled obeys it, the output
    already produced (a continuation's, the producer's first token) included; empty =
    unconstrained. Only engines that constrain output accept it (the vLLM engine)."""

    def validate(self, *, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequest` naming the first bad field."""
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be >= 0 (0 disables it)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest("seed must be in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequest(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise InvalidRequest(f"logit_bias: token id {token} outside [0, {vocab_size})")
            if not math.isfinite(bias):
                raise InvalidRequest(f"logit_bias: the bias of token {token} is not finite")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {count}")
        if self.output_tokens_in_prompt < 0:
            raise InvalidRequest("output_tokens_in_prompt must be >= 0")
        if len(self.structured_outputs) > MAX_STRUCTURED_OUTPUTS_CHARS:
            raise InvalidRequest(
                f"structured_outputs: at most {MAX_STRUCTURED_OUTPUTS_CHARS} characters"
            )

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, choice: int) -> SamplingParams:
        """The parameters choice ``choice`` of a forked request samples with: one choice,
        the seed offset by the choice (vLLM's ``ParentRequest`` rule)."""
        seed = None if self.seed is None else self.seed + choice
        if self.n == 1 and seed == self.seed:
            return self
        return replace(self, n=1, seed=seed)


@dataclass(frozen=True)
class RequestLimits:
    """What an engine accepts: token ids in ``[0, vocab_size)``, prompts that leave room for
    at least one generated token within ``max_model_len``."""

    vocab_size: int
    max_model_len: int
    lora_slots: int = 0
    """LoRA adapters the engine runs at once (0: it takes no request with an adapter)."""
    engine_kind: str = ""

    @classmethod
    def of(cls, description: BackendDescription) -> RequestLimits:
        return cls(
            vocab_size=description.shape.vocab_size,
            max_model_len=description.shape.max_model_len,
            lora_slots=description.max_loras,
            engine_kind=description.engine_kind,
        )


def validate_lora(adapter: LoRAAdapter, limits: RequestLimits) -> LoRAAdapter:
    """``adapter`` when it is well formed and the engine runs adapters;
    :class:`LoRANotServed` (naming the engine's kind) when it has no LoRA slots."""
    adapter.validate()
    if limits.lora_slots <= 0:
        raise LoRANotServed(
            f"LoRA adapter {adapter.name!r}: this {limits.engine_kind or 'pdserve'} engine serves "
            "no LoRA adapter (it registered no LoRA slots)"
        )
    return adapter


def validate_prompt_length(token_ids: Sequence[int], max_model_len: int) -> None:
    """:class:`InvalidRequest` when the prompt is empty or leaves no room to generate within
    ``max_model_len``: :func:`validate_prompt`'s own checks, for an engine's intake too."""
    if not token_ids:
        raise InvalidRequest("token_ids must not be empty")
    if len(token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt of {len(token_ids)} tokens leaves no room to generate within the "
            f"engine's context of {max_model_len} tokens"
        )


def validate_prompt(token_ids: Sequence[int], limits: RequestLimits) -> tuple[int, ...]:
    """The prompt as a tuple; :class:`InvalidRequest` when it is empty, leaves no room to
    generate within ``limits.max_model_len`` (:func:`validate_prompt_length`), or holds an id
    outside the vocabulary."""
    validate_prompt_length(token_ids, limits.max_model_len)
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} outside the vocabulary [0, {limits.vocab_size})")
    return tuple(token_ids)


def validate_continuation(sampling: SamplingParams, prompt_len: int) -> None:
    """Raise :class:`InvalidRequest` when ``sampling`` claims more output in the prompt than
    the prompt's ``prompt_len`` tokens."""
    if sampling.output_tokens_in_prompt > prompt_len:
        raise InvalidRequest(
            f"output_tokens_in_prompt ({sampling.output_tokens_in_prompt}) exceeds the prompt's "
            f"{prompt_len} tokens"
        )


class FinishReason(StrEnum):
    """Why a request ended (the OpenAI ``finish_reason`` for the first two)."""

    STOP = "stop"  # EOS, a stop id or a stop string
    LENGTH = "length"  # max_tokens reached, or the engine's context limit
    ABORT = "abort"  # aborted by the caller or by a drain
    ERROR = "error"  # the engine failed the request (the message says why)


@dataclass(frozen=True)
class KVHandle:
    """Where a prefilled request's KV lives until a decode engine pulls it.

    ``request_id`` is the producer's key for the held blocks (the lease). ``block_ids`` are the
    same on every rank of the producer (as in vLLM). The producer frees the blocks when every
    consumer rank has notified it, when the request is aborted, or at ``lease_expires_at_s``
    (unix seconds), whichever comes first. ``extra`` is backend-specific and opaque to the
    services (vLLM's ``kv_transfer_params`` as JSON).
    """

    producer_engine_id: EngineId
    generation: Generation
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_expires_at_s: float
    extra: bytes = b""


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs: the chosen (sampled or prompt) token's and the ``top`` most
    likely ``(token id, logprob)`` pairs, most likely first (empty when 0 were asked)."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of ``token_id`` in the distribution (vLLM's ``rank``)."""
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV was found in the engine's prefix cache (not recomputed)."""
    cache_write_tokens: int = 0
    """Prompt tokens this request computed and wrote to the engine's prefix cache: its full
    prompt blocks not already cached (vLLM's ``num_cache_creation_tokens``); 0 without one."""


@dataclass(frozen=True)
class FirstToken:
    """One further choice's first token (a prefill with ``sampling.n > 1``)."""

    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The first token of a prefilled request and the handle of its KV.

    ``kv_handle`` is ``None`` exactly when ``finish_reason`` is set: the first token already
    ended the request (``max_tokens == 1``, EOS, a stop id or string) and nothing was held.
    """

    request_id: str
    first_token_id: int
    text: str
    kv_handle: KVHandle | None
    finish_reason: FinishReason | None
    usage: Usage
    prefill_s: float = 0.0
    """Engine time from admission to the first token (queue time excluded)."""
    queue_s: float = 0.0
    logprobs: TokenLogprobs | None = None
    """The first token's, when ``sampling.logprobs`` is set."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """Prompt tokens 1.. (the first has none), when ``sampling.prompt_logprobs`` is set."""
    more_choices: tuple[FirstToken, ...] = ()
    """With ``sampling.n > 1``: the first tokens of choices ``1 .. n-1`` (choice 0 is the
    fields above); ``kv_handle`` is then ``None`` exactly when every choice finished."""


@dataclass(frozen=True)
class TokenDelta:
    """One step of a decode stream: new token ids and the text they complete.

    The last delta of a stream has ``finish_reason`` and ``usage`` set; ``text`` may lag the
    ids while a multi-byte character or a possible stop string is incomplete.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    """Set with ``FinishReason.ERROR``: what went wrong, for the client."""
    kv_transfer_s: float | None = None
    """On the first delta of a disaggregated request: time spent pulling the KV."""
    cached_tokens: int | None = None
    """On the first delta of a local request (no KV handle): prompt tokens found in the
    engine's prefix cache (the last delta's ``usage`` says it again; a streamed answer's
    front end needs it from its first chunk)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per id of ``token_ids``, when ``sampling.logprobs`` is set."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """On the first delta of a local request with ``sampling.prompt_logprobs``: prompt
    tokens 1.. (a disaggregated request gets them from its prefill)."""
    choice: int = 0
    """With :attr:`DecodeRequest.forks`: the choice (fork) these tokens belong to."""


@dataclass(frozen=True)
class Fork:
    """One sequence of a forked decode: its choice index and the producer's first token."""

    choice: int
    first_token_id: int


@dataclass(frozen=True)
class PrefillRequest:
    """A request for a prefill engine: compute the prompt's KV and first token (one per choice
    with ``sampling.n > 1``) and hold the KV for a decode engine.

    The contract (what the gRPC edge,
    :func:`services.serving.wire.convert.prefill_request_from_proto`, guarantees before a backend
    sees one; an in-process caller such as a benchmark or a test builds only such requests):
    ``request_id`` is 1-128 letters, digits, ``.``, ``_``, ``:`` or ``-``; ``prompt_token_ids``
    passed :func:`validate_prompt` for the engine's :class:`RequestLimits` (not empty, ids in ``[0,
    vocab_size)``, room to generate within ``max_model_len``); ``sampling`` passed
    :meth:`SamplingParams.validate` with the engine's vocabulary and :func:`validate_continuation`
    with the prompt, and ``sampling.n > 1`` only on an engine with
    :attr:`~services.engines.backend.EngineBackend.forks_decode`. A backend trusts all of this and
    checks only what depends on its own state (its role, admission).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace: TraceContext | None = None
    """The caller's W3C trace context (gRPC metadata, not a message field), valid when set."""
    lora: LoRAAdapter | None = None
    """The LoRA adapter to run with (:func:`validate_lora` passed); ``None``: the base model."""


@dataclass(frozen=True)
class DecodeRequest:
    """A request for a decode engine.

    With ``kv_handle`` the engine pulls the prompt's KV from the producer (disaggregated);
    ``first_token_id`` is then the producer's first token, which the stream does not repeat.
    Without it the engine prefills the prompt itself (local / colocated execution) and the
    stream starts with the first token.

    The contract (what :func:`services.serving.wire.convert.decode_request_from_proto` guarantees
    before a backend sees one): ``request_id``, ``prompt_token_ids`` and ``sampling`` as for a
    :class:`PrefillRequest`, with ``sampling.n == 1``; ``first_token_id`` is set exactly when
    ``kv_handle`` is, and lies in the vocabulary; the handle's fields are bounded and its
    ``num_tokens`` is the prompt's length; ``forks`` come only with a handle, with distinct
    choices in ``[0, MAX_N)``, first tokens in the vocabulary and ``forks[0]``'s first token
    ``first_token_id``, and only on an engine with :attr:`EngineBackend.forks_decode`. The
    handle's producer was checked by the Decode RPC (see :meth:`EngineBackend.decode`). A
    backend trusts all of this.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    kv_handle: KVHandle | None = None
    first_token_id: int | None = None
    forks: tuple[Fork, ...] = ()
    """With ``kv_handle`` (an engine with :attr:`EngineBackend.forks_decode`): decode one
    sequence per fork from the one pulled KV, each sampling with
    ``sampling.for_choice(fork.choice)``; ``first_token_id`` is ``forks[0]``'s. The stream's
    deltas carry their fork's choice and it ends once every fork finished."""
    trace: TraceContext | None = None
    """The caller's W3C trace context (gRPC metadata, not a message field), valid when set."""
    lora: LoRAAdapter | None = None
    """The LoRA adapter to run with (with ``kv_handle``: the one the producer's prefill ran
    with, whose KV this continues); ``None``: the base model."""

    @property
    def sequences(self) -> int:
        """Sequences the stream carries (each ends with its own finish reason)."""
        return max(1, len(self.forks))
