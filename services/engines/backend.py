"""The engine-backend seam: what a prefill or decode service asks of the engine it hosts.

A service (``pdserve prefill`` / ``pdserve decode``) owns one :class:`EngineBackend`. The
reference CPU engine (``services.engines.reference``) and the vLLM engine
(``services.engines.vllm``) implement it; the gRPC layer translates its types to and from
``proto/pdserve/v1`` and its errors (:mod:`services.engines.errors`) to status codes.

Lifecycle, as the host drives it:

1. ``backend = SomeBackend(options)``; :meth:`EngineBackend.describe` gives the
   :class:`~services.control_plane.base.EngineSpec` fields that depend on the model and layout
   (the host fills in engine id, role and endpoint) without starting anything heavy.
2. The host registers the spec with the control plane and gets a generation.
3. ``await backend.start(registration)`` starts the engine's rank processes; every
   ``(pp_rank, tp_rank)`` publishes its handshake record for ``registration.generation``
   (or the engine's scheduler publishes the whole grid). ``start`` returns once every rank is
   up and has published; the host then waits for READY through the control plane.
4. Requests: :meth:`prefill`, :meth:`decode`, :meth:`abort`; :meth:`load` on every heartbeat.
   If the control plane lost the registration (a heartbeat got ``EngineNotFound``: Redis
   restarted without persistence, or the lease ran out), the host registers the same spec
   again and calls :meth:`republish` with the new generation; the engine keeps running.
5. Shutdown: :meth:`drain` (stop admitting, finish or abort in-flight work within a bound),
   then :meth:`stop`.

Every method is safe to call from the host's asyncio loop; a backend never blocks it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from services.config.control_plane import ControlPlaneSettings
from services.control_plane.aggregation import DTYPE_BYTES
from services.control_plane.base import EngineSpec
from services.control_plane.wire import EngineId, EngineLoad, EngineRole, Generation
from services.engines.errors import InvalidRequest
from services.engines.trace_context import TraceContext
from services.kv_events.endpoints import advertised

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

    @classmethod
    def of(cls, description: BackendDescription) -> RequestLimits:
        return cls(vocab_size=description.vocab_size, max_model_len=description.max_model_len)


def validate_prompt(token_ids: Sequence[int], limits: RequestLimits) -> tuple[int, ...]:
    """The prompt as a tuple; :class:`InvalidRequest` when it is empty, leaves no room to
    generate within ``limits.max_model_len``, or holds an id outside the vocabulary."""
    if not token_ids:
        raise InvalidRequest("token_ids must not be empty")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt of {len(token_ids)} tokens leaves no room to generate within the "
            f"engine's context of {limits.max_model_len} tokens"
        )
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

    The contract (what the gRPC edge, :func:`services.serving.convert.prefill_request_from_proto`,
    guarantees before a backend sees one; an in-process caller such as a benchmark or a test
    builds only such requests): ``request_id`` is 1-128 letters, digits, ``.``, ``_``, ``:`` or
    ``-``; ``prompt_token_ids`` passed :func:`validate_prompt` for the engine's
    :class:`RequestLimits` (not empty, ids in ``[0, vocab_size)``, room to generate within
    ``max_model_len``); ``sampling`` passed :meth:`SamplingParams.validate` with the engine's
    vocabulary and :func:`validate_continuation` with the prompt, and ``sampling.n > 1`` only
    on an engine with :attr:`EngineBackend.forks_decode`. A backend trusts all of this and
    checks only what depends on its own state (its role, admission).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace: TraceContext | None = None
    """The caller's W3C trace context (gRPC metadata, not a message field), valid when set."""


@dataclass(frozen=True)
class DecodeRequest:
    """A request for a decode engine.

    With ``kv_handle`` the engine pulls the prompt's KV from the producer (disaggregated);
    ``first_token_id`` is then the producer's first token, which the stream does not repeat.
    Without it the engine prefills the prompt itself (local / colocated execution) and the
    stream starts with the first token.

    The contract (what :func:`services.serving.convert.decode_request_from_proto` guarantees
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

    @property
    def sequences(self) -> int:
        """Sequences the stream carries (each ends with its own finish reason)."""
        return max(1, len(self.forks))


@dataclass(frozen=True)
class EngineRegistration:
    """What :meth:`EngineBackend.start` needs to publish handshakes for this engine."""

    engine_id: EngineId
    generation: Generation
    role: EngineRole
    control_plane: ControlPlaneSettings = field(default_factory=ControlPlaneSettings)


@dataclass(frozen=True)
class BackendDescription:
    """The model- and layout-dependent parts of an engine's control-plane spec."""

    model: str
    compat_hash: str
    pp_size: int
    tp_size: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    pp_aware: bool = True
    engine_kind: str = "reference"
    kv_events_endpoint: str = ""
    """Where the engine publishes its KV-cache events, as bound (``tcp://*:PORT`` binds every
    interface; :meth:`spec` puts the host's advertised host in place of the wildcard); empty =
    no events. A backend that publishes binds (or reserves) its ports by :meth:`describe`."""
    kv_events_replay_endpoint: str = ""
    """The KV-event replay endpoint, as bound (same rules)."""
    kv_block_bytes: int = 0
    """The bytes of one KV block of the whole engine (:func:`kv_block_bytes`); 0 = unknown."""

    def spec(self, engine_id: EngineId, role: EngineRole, endpoint: str) -> EngineSpec:
        """The control-plane spec of an engine with this description (what the host registers):
        ``endpoint`` is the advertised gRPC ``HOST:PORT``, whose host also replaces a wildcard
        in the KV-event endpoints."""
        shared = {f.name for f in dataclasses.fields(EngineSpec)} - SPEC_ONLY_FIELDS
        values = {name: getattr(self, name) for name in shared}
        host = endpoint.rpartition(":")[0] or endpoint
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if values[name]:
                values[name] = advertised(values[name], host)
        return EngineSpec(engine_id=engine_id, role=role, endpoint=endpoint, **values)


