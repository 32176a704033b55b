"""Proto (``pdserve.v1``) <-> backend dataclasses (:mod:`services.engines.backend`) for the
RPC messages: Prefill, Decode and the engine's load.

``*_from_proto`` functions run on the server before the backend sees anything: they are the one
validation of a request (the gRPC edge), bound every field and raise :class:`InvalidRequest`
naming the first bad one, so malformed input is an INVALID_ARGUMENT and never reaches the
engine; what they return is a :class:`~services.engines.requests.PrefillRequest` or
:class:`~services.engines.requests.DecodeRequest` whose docstring states what it guarantees.
Checks that need the engine (vocabulary, context length) take its
:class:`~services.engines.requests.RequestLimits` (the prompt check is the backend seam's own
:func:`~services.engines.requests.validate_prompt`). ``*_to_proto`` functions are their inverses;
the client uses both directions' counterparts (a round trip is the identity on valid values).
The fields these messages share (sampling, logprobs, KV handle, usage, finish reasons, the
request id rule) are converted in :mod:`services.serving.wire.fields`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.control_plane.wire import EngineLoad
from services.engines.errors import InvalidRequest
from services.engines.lora import LoRAAdapter
from services.engines.requests import (
    MAX_N,
    DecodeRequest,
    FirstToken,
    Fork,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    RequestLimits,
    SamplingParams,
    TokenDelta,
    validate_continuation,
    validate_lora,
    validate_prompt,
)
from services.engines.trace_context import TraceContext
from services.proto_gen.pdserve.v1 import decode_pb2, engine_pb2, prefill_pb2, types_pb2
from services.serving.wire.fields import (
    finish_from_proto,
    finish_to_proto,
    handle_as_sent,
    handle_from_proto,
    handle_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    usage_from_proto,
    usage_to_proto,
    validate_request_id,
)

# -- prefill -------------------------------------------------------------------------------

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Bound of one gRPC message either way (a prompt of 128k tokens is ~0.6 MiB)."""


def prefill_request_to_proto(request: PrefillRequest) -> prefill_pb2.PrefillRequest:
    message = prefill_pb2.PrefillRequest(
        request_id=request.request_id,
        token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
    )
    if request.lora is not None:
        message.lora.CopyFrom(lora_to_proto(request.lora))
    return message


def lora_to_proto(adapter: LoRAAdapter) -> types_pb2.LoRAAdapter:
    return types_pb2.LoRAAdapter(name=adapter.name, path=adapter.path)


def lora_from_proto(message: types_pb2.LoRAAdapter) -> LoRAAdapter:
    """The adapter, well formed (:meth:`LoRAAdapter.validate`)."""
    adapter = LoRAAdapter(message.name, message.path)
    adapter.validate()
    return adapter


def _request_lora(
    message: prefill_pb2.PrefillRequest | decode_pb2.DecodeRequest, limits: RequestLimits
) -> LoRAAdapter | None:
    if not message.HasField("lora"):
        return None
    return validate_lora(lora_from_proto(message.lora), limits)


def prefill_request_from_proto(
    message: prefill_pb2.PrefillRequest,
    limits: RequestLimits,
    *,
    trace: TraceContext | None = None,
) -> PrefillRequest:
    """The validated request (the contract of :class:`PrefillRequest`, except the engine's
    ``forks_decode``, which the Prefill RPC checks), with the ``trace`` the call's metadata
    carried (:mod:`services.serving.wire.trace_metadata`: not a message field)."""
    request_id = validate_request_id(message.request_id)
    prompt = validate_prompt(message.token_ids, limits)
    sampling = (
        sampling_from_proto(message.sampling, limits)
        if message.HasField("sampling")
        else SamplingParams()
    )
    validate_continuation(sampling, len(prompt))
    return PrefillRequest(request_id, prompt, sampling, trace, _request_lora(message, limits))


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
        kv_handle=(handle_as_sent(message.kv_handle) if message.HasField("kv_handle") else None),
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


# -- decode --------------------------------------------------------------------------------


MAX_IDLE_TIMEOUT_S = 86400.0
"""Bound of ``DecodeRequest.idle_timeout_s`` (decode.proto)."""


def decode_request_to_proto(
    request: DecodeRequest, *, idle_timeout_s: float | None = None
) -> decode_pb2.DecodeRequest:
    """``idle_timeout_s``: ``DecodeOnce``'s bound, a transport choice of the caller, not part
    of the request (see decode.proto)."""
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
    if request.lora is not None:
        message.lora.CopyFrom(lora_to_proto(request.lora))
    if idle_timeout_s is not None:
        message.idle_timeout_s = idle_timeout_s
    return message


def idle_timeout_from_proto(message: decode_pb2.DecodeRequest) -> float:
    """``DecodeOnce``'s ``idle_timeout_s`` (required, in ``(0, MAX_IDLE_TIMEOUT_S]``)."""
    if not message.HasField("idle_timeout_s"):
        raise InvalidRequest("idle_timeout_s is required by DecodeOnce")
    value = message.idle_timeout_s
    if not (math.isfinite(value) and 0 < value <= MAX_IDLE_TIMEOUT_S):
        raise InvalidRequest(
            f"idle_timeout_s must be within (0, {MAX_IDLE_TIMEOUT_S:g}], not {value}"
        )
    return value


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """Several consecutive steps as one: ids and text joined; the finish, usage and error of
    the last; the KV transfer time and the cached tokens of the first that has one."""
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
        cached_tokens=next((d.cached_tokens for d in deltas if d.cached_tokens is not None), None),
        logprobs=tuple(entry for delta in deltas for entry in delta.logprobs),
        prompt_logprobs=tuple(entry for delta in deltas for entry in delta.prompt_logprobs),
        choice=last.choice,
    )


def decode_request_from_proto(
    message: decode_pb2.DecodeRequest,
    limits: RequestLimits,
    *,
    trace: TraceContext | None = None,
) -> DecodeRequest:
    """The validated request (the contract of :class:`DecodeRequest`), with the ``trace`` the
    call's metadata carried (as :func:`prefill_request_from_proto`)."""
    request_id = validate_request_id(message.request_id)
    prompt = validate_prompt(message.token_ids, limits)
    sampling = (
        sampling_from_proto(message.sampling, limits)
        if message.HasField("sampling")
        else SamplingParams()
    )
    validate_continuation(sampling, len(prompt))
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
        trace=trace,
        lora=_request_lora(message, limits),
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
    if delta.cached_tokens is not None:
        chunk.cached_tokens = delta.cached_tokens
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
        cached_tokens=chunk.cached_tokens if chunk.HasField("cached_tokens") else None,
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
