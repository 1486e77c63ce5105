"""The peer protocol's framing: every message round-trips; bad bytes give ProtocolError only."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagefs.errors import ProtocolError
from stagefs.net import protocol as P

nonce = st.binary(min_size=P.NONCE_SIZE, max_size=P.NONCE_SIZE)
rng = st.builds(P.Range, st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
                st.integers(0, 2**32 - 1))
json_val = st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(), c,
                                                                             max_size=3),
                        max_leaves=8)
messages = st.one_of(
    st.builds(P.Challenge, nonce, st.binary(min_size=16, max_size=16)),
    st.builds(P.Auth, nonce, st.binary(min_size=32, max_size=32)),
    st.builds(P.AuthOk, st.binary(min_size=32, max_size=32)),
    st.builds(P.Read, st.integers(0, 2**32 - 1), st.lists(rng, max_size=20).map(tuple)),
    st.builds(P.Data, st.integers(0, 2**32 - 1),
              st.lists(st.none() | st.binary(max_size=300), max_size=10).map(tuple)),
    st.builds(P.StatusRequest),
    st.builds(P.Status, st.dictionaries(st.text(), json_val, max_size=5)),
    st.builds(P.Error, st.integers(0, 65535), st.text(max_size=50)),
    st.builds(P.Check, st.integers(0, 2**32 - 1)),
)


def _same(a: P.Message, b: P.Message) -> bool:
    if isinstance(a, P.Data) and isinstance(b, P.Data):
        return a.request_id == b.request_id and [None if c is None else bytes(c)
                                                 for c in a.chunks] == [
            None if c is None else bytes(c) for c in b.chunks]
    return a == b


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, min_size=1, max_size=5), st.integers(1, 64))
def test_roundtrip_in_any_pieces(msgs: list[P.Message], step: int) -> None:
    wire = b"".join(P.encode(m) for m in msgs)
    dec = P.FrameDecoder()
    got: list[P.Message] = []
    for i in range(0, len(wire), step):
        dec.feed(wire[i : i + step])
        got += dec.messages()
    dec.eof()
    assert len(got) == len(msgs)
    assert all(_same(a, b) for a, b in zip(msgs, got, strict=True))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_protocol_error(data: bytes) -> None:
    dec = P.FrameDecoder(max_frame=1 << 16)
    dec.feed(data)
    try:
        dec.messages()
        dec.eof()
    except ProtocolError:
        pass


@settings(max_examples=500, deadline=None)
@given(messages, st.data())
def test_truncated_or_mutated_frames(msg: P.Message, data: st.DataObject) -> None:
    wire = P.encode(msg)
    cut = data.draw(st.integers(1, len(wire) - 1))
    dec = P.FrameDecoder()
    dec.feed(wire[:cut])
    assert dec.next_message() is None  # waits for more, never a wrong message
    with pytest.raises(ProtocolError):
        dec.eof()
    # a payload decoded with a wrong length or one flipped byte: ProtocolError or a message
    mtype, _ = P.parse_header(wire[: P.HEADER.size])
    payload = bytearray(wire[P.HEADER.size :])
    for p in (payload[: max(0, len(payload) - 1)], payload + b"\x00"):
        with contextlib.suppress(ProtocolError):
            P.decode_payload(mtype, p)
    if payload:
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] ^= data.draw(st.integers(1, 255))
        with contextlib.suppress(ProtocolError):
            P.decode_payload(mtype, payload)


@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**32 - 1))
def test_any_header(version: int, mtype: int, length: int) -> None:
    raw = struct.pack("!4sBBHI", P.MAGIC, version, mtype, 0, length)
    try:
        t, n = P.parse_header(raw, max_frame=1 << 20)
    except ProtocolError:
        return
    assert version == P.VERSION and n == length <= 1 << 20 and t == mtype


def test_version_and_size_errors_say_what_to_do() -> None:
    raw = struct.pack("!4sBBHI", P.MAGIC, 9, 1, 0, 0)
    with pytest.raises(ProtocolError, match="same stagefs version"):
        P.parse_header(raw)
    raw = struct.pack("!4sBBHI", P.MAGIC, P.VERSION, 4, 0, 10**6)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        P.parse_header(raw, max_frame=1000)
    with pytest.raises(ProtocolError, match="not a stagefs frame"):
        P.parse_header(b"GET / HTTP/1")
    with pytest.raises(ProtocolError):
        P.encode(P.Challenge(b"short", b"x" * 16))
    with pytest.raises(ProtocolError, match="out of bounds"):
        P.encode(P.Read(1, (P.Range(-1, 0, 0),)))


def test_data_parts_are_not_copied() -> None:
    blob = bytes(range(256)) * 100
    parts = P.encode_parts(P.Data(7, (memoryview(blob)[:10], None, blob)))
    assert parts[2] is blob
    msg = P.decode_payload(P.T_DATA, b"".join(parts)[P.HEADER.size :])
    assert isinstance(msg, P.Data)
    assert msg.status(1) == P.NOT_HELD and bytes(msg.chunks[2] or b"") == blob
