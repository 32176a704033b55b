"""What KV workers tell each other besides the bulk bytes: identities and completion notices.

A consumer rank that finished (or gave up) reading a request's KV from a producer worker sends
that worker one :class:`KVNotification` over NIXL's notification channel. The producer counts
them per request; ``expected_notifiers`` says how many consumer ranks of that engine read from
that producer worker (computed by every consumer rank from the two engines' layouts, the same
way), so the producer knows when the last one has come without a side channel (vLLM sends the
same count as ``req_id:tp_ratio``).

Notifications come from remote agents: a trust boundary. :func:`decode_notification` bounds the
size, checks the version and builds the dataclass field by field, raising only
:class:`NotificationDecodeError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from services.codec import MsgpackBounds, UnpackError, unpack_bounded
from services.control_plane.wire import EngineId, Generation
from services.kv_transfer.errors import NotificationDecodeError
from services.topology.ranges import RankKey

# Notification format history:
#   1: first version.
NOTIFICATION_VERSION = 1
MAX_NOTIFICATION_BYTES = 1024
MAX_REQUEST_ID_LENGTH = 256

RequestId = str
BlockIds = tuple[int, ...]


def rank_label(rank: RankKey) -> str:
    """``(0, 1)`` -> ``"pp0tp1"``: how ranks appear in metric labels and logs."""
    return f"pp{rank[0]}tp{rank[1]}"


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a KV worker is: its engine, that engine's generation and its ``(pp, tp)`` rank."""

    engine_id: EngineId
    generation: Generation
    pp_rank: int
    tp_rank: int

    @property
    def rank(self) -> RankKey:
        return (self.pp_rank, self.tp_rank)

    @property
    def label(self) -> str:
        return rank_label(self.rank)


@dataclass(frozen=True)
class KVNotification:
    """One consumer rank is done with one request's KV on the receiving producer worker."""

    request_id: RequestId
    consumer_engine: EngineId
    consumer_generation: Generation
    consumer_rank: RankKey
    expected_notifiers: int
    """How many consumer ranks of ``consumer_engine`` read this request from the receiver."""
    ok: bool
    """False when the consumer rank gave up (failed reads): the producer may free all the same."""


def encode_notification(notification: KVNotification) -> bytes:
    """The wire form of a notification (msgpack, versioned)."""
    body = [
        NOTIFICATION_VERSION,
        notification.request_id,
        notification.consumer_engine,
        notification.consumer_generation,
        notification.consumer_rank[0],
        notification.consumer_rank[1],
        notification.expected_notifiers,
        notification.ok,
    ]
    data: bytes = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"notification of {len(data)} bytes exceeds {MAX_NOTIFICATION_BYTES}")
    return data


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise NotificationDecodeError(f"notification field {name} is not an int >= {minimum}")
    return int(value)


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_ID_LENGTH:
        raise NotificationDecodeError(f"notification field {name} is not a short string")
    return value


_NOTIFICATION_BOUNDS = MsgpackBounds(
    max_bytes=MAX_NOTIFICATION_BYTES,
    max_str_len=MAX_NOTIFICATION_BYTES,
    max_bin_len=0,
    max_array_len=16,
    max_map_len=0,
)


def decode_notification(data: bytes) -> KVNotification:
    """Decode and validate one notification; raises :class:`NotificationDecodeError` only."""
    try:
        body = unpack_bounded(data, _NOTIFICATION_BOUNDS)
    except UnpackError as exc:
        raise NotificationDecodeError(f"notification is {exc.reason}: {exc}") from exc
    if not isinstance(body, list) or not body:
        raise NotificationDecodeError("notification is not a versioned list")
    if body[0] != NOTIFICATION_VERSION:
        raise NotificationDecodeError(
            f"notification version {body[0]!r}, expected {NOTIFICATION_VERSION}",
            reason="wrong_version",
        )
    if len(body) != 8:
        raise NotificationDecodeError(f"notification has {len(body)} fields, expected 8")
    _, request_id, engine, generation, pp, tp, expected, ok = body
    if not isinstance(ok, bool):
        raise NotificationDecodeError("notification field ok is not a bool")
    return KVNotification(
        request_id=_str(request_id, "request_id"),
        consumer_engine=_str(engine, "consumer_engine"),
        consumer_generation=_int(generation, "consumer_generation"),
        consumer_rank=(_int(pp, "pp_rank"), _int(tp, "tp_rank")),
        expected_notifiers=_int(expected, "expected_notifiers", minimum=1),
        ok=ok,
    )
