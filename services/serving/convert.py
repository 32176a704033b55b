"""Proto (``pdserve.v1``) <-> backend dataclasses (:mod:`services.engines.backend`).

``*_from_proto`` functions run on the server before the backend sees anything: they bound every
field and raise :class:`InvalidRequest` naming the first bad one, so malformed input is an
INVALID_ARGUMENT and never reaches the engine. Checks that need the engine (vocabulary, context
length) take its :class:`~services.engines.backend.RequestLimits` (the prompt check is the
backend seam's own :func:`~services.engines.backend.validate_prompt`). ``*_to_proto`` functions
are their inverses; the client uses both directions' counterparts (a round trip is the identity
on valid values).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.control_plane.wire import EngineLoad, validate_identifier
from services.engines.backend import (
    MAX_LOGIT_BIAS,
    MAX_N,
    DecodeRequest,
    FinishReason,
    FirstToken,
    Fork,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    RequestLimits,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    Usage,
    validate_prompt,
)
from services.engines.errors import InvalidRequest
from services.proto_gen.pdserve.v1 import (
    decode_pb2,
    engine_pb2,
    prefill_pb2,
    types_pb2,
)

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_STOP_TOKEN_IDS = 256
MAX_HANDLE_EXTRA_BYTES = 64 * 1024
MAX_GENERATION = 2**63 - 1

_FINISH_TO_PROTO = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: types_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {value: key for key, value in _FINISH_TO_PROTO.items()}


def validate_request_id(request_id: str, what: str = "request_id") -> str:
    if not _REQUEST_ID.match(request_id):
        raise InvalidRequest(
            f"{what} must be 1-{MAX_REQUEST_ID_CHARS} letters, digits, '.', '_', ':' or '-' "
            f"starting with a letter or digit (got {request_id[:40]!r})"
        )
    return request_id


# -- undecodable request bytes -------------------------------------------------------------

MAX_DECODE_ERROR_CHARS = 200


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that did not parse as the RPC's message.

    The server's request deserializers (:mod:`services.serving.handlers`) return this instead
    of raising, because grpc.aio answers a raising deserializer with a bare UNKNOWN before any
    pdserve code runs. The handler answers it with :meth:`error` (INVALID_ARGUMENT) and never
    passes it to a servicer.
    """

    rpc: str
    message_type: str
    size: int
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"{self.rpc}: the request could not be decoded as {self.message_type} "
            f"({self.size} bytes): {self.reason[:MAX_DECODE_ERROR_CHARS]}"
        )


# -- sampling ------------------------------------------------------------------------------


def sampling_to_proto(sampling: SamplingParams) -> types_pb2.SamplingParams:
    message = types_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        logit_bias=dict(sampling.logit_bias),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
    )
    if sampling.seed is not None:
        message.seed = sampling.seed
    if sampling.repetition_penalty != 1.0:
        message.repetition_penalty = sampling.repetition_penalty
    if sampling.logprobs is not None:
        message.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        message.prompt_logprobs = sampling.prompt_logprobs
    if not sampling.skip_special_tokens:
        message.skip_special_tokens = False
    if not sampling.spaces_between_special_tokens:
        message.spaces_between_special_tokens = False
    if sampling.n != 1:
        message.n = sampling.n
    return message


