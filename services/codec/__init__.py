"""Decoding what a peer sent: msgpack with every size bound (:mod:`.bounded_msgpack`). No import
from the rest of ``services``: the control plane's records, KV-transfer notifications, KV events
and vLLM's handshake extra all decode through it."""

from services.codec.bounded_msgpack import MsgpackBounds, UnpackError, unpack_bounded

__all__ = ["MsgpackBounds", "UnpackError", "unpack_bounded"]
