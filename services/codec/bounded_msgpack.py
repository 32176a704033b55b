"""One bounded msgpack decode for bytes a peer sent (Redis, NIXL notifications, ZMQ events).

Every limit msgpack's unpacker offers is set from :class:`MsgpackBounds` (strings, binaries,
arrays, maps; no extension types), the whole buffer is refused past ``max_bytes`` before it is
read, and every way msgpack fails on hostile bytes (a size limit, bad UTF-8, trailing data, a
truncated or unknown format, nesting past its stack) is one :class:`UnpackError` whose
``reason`` says which. Callers translate it into their own error type at their boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import msgpack

Reason = Literal["oversized", "malformed"]


class UnpackError(ValueError):
    """Bytes that are not one bounded msgpack value; ``reason``: ``oversized`` (the buffer is
    larger than ``max_bytes``) or ``malformed`` (anything msgpack refused)."""

    def __init__(self, message: str, reason: Reason) -> None:
        super().__init__(message)
        self.reason: Reason = reason


@dataclasses.dataclass(frozen=True)
class MsgpackBounds:
    """The most one decode may hold; each field is a limit of ``msgpack.unpackb``."""

    max_bytes: int
    """The whole buffer."""
    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    strict_map_key: bool = True
    """Map keys are ``str`` or ``bytes`` only (msgpack's default)."""


_MSGPACK_ERRORS = (
    # UnicodeDecodeError and msgpack's size-limit errors are ValueErrors.
    ValueError,
    TypeError,
    msgpack.ExtraData,
    msgpack.FormatError,
    msgpack.StackError,
)


def unpack_bounded(data: bytes, bounds: MsgpackBounds) -> Any:
    """The one msgpack value in ``data`` within ``bounds``; :class:`UnpackError` otherwise."""
    if len(data) > bounds.max_bytes:
        raise UnpackError(f"{len(data)} bytes exceed {bounds.max_bytes}", reason="oversized")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=bounds.strict_map_key,
            max_str_len=bounds.max_str_len,
            max_bin_len=bounds.max_bin_len,
            max_array_len=bounds.max_array_len,
            max_map_len=bounds.max_map_len,
            max_ext_len=0,
        )
    except _MSGPACK_ERRORS as exc:
        raise UnpackError(f"not valid msgpack: {exc}", reason="malformed") from exc