def sampling_from_proto(
    message: types_pb2.SamplingParams, limits: RequestLimits | None = None
) -> SamplingParams:
    """Validated :class:`SamplingParams`; ``top_p == 0`` is read as 1 (the proto's default)."""
    if len(message.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(message.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
    # float32 on the wire: round to the nearest short decimal so 0.7 stays 0.7.
    sampling = SamplingParams(
        max_tokens=message.max_tokens,
        temperature=_float32(message.temperature),
        top_p=_float32(message.top_p) if message.top_p != 0 else 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        presence_penalty=_float32(message.presence_penalty),
        frequency_penalty=_float32(message.frequency_penalty),
        repetition_penalty=(
            _float32(message.repetition_penalty) if message.HasField("repetition_penalty") else 1.0
        ),
        min_p=_float32(message.min_p),
        min_tokens=message.min_tokens,
        logit_bias=tuple(
            (token, max(-100.0, min(100.0, _float32(bias))))
            for token, bias in sorted(message.logit_bias.items())
        ),
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=(message.prompt_logprobs if message.HasField("prompt_logprobs") else None),
        include_stop_str_in_output=message.include_stop_str_in_output,
        skip_special_tokens=(
            message.skip_special_tokens if message.HasField("skip_special_tokens") else True
        ),
        spaces_between_special_tokens=(
            message.spaces_between_special_tokens
            if message.HasField("spaces_between_special_tokens")
            else True
        ),
        n=message.n or 1,
    )
    sampling.validate(vocab_size=limits.vocab_size if limits else None)
    return sampling


def _float32(value: float) -> float:
    if not math.isfinite(value):
        return value
    return float(f"{value:.7g}")


# -- logprobs ------------------------------------------------------------------------------


def logprobs_to_proto(entry: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top_token_ids=[token for token, _ in entry.top],
        top_logprobs=[logprob for _, logprob in entry.top],
    )


def logprobs_from_proto(message: types_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=message.token_id,
        logprob=message.logprob,
        rank=message.rank,
        top=tuple(zip(message.top_token_ids, message.top_logprobs, strict=False)),
    )


# -- KV handle -----------------------------------------------------------------------------


def handle_to_proto(handle: KVHandle) -> types_pb2.KVHandle:
    return types_pb2.KVHandle(
        producer_engine_id=handle.producer_engine_id,
        generation=handle.generation,
        request_id=handle.request_id,
        block_ids=list(handle.block_ids),
        num_tokens=handle.num_tokens,
        lease_expires_at_s=handle.lease_expires_at_s,
        extra=handle.extra,
    )


def handle_from_proto(message: types_pb2.KVHandle, limits: RequestLimits | None = None) -> KVHandle:
    try:
        validate_identifier(message.producer_engine_id, "kv_handle.producer_engine_id")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if not 0 < message.generation <= MAX_GENERATION:
        raise InvalidRequest("kv_handle.generation must be > 0")
    validate_request_id(message.request_id, "kv_handle.request_id")
    if message.num_tokens < 1:
        raise InvalidRequest("kv_handle.num_tokens must be >= 1")
    if not message.block_ids:
        raise InvalidRequest("kv_handle.block_ids must not be empty")
    if limits is not None and len(message.block_ids) > limits.max_model_len:
        raise InvalidRequest("kv_handle.block_ids: more blocks than the context can use")
    if not math.isfinite(message.lease_expires_at_s) or message.lease_expires_at_s <= 0:
        raise InvalidRequest("kv_handle.lease_expires_at_s must be a positive unix time")
    if len(message.extra) > MAX_HANDLE_EXTRA_BYTES:
        raise InvalidRequest(f"kv_handle.extra is larger than {MAX_HANDLE_EXTRA_BYTES} bytes")
    return _handle_as_sent(message)


# -- usage and finish reasons --------------------------------------------------------------


def usage_to_proto(usage: Usage) -> types_pb2.Usage:
    return types_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


def usage_from_proto(message: types_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        cached_tokens=message.cached_tokens,
    )


def finish_to_proto(reason: FinishReason | None) -> types_pb2.FinishReason.ValueType:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: types_pb2.FinishReason.ValueType) -> FinishReason | None:
    # An enum value this version does not know (a newer server) reads as an error finish.
    return _FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


# -- prefill -------------------------------------------------------------------------------


def prefill_request_to_proto(request: PrefillRequest) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request.request_id,
        token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
    )


def prefill_request_from_proto(
    message: prefill_pb2.PrefillRequest, limits: RequestLimits
) -> PrefillRequest:
    """The validated request (the contract of :class:`PrefillRequest`, except the engine's
    ``forks_decode``, which the Prefill RPC checks)."""
    request_id = validate_request_id(message.request_id)
    prompt = validate_prompt(message.token_ids, limits)
    sampling = (
        sampling_from_proto(message.sampling, limits)
        if message.HasField("sampling")
        else SamplingParams()
    )
    return PrefillRequest(request_id, prompt, sampling)


def prefill_result_to_proto(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    response = prefill_pb2.PrefillResponse(
        request_id=result.request_id,
        first_token_id=result.first_token_id,
        text=result.text,
        finish_reason=finish_to_proto(result.finish_reason),
        usage=usage_to_proto(result.usage),
        prefill_s=result.prefill_s,
        queue_s=result.queue_s,
        prompt_logprobs=[logprobs_to_proto(entry) for entry in result.prompt_logprobs],
        more_choices=[_first_to_proto(first) for first in result.more_choices],
    )
    if result.kv_handle is not None:
        response.kv_handle.CopyFrom(handle_to_proto(result.kv_handle))
    if result.logprobs is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(result.logprobs))
    return response