def kv_block_bytes(
    *, num_layers: int, num_kv_heads: int, block_size: int, head_size: int, dtype: str
) -> int:
    """The bytes of one KV block of a whole engine: K and V of every layer and KV head, in the
    KV cache's ``dtype`` (0 for a dtype :data:`DTYPE_BYTES` does not know)."""
    element = DTYPE_BYTES.get(dtype, 0)
    return 2 * num_layers * num_kv_heads * block_size * head_size * element


SPEC_ONLY_FIELDS = frozenset({"engine_id", "role", "endpoint"})
"""The fields of :class:`EngineSpec` a description does not have (the host knows them)."""


class EngineBackend(abc.ABC):
    """An engine a service hosts. See the module docstring for the lifecycle.

    Errors: :class:`~services.engines.errors.InvalidRequest` for bad input (never a crash),
    :class:`~services.engines.errors.UnknownKVHandle` / ``KVLeaseExpired`` /
    ``ProducerUnavailable`` for a handle that cannot be pulled, ``EngineOverloaded`` when
    admission is refused, ``EngineDraining`` once :meth:`drain` began, ``EngineFailed`` when a
    rank died (the engine is then unusable and the host must exit non-zero).
    """

    forks_decode: bool = False
    """Whether :meth:`prefill` takes ``sampling.n > 1`` and :meth:`decode` takes
    ``DecodeRequest.forks`` (n choices from one prefill and one KV transfer); a backend
    without it refuses both with :class:`~services.engines.errors.InvalidRequest`."""

    @abc.abstractmethod
    def describe(self) -> BackendDescription:
        """The spec fields the host registers; cheap (reads the model config only), except
        that a backend that publishes KV events binds or reserves their ports on the first
        call (the same endpoints every call after; :meth:`stop` releases them)."""

    @abc.abstractmethod
    async def start(self, registration: EngineRegistration) -> None:
        """Start every rank and have each publish its handshake record for the generation.

        Returns when all ranks are up and published; raises ``EngineFailed`` if one fails to
        start (every started rank is stopped first).
        """

    @abc.abstractmethod
    async def republish(self, registration: EngineRegistration) -> None:
        """Publish every rank's handshake record again, under ``registration.generation``.

        Called by the host (only after :meth:`start` returned) when the control plane lost
        the engine's registration and the host registered the same spec again: every rank
        publishes its handshake record again under the new generation (same agents, same
        memory), KV handles made from then on carry the new generation (those of the old one
        are refused by consumers: ``ProducerUnavailable``), and requests in flight keep
        running. ``registration`` differs from the started one only in ``generation``.

        Returns once every rank published; the host then waits for READY. Raises
        :class:`~services.control_plane.errors.ControlPlaneError` when a rank could not
        publish through the control plane (the host retries with a fresh registration) and
        ``EngineFailed`` when this engine cannot re-publish at all (the host exits non-zero).
        """

    @abc.abstractmethod
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt's KV and first token; hold the KV for a consumer (prefill role).

        ``request`` is valid (see :class:`PrefillRequest`); an engine whose role does not
        produce KV raises :class:`~services.engines.errors.InvalidRequest`. An abort before
        the first token raises :class:`~services.engines.errors.RequestAborted`."""

    @abc.abstractmethod
    def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        """Stream a request's tokens until it finishes; the last delta carries the reason.

        ``request`` is valid (see :class:`DecodeRequest`). The producer check has one owner,
        the Decode RPC (:class:`services.decode.servicer.ProducerGate`): before it calls
        ``decode`` with a ``kv_handle`` it has read the handle's producer from the control
        plane and refused the call unless the producer is a READY KV producer at the handle's
        generation with this engine's compat hash and block size
        (:func:`~services.engines.producer_check.producer_refusal`). A backend never reads the
        control plane for this; an in-process caller (a benchmark, an engine test) hands it
        only handles of producers it knows to be READY. What only the backend can tell it
        still refuses: a handle it cannot pull (``UnknownKVHandle``, an expired lease:
        ``KVLeaseExpired``, a pull that failed: ``ProducerUnavailable`` /
        ``KVTransferFailed``), raised before the first delta. Closing the iterator early
        aborts the request and frees its blocks.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Abort a running or held request and free its blocks; ``False`` when unknown."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Queue depth, running requests and KV blocks (free, total) right now."""

    @abc.abstractmethod
    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to ``timeout_s`` for in-flight ones (held KV included)
        and abort what remains. Returns the number of requests aborted."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop every rank and withdraw its handshake. Idempotent."""

    @abc.abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (the prefill's first token, for the router)."""
