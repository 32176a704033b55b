"""The byte-level pieces of the h2grpc client against the ``hpack`` package's reference codec:
request header blocks decode to what gRPC asks for, the response decoder follows an encoder's
dynamic table (Huffman or not, indexed or not, table resized) and its cache never answers for a
table that changed."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.serving.h2grpc import frames, grpc_wire
from services.serving.h2grpc.hpack_decoder import HpackDecoder


def test_request_headers_decode_to_grpc_fields_and_reset_the_table() -> None:
    prefix = grpc_wire.request_headers_prefix(
        b"/pdserve.v1.DecodeService/Decode", b"h:1", tls=False
    )
    block = frames.TABLE_SIZE_ZERO + prefix + grpc_wire.timeout_field(1.5)
    assert hpack.Decoder().decode(block) == [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/pdserve.v1.DecodeService/Decode"),
        (":authority", "h:1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-accept-encoding", "identity"),
        ("user-agent", "pdserve-h2grpc"),
        ("grpc-timeout", "1500000u"),
    ]
    tls = grpc_wire.request_headers_prefix(b"/x", b"h" * 300, tls=True)  # multi-byte lengths
    assert hpack.Decoder().decode(tls)[1:4] == [
        (":scheme", "https"),
        (":path", "/x"),
        (":authority", "h" * 300),
    ]


def test_metadata_decodes_as_literal_fields_with_new_names() -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    metadata = [
        ("traceparent", traceparent),
        ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        ("x.a_b-c", ""),
        ("trace-bin", b"\x00\xff\x10"),  # base64 without padding (4 characters, not "AP8Q")
        ("long", "v" * 300),  # multi-byte string lengths
    ]
    block = grpc_wire.metadata_block(metadata)
    decoder = hpack.Decoder()
    assert decoder.decode(block) == [
        ("traceparent", traceparent),
        ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        ("x.a_b-c", ""),
        ("trace-bin", "AP8Q"),
        ("long", "v" * 300),
    ]
    # 6.2.2: each field starts 0000 0000 (never indexed: no dynamic table entry on either side).
    assert block[0] == 0 and len(decoder.header_table.dynamic_entries) == 0
    assert grpc_wire.metadata_block([("b-bin", b"\xfb")]).endswith(b"\x02+w")  # "+w==" unpadded
    # After the request's own fields, as gRPC orders them: one block decodes to both.
    prefix = grpc_wire.request_headers_prefix(b"/x", b"h:1", tls=False) + grpc_wire.timeout_field(1)
    fields = hpack.Decoder().decode(prefix + block)
    assert fields[-6:-4] == [("grpc-timeout", "1000000u"), ("traceparent", traceparent)]


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ([(":path", "/x")], "not a custom gRPC metadata name"),
        ([("grpc-timeout", "1S")], "not a custom gRPC metadata name"),
        ([("Traceparent", "x")], "not a custom gRPC metadata name"),
        ([("", "x")], "not a custom gRPC metadata name"),
        ([("a b", "x")], "not a custom gRPC metadata name"),
        ([("te", "trailers")], "reserved"),
        ([("content-type", "text/plain")], "reserved"),
        ([("connection", "close")], "reserved"),
        ([("a", "caf\u00e9")], "printable ASCII"),
        ([("a", "line\nbreak")], "printable ASCII"),
        ([("a", " padded")], "printable ASCII"),
        ([("a", b"bytes")], "printable ASCII"),
        ([("a-bin", "text")], "must be bytes"),
        ([("a", "v" * 8200)], "over 8192"),
    ],
)
def test_metadata_that_breaks_grpc_rules_is_refused(
    metadata: list[tuple[str, str | bytes]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        grpc_wire.metadata_block(metadata)


@pytest.mark.parametrize(
    ("seconds", "field"),
    [
        (0.0, "1n"),
        (0.05, "50000000n"),
        (0.25, "250000u"),
        (120.0, "120000m"),
        (1e9, "16666667M"),
        (1e15, "99999999H"),  # beyond every unit: the largest value
    ],
)
def test_timeouts_use_at_most_eight_digits_and_never_round_down(seconds: float, field: str) -> None:
    assert hpack.Decoder().decode(grpc_wire.timeout_field(seconds)) == [("grpc-timeout", field)]


def test_frame_header_round_trip() -> None:
    data = frames.frame(frames.FrameType.HEADERS, frames.Flag.END_HEADERS, 7, b"x" * 70_000)
    assert frames.parse_frame_header(data, 0) == (70_000, 1, 4, 7)


names = st.sampled_from(
    [":status", "content-type", "grpc-status", "grpc-message", "x-meta", "pdserve-error"]
)
values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
blocks = st.lists(
    st.tuples(
        st.lists(st.tuples(names, values), min_size=1, max_size=6),
        st.booleans(),  # Huffman
        st.booleans(),  # sensitive: never indexed
        st.sampled_from([None, 0, 64, 256, 4096]),  # table size set before the block
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(blocks)
def test_decoder_follows_the_reference_encoder(
    sequence: list[tuple[list[tuple[str, str]], bool, bool, int | None]],
) -> None:
    encoder, decoder = hpack.Encoder(), HpackDecoder()
    for fields, huffman, sensitive, table_size in sequence:
        if table_size is not None:
            encoder.header_table_size = table_size
        headers = [hpack.NeverIndexedHeaderTuple(n, v) if sensitive else (n, v) for n, v in fields]
        block = encoder.encode(headers, huffman=huffman)
        assert decoder.decode(block) == tuple(fields)


def test_a_cached_block_is_decoded_again_once_the_table_changed() -> None:
    encoder, decoder = hpack.Encoder(), HpackDecoder()
    first = encoder.encode([("grpc-status", "0")])  # indexes the field
    decoder.decode(first)
    indexed = encoder.encode([("grpc-status", "0")])
    assert len(indexed) == 1 and decoder.decode(indexed) == (("grpc-status", "0"),)
    assert decoder.decode(indexed) == (("grpc-status", "0"),)  # from the cache
    # A new entry shifts the index of the old one: the same byte now names the new field.
    decoder.decode(encoder.encode([("x-meta", "new")]))
    assert decoder.decode(indexed) == (("x-meta", "new"),)


def test_malformed_blocks_raise() -> None:
    for block in (b"\xff", b"\x80", b"\x00\x85ab", b"\xbf\xff\xff\xff\xff\xff"):
        with pytest.raises(hpack.HPACKDecodingError):
            HpackDecoder().decode(block)