def prefill_result_from_proto(message: prefill_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        request_id=message.request_id,
        first_token_id=message.first_token_id,
        text=message.text,
        kv_handle=(_handle_as_sent(message.kv_handle) if message.HasField("kv_handle") else None),
        finish_reason=finish_from_proto(message.finish_reason),
        usage=usage_from_proto(message.usage),
        prefill_s=message.prefill_s,
        queue_s=message.queue_s,
        logprobs=logprobs_from_proto(message.logprobs) if message.HasField("logprobs") else None,
        prompt_logprobs=tuple(logprobs_from_proto(entry) for entry in message.prompt_logprobs),
        more_choices=tuple(
            FirstToken(
                token_id=first.token_id,
                text=first.text,
                finish_reason=finish_from_proto(first.finish_reason),
                logprobs=logprobs_from_proto(first.logprobs)
                if first.HasField("logprobs")
                else None,
            )
            for first in message.more_choices
        ),
    )


def _first_to_proto(first: FirstToken) -> prefill_pb2.FirstToken:
    message = prefill_pb2.FirstToken(
        token_id=first.token_id,
        text=first.text,
        finish_reason=finish_to_proto(first.finish_reason),
    )
    if first.logprobs is not None:
        message.logprobs.CopyFrom(logprobs_to_proto(first.logprobs))
    return message


def _handle_as_sent(message: types_pb2.KVHandle) -> KVHandle:
    """The handle exactly as the engine sent it (the client passes it on unchanged)."""
    return KVHandle(
        producer_engine_id=message.producer_engine_id,
        generation=message.generation,
        request_id=message.request_id,
        block_ids=tuple(message.block_ids),
        num_tokens=message.num_tokens,
        lease_expires_at_s=message.lease_expires_at_s,
        extra=message.extra,
    )


# -- decode --------------------------------------------------------------------------------


MAX_COALESCE_S = 3600.0
"""Bound of ``DecodeRequest.coalesce_s``."""


def decode_request_to_proto(
    request: DecodeRequest, *, coalesce_s: float | None = None
) -> decode_pb2.DecodeRequest:
    """``coalesce_s``: a transport choice of the caller, not part of the request (see
    decode.proto); set, it asks for the first message to be held too (``coalesce_first``)."""
    message = decode_pb2.DecodeRequest(
        request_id=request.request_id,
        token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
    )
    if request.kv_handle is not None:
        message.kv_handle.CopyFrom(handle_to_proto(request.kv_handle))
    if request.first_token_id is not None:
        message.first_token_id = request.first_token_id
    for fork in request.forks:
        message.forks.add(choice=fork.choice, first_token_id=fork.first_token_id)
    if coalesce_s is not None:
        message.coalesce_s = coalesce_s
        message.coalesce_first = True
    return message


