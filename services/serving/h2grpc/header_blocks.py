"""A response's header blocks as HTTP/2 carries them: a HEADERS frame and its CONTINUATIONs
gathered into one block, within the SETTINGS_MAX_HEADER_LIST_SIZE the client advertised.

Below: the frames' payloads (the connection passes them in, padding and priority removed).
Above: :class:`~services.serving.h2grpc.http2.H2ClientConnection`, which decodes a complete
block (:mod:`~services.serving.h2grpc.hpack_decoder`) and decides what a block too large ends.
What never crosses: no stream's state and no field is known here, only frames' bytes.
"""

from __future__ import annotations

from services.serving.h2grpc import frames
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag


class BlockTooLarge(Exception):
    """The block gathering on ``stream_id`` passed the bound: it was dropped (HPACK's state is
    then behind the server's, so the connection cannot go on, RFC 9113 §4.3); ``message`` says
    what it held."""

    def __init__(self, stream_id: int, message: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.message = message


class HeaderBlocks:
    """The header block being gathered, if any (one at a time: §6.10 lets no other frame
    between a HEADERS without END_HEADERS and its last CONTINUATION)."""

    def __init__(self) -> None:
        self.stream_id = 0
        """The stream whose block is gathering, 0 when none is."""
        self._flags = 0
        self._gathered = bytearray()
        self._charge = 0
        """What the block counts against its bound: its bytes and each of its frames' 9-byte
        header, so empty CONTINUATIONs reach the bound too."""
        self._continuations = 0

    @property
    def held_bytes(self) -> int:
        return len(self._gathered) if self.stream_id else 0

    def start(self, stream_id: int, flags: int, block: bytes) -> None:
        """A HEADERS frame without END_HEADERS: its block's first part."""
        self.stream_id, self._flags, self._gathered = stream_id, flags, bytearray(block)
        self._charge = frames.FRAME_HEADER_BYTES + len(block)
        self._continuations = 0

    def continuation(self, stream_id: int, flags: int, payload: bytes) -> tuple[int, bytes] | None:
        """A CONTINUATION: the HEADERS frame's flags and the whole block once it ends
        (END_HEADERS), else ``None``. Raises :class:`ProtocolError` for a CONTINUATION without
        its HEADERS, :class:`BlockTooLarge` past the bound."""
        if not self.stream_id or self.stream_id != stream_id:
            raise ProtocolError(
                Violation.MALFORMED,
                ErrorCode.PROTOCOL_ERROR,
                f"sent a CONTINUATION on stream {stream_id} without its HEADERS",
            )
        # Each frame is charged its header besides its payload, as nghttp2 and h2 bound a block
        # by its frames: an endless run of empty CONTINUATIONs reaches the bound as a large
        # block does (about 7,300 of them), rather than burning CPU until keepalive.
        self._charge += frames.FRAME_HEADER_BYTES + len(payload)
        self._continuations += 1
        gathered = self._gathered
        if self._charge > frames.MAX_HEADER_LIST_SIZE:
            self.stream_id, self._gathered = 0, bytearray()  # no more of it is held
            raise BlockTooLarge(
                stream_id,
                f"sent a header block of over {frames.MAX_HEADER_LIST_SIZE} bytes on stream "
                f"{stream_id} (HEADERS and {self._continuations} CONTINUATION frames, "
                f"{len(gathered) + len(payload)} bytes of fields, each frame's 9-byte header "
                f"counted), over the SETTINGS_MAX_HEADER_LIST_SIZE the client advertised",
            )
        gathered.extend(payload)
        if not flags & Flag.END_HEADERS:
            return None
        self.stream_id, self._gathered = 0, bytearray()
        return self._flags, bytes(gathered)
