"""Proto (``pdserve.v1``) <-> seam types for the fields the RPC messages share.

The request id rule, request bytes that did not parse (:class:`Undecodable`), sampling
parameters, logprobs, the KV handle, usage and finish reasons. ``*_from_proto`` functions bound
every field and raise :class:`~services.engines.errors.InvalidRequest` naming the first bad one;
checks that need the engine (vocabulary, context length) take its
:class:`~services.engines.requests.RequestLimits`. The RPC messages built from these are in
:mod:`services.serving.wire.convert`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.control_plane.wire import validate_identifier
from services.engines import sampling_fields
from services.engines.errors import InvalidRequest
from services.engines.requests import (
    MAX_LOGIT_BIAS,
    FinishReason,
    KVHandle,
    RequestLimits,
    SamplingParams,
    TokenLogprobs,
    Usage,
)
from services.proto_gen.pdserve.v1 import types_pb2

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

    The server's request deserializers (:mod:`services.serving.host.handlers`) return this instead
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


_SAMPLING_FIELDS = types_pb2.SamplingParams.DESCRIPTOR.fields
"""The table both conversions walk (with :mod:`services.engines.sampling_fields`' rules)."""


@dataclass(frozen=True)
class _WireField:
    """One field's wire form, read once from its descriptor."""

    name: str
    is_map: bool
    is_repeated: bool
    has_presence: bool
    is_float: bool
    """float32 on the wire (for a map: its values)."""
    zero_reads_as_default: bool
    default: Any
    normalize: Callable[[Any], Any]


def _wire_field(field: FieldDescriptor) -> _WireField:
    entry = field.message_type
    is_map = entry is not None and entry.GetOptions().map_entry
    scalar = entry.fields_by_name["value"] if entry is not None and is_map else field
    rule = sampling_fields.rule(field.name)
    return _WireField(
        name=field.name,
        is_map=is_map,
        is_repeated=field.is_repeated and not is_map,
        has_presence=field.has_presence,
        is_float=scalar.cpp_type == FieldDescriptor.CPPTYPE_FLOAT,
        zero_reads_as_default=rule.zero_reads_as_default,
        default=sampling_fields.DEFAULTS[field.name],
        normalize=rule.normalize,
    )


_WIRE_FIELDS = tuple(_wire_field(field) for field in _SAMPLING_FIELDS)


@functools.lru_cache(maxsize=1024)
def sampling_to_proto(sampling: SamplingParams) -> types_pb2.SamplingParams:
    """The message of ``sampling``, made once per distinct value (a router sends each
    request's sampling twice, Prefill and Decode, and most requests share theirs): the message
    is shared, so callers copy it (as a message constructor's field does) and never change it.
    A field with explicit presence is set only when it differs from the dataclass default."""
    message = types_pb2.SamplingParams()
    for field in _WIRE_FIELDS:
        value = getattr(sampling, field.name)
        if field.is_map:
            getattr(message, field.name).update(dict(value))
        elif field.is_repeated:
            getattr(message, field.name).extend(value)
        elif not field.has_presence or value != field.default:
            setattr(message, field.name, value)
    return message


def sampling_from_proto(
    message: types_pb2.SamplingParams, limits: RequestLimits | None = None
) -> SamplingParams:
    """Validated :class:`SamplingParams`; an unset field with explicit presence, and a zero
    the field's rule reads as unset (``top_p``, ``n``), is the dataclass default. float32 on
    the wire is rounded to the nearest short decimal, so 0.7 stays 0.7."""
    if len(message.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    if len(message.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
    wire: Message = message
    values: dict[str, Any] = {}
    for field in _WIRE_FIELDS:
        name = field.name
        value = getattr(message, name)
        if field.is_map:
            value = tuple(
                (key, _float32(item) if field.is_float else item) for key, item in value.items()
            )
        elif field.is_repeated:
            value = tuple(value)
        elif (field.has_presence and not wire.HasField(name)) or (
            field.zero_reads_as_default and not value
        ):
            values[name] = field.default
            continue
        elif field.is_float:
            value = _float32(value)
        values[name] = field.normalize(value)
    sampling = SamplingParams(**values)
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
    return handle_as_sent(message)


# -- usage and finish reasons --------------------------------------------------------------


def usage_to_proto(usage: Usage) -> types_pb2.Usage:
    return types_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cache_write_tokens=usage.cache_write_tokens,
    )


def usage_from_proto(message: types_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        cached_tokens=message.cached_tokens,
        cache_write_tokens=message.cache_write_tokens,
    )


def finish_to_proto(reason: FinishReason | None) -> types_pb2.FinishReason.ValueType:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: types_pb2.FinishReason.ValueType) -> FinishReason | None:
    # An enum value this version does not know (a newer server) reads as an error finish.
    return _FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


def handle_as_sent(message: types_pb2.KVHandle) -> KVHandle:
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