def coalesce_from_proto(message: decode_pb2.DecodeRequest) -> float:
    """The request's ``coalesce_s`` (0 when unset: one message per step)."""
    if not message.HasField("coalesce_s"):
        return 0.0
    value = message.coalesce_s
    if not (math.isfinite(value) and 0 <= value <= MAX_COALESCE_S):
        raise InvalidRequest(f"coalesce_s must be within [0, {MAX_COALESCE_S:g}], not {value}")
    return value


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """Several consecutive steps as one: ids and text joined; the finish, usage and error of
    the last; the KV transfer time of the first that has one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return TokenDelta(
        token_ids=tuple(token for delta in deltas for token in delta.token_ids),
        text="".join(delta.text for delta in deltas),
        finish_reason=last.finish_reason,
        usage=last.usage,
        error=last.error,
        kv_transfer_s=next((d.kv_transfer_s for d in deltas if d.kv_transfer_s is not None), None),
        logprobs=tuple(entry for delta in deltas for entry in delta.logprobs),
        prompt_logprobs=tuple(entry for delta in deltas for entry in delta.prompt_logprobs),
        choice=last.choice,
    )


def decode_request_from_proto(
    message: decode_pb2.DecodeRequest, limits: RequestLimits
) -> DecodeRequest:
    request_id = validate_request_id(message.request_id)
    prompt = validate_prompt(message.token_ids, limits)
    sampling = (
        sampling_from_proto(message.sampling, limits)
        if message.HasField("sampling")
        else SamplingParams()
    )
    handle: KVHandle | None = None
    first_token_id: int | None = None
    if message.HasField("kv_handle"):
        handle = handle_from_proto(message.kv_handle, limits)
        if handle.num_tokens != len(prompt):
            raise InvalidRequest(
                f"kv_handle.num_tokens ({handle.num_tokens}) must equal the prompt length "
                f"({len(prompt)})"
            )
        if not message.HasField("first_token_id"):
            raise InvalidRequest("first_token_id is required with kv_handle")
    if message.HasField("first_token_id"):
        if handle is None:
            raise InvalidRequest("first_token_id is only valid with kv_handle")
        first_token_id = message.first_token_id
        if not 0 <= first_token_id < limits.vocab_size:
            raise InvalidRequest(
                f"first_token_id {first_token_id} outside the vocabulary [0, {limits.vocab_size})"
            )
    if sampling.n != 1:
        raise InvalidRequest("sampling.n must be 1 in a decode request (it forks with forks)")
    forks = _forks_from_proto(message, first_token_id, limits)
    return DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        kv_handle=handle,
        first_token_id=first_token_id,
        forks=forks,
    )


def _forks_from_proto(
    message: decode_pb2.DecodeRequest, first_token_id: int | None, limits: RequestLimits
) -> tuple[Fork, ...]:
    if not message.forks:
        return ()
    if first_token_id is None:
        raise InvalidRequest("forks are only valid with a kv_handle")
    if len(message.forks) > MAX_N:
        raise InvalidRequest(f"at most {MAX_N} forks")
    forks = tuple(Fork(fork.choice, fork.first_token_id) for fork in message.forks)
    if len({fork.choice for fork in forks}) != len(forks) or any(
        fork.choice >= MAX_N for fork in forks
    ):
        raise InvalidRequest(f"forks must have distinct choices in [0, {MAX_N})")
    if any(not 0 <= fork.first_token_id < limits.vocab_size for fork in forks):
        raise InvalidRequest(f"a fork's first_token_id is outside [0, {limits.vocab_size})")
    if forks[0].first_token_id != first_token_id:
        raise InvalidRequest("first_token_id must be forks[0].first_token_id")
    return forks


def delta_to_proto(delta: TokenDelta) -> decode_pb2.DecodeChunk:
    chunk = decode_pb2.DecodeChunk(
        token_ids=list(delta.token_ids),
        text=delta.text,
        finish_reason=finish_to_proto(delta.finish_reason),
        error=delta.error or "",
        logprobs=[logprobs_to_proto(entry) for entry in delta.logprobs],
        prompt_logprobs=[logprobs_to_proto(entry) for entry in delta.prompt_logprobs],
    )
    if delta.usage is not None:
        chunk.usage.CopyFrom(usage_to_proto(delta.usage))
    if delta.kv_transfer_s is not None:
        chunk.kv_transfer_s = delta.kv_transfer_s
    if delta.choice:
        chunk.choice = delta.choice
    return chunk


def delta_from_proto(chunk: decode_pb2.DecodeChunk) -> TokenDelta:
    # Once per streamed token in the router: the empty repeated fields skip their loops.
    logprobs = chunk.logprobs
    prompt_logprobs = chunk.prompt_logprobs
    return TokenDelta(
        token_ids=tuple(chunk.token_ids),
        text=chunk.text,
        finish_reason=finish_from_proto(chunk.finish_reason),
        usage=usage_from_proto(chunk.usage) if chunk.HasField("usage") else None,
        error=chunk.error or None,
        kv_transfer_s=chunk.kv_transfer_s if chunk.HasField("kv_transfer_s") else None,
        logprobs=tuple(map(logprobs_from_proto, logprobs)) if logprobs else (),
        prompt_logprobs=tuple(map(logprobs_from_proto, prompt_logprobs)) if prompt_logprobs else (),
        choice=chunk.choice,
    )


# -- engine --------------------------------------------------------------------------------


def load_to_proto(
    load: EngineLoad, *, engine_id: str, generation: int, draining: bool
) -> engine_pb2.LoadStats:
    return engine_pb2.LoadStats(
        queue_depth=load.queue_depth,
        running_requests=load.running_requests,
        kv_blocks_free=load.kv_blocks_free,
        kv_blocks_total=load.kv_blocks_total,
        engine_id=engine_id,
        generation=generation,
        draining=draining,
    )


def load_from_proto(message: engine_pb2.LoadStats) -> EngineLoad:
    return EngineLoad(
        queue_depth=message.queue_depth,
        running_requests=message.running_requests,
        kv_blocks_free=message.kv_blocks_free,
        kv_blocks_total=message.kv_blocks_total,
    )
