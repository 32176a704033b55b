"""HPACK decoding of a server's header blocks (RFC 7541), with a cache for the common case.

A gRPC server's responses repeat: after a connection's first answers, the headers and trailers of
a successful call are indexed fields (one byte each) naming entries of the dynamic table, and
literals that are not indexed (``grpc-message`` empty). Such a block does not change the table and
decodes to the same fields as long as the table has not changed, so :class:`HpackDecoder` keeps
its results by block, stamped with the table's version, within 256 entries and 256 KiB; a block
that indexes a field or resizes the table is decoded in full. Huffman-coded strings are decoded
with the ``hpack`` package's table.

The decoded header list is bounded (``max_list_size``, the SETTINGS_MAX_HEADER_LIST_SIZE the
client advertised, counted as RFC 9113 §6.5.2 does): a small block can name a large table entry
many times, so the bound is checked as fields are decoded, not on the block's bytes. A block over
it is still decoded to its end, so the table stays the server's, and then refused
(:class:`HeaderListTooLarge`): the connection can go on.
"""

from __future__ import annotations

from collections import deque

from hpack import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from services.serving.h2grpc.frames import MAX_HEADER_LIST_SIZE

Fields = tuple[tuple[str, str], ...]

_STATIC: tuple[tuple[str, str], ...] = tuple(
    (name.decode(), value.decode()) for name, value in HeaderTable.STATIC_TABLE
)
_ENTRY_OVERHEAD = 32
_CACHE_LIMIT = 256
_CACHE_BYTES = 256 << 10
"""The cache's bound in bytes (each entry charged its block and its header list's size): a
successful call's blocks are tens of bytes, while 256 blocks of 64 KiB had held 32 MiB per
connection. An entry over an eighth of it alone is not cached (a block that large is no
successful call's). Past the bound the cache is cleared, as past :data:`_CACHE_LIMIT` entries."""


class HeaderListTooLarge(Exception):
    """A block decoded to a header list over the decoder's ``max_list_size`` (``size``: the
    list's size, fields are ASCII so characters count as bytes). The table was updated."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a header list of {size} bytes, over the {limit} advertised")
        self.size = size
        self.limit = limit


class HpackDecoder:
    """One connection's decoder (one per direction and connection: it follows the encoder's
    dynamic table). Raises ``hpack.HPACKDecodingError`` on a malformed block and
    :class:`HeaderListTooLarge` on a list over ``max_list_size``."""

    def __init__(
        self, max_list_size: int = MAX_HEADER_LIST_SIZE, max_table_size: int = 4096
    ) -> None:
        self._list_limit = max_list_size
        self._limit = max_table_size
        self._max_size = max_table_size
        self._size = 0
        self._dynamic: deque[tuple[str, str]] = deque()
        self._version = 0
        self._cache: dict[bytes, tuple[int, Fields]] = {}
        self._cache_bytes = 0

    def decode(self, block: bytes) -> Fields:
        cached = self._cache.get(block)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        fields, list_size = self._decode(block)
        if list_size >= 0:
            charge = len(block) + list_size
            if charge <= _CACHE_BYTES // 8:
                if len(self._cache) >= _CACHE_LIMIT or self._cache_bytes + charge > _CACHE_BYTES:
                    self._cache.clear()
                    self._cache_bytes = 0
                self._cache[block] = (self._version, fields)
                self._cache_bytes += charge
        return fields

    @property
    def cached_bytes(self) -> int:
        """What the cache holds, as it is bounded: blocks and their lists' sizes."""
        return self._cache_bytes

    def _decode(self, block: bytes) -> tuple[Fields, int]:
        """The block's fields and its list's size, -1 when it changed the table (not to be
        cached)."""
        fields: list[tuple[str, str]] = []
        stateless = True
        offset, end = 0, len(block)
        list_size, list_limit = 0, self._list_limit
        while offset < end:
            first = block[offset]
            if first & 0x80:
                index, offset = _integer(block, offset, 7)
                name, value = self._entry(index)
            elif first & 0x40:
                name, value, offset = self._literal(block, offset, 6)
                self._insert(name, value)
                stateless = False
            elif first & 0x20:
                stateless = False
                size, offset = _integer(block, offset, 5)
                if size > self._limit:
                    raise HPACKDecodingError(f"table size {size} over the limit {self._limit}")
                self._max_size = size
                self._evict()
                continue
            else:
                name, value, offset = self._literal(block, offset, 4)
            list_size += len(name) + len(value) + _ENTRY_OVERHEAD
            if list_size <= list_limit:  # past it, the block is only read for the table's sake
                fields.append((name, value))
        if list_size > list_limit:
            raise HeaderListTooLarge(list_size, list_limit)
        return tuple(fields), list_size if stateless else -1

    def _entry(self, index: int) -> tuple[str, str]:
        if 0 < index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if 0 <= dynamic < len(self._dynamic):
            return self._dynamic[dynamic]
        raise HPACKDecodingError(f"header index {index} out of range")

    def _literal(self, block: bytes, offset: int, prefix: int) -> tuple[str, str, int]:
        index, offset = _integer(block, offset, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, offset = _string(block, offset)
        value, offset = _string(block, offset)
        return name, value, offset

    def _insert(self, name: str, value: str) -> None:
        self._dynamic.appendleft((name, value))
        self._size += len(name.encode()) + len(value.encode()) + _ENTRY_OVERHEAD
        self._evict()
        self._version += 1

    def _evict(self) -> None:
        while self._size > self._max_size and self._dynamic:
            name, value = self._dynamic.pop()
            self._size -= len(name.encode()) + len(value.encode()) + _ENTRY_OVERHEAD
        self._version += 1


def _integer(block: bytes, offset: int, prefix: int) -> tuple[int, int]:
    limit = (1 << prefix) - 1
    value = block[offset] & limit
    offset += 1
    if value < limit:
        return value, offset
    shift = 0
    while True:
        if offset >= len(block) or shift > 28:
            raise HPACKDecodingError("truncated or oversized integer")
        byte = block[offset]
        offset += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, offset


def _string(block: bytes, offset: int) -> tuple[str, int]:
    if offset >= len(block):
        raise HPACKDecodingError("truncated string")
    huffman = block[offset] & 0x80
    length, offset = _integer(block, offset, 7)
    if offset + length > len(block):
        raise HPACKDecodingError("truncated string")
    raw = block[offset : offset + length]
    return (decode_huffman(raw) if huffman else raw).decode("utf-8", "replace"), offset + length
