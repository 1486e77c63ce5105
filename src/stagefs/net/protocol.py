"""The stagefs peer protocol, version 2: frames and messages, with no I/O (docs/PROTOCOL.md).

A frame is a 12-byte header (magic ``SFSN``, version, message type, flags, payload length,
all big-endian) followed by the payload. ``encode``/``encode_parts`` turn a message into
bytes; ``FrameDecoder`` turns bytes (fed in any pieces) back into messages. Anything that is
not a valid frame raises ``ProtocolError`` and nothing else, whatever the bytes.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from stagefs.errors import ProtocolError, ProtocolVersionError

__all__ = [
    "DATA_HEAD",
    "HEADER",
    "MAGIC",
    "MAX_FRAME",
    "MAX_RANGES",
    "NONCE_SIZE",
    "SLOT_SIZE",
    "VERSION",
    "Auth",
    "AuthOk",
    "Challenge",
    "Check",
    "Data",
    "Error",
    "FrameDecoder",
    "Message",
    "Range",
    "Read",
    "Status",
    "StatusRequest",
    "data_head",
    "data_slots",
    "decode_payload",
    "encode",
    "encode_parts",
    "parse_header",
]

MAGIC = b"SFSN"
VERSION = 2  # 2: the handshake proofs cover the connection's server end (net/auth.py)
HEADER = struct.Struct("!4sBBHI")  # magic, version, type, flags, payload length
NONCE_SIZE = 32
MAC_SIZE = 32
MAX_FRAME = 256 * 2**20  # no frame is larger, whatever a peer claims
MAX_RANGES = 65536  # ranges in one READ

_RANGE = struct.Struct("!IQI")  # shard, offset, length
_SLOT = struct.Struct("!BI")  # status, length
_COUNT = struct.Struct("!II")  # request id, count
DATA_HEAD = _COUNT.size  # a DATA payload begins with its request id and slot count
SLOT_SIZE = _SLOT.size
_ERR = struct.Struct("!H")
_SHARD = struct.Struct("!I")

# message types
T_CHALLENGE, T_AUTH, T_AUTH_OK, T_READ, T_DATA, T_STATUS_REQ, T_STATUS, T_ERROR = range(1, 9)
T_CHECK = 9

# DATA slot status
OK, NOT_HELD, INVALID = 0, 1, 2

# ERROR codes
E_PROTOCOL, E_VERSION, E_AUTH, E_BUSY, E_TOO_LARGE, E_INTERNAL = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True, slots=True)
class Challenge:
    """Server → client on connect: a fresh nonce and the pack the server serves."""

    nonce: bytes
    pack_id: bytes  # 16 bytes


@dataclass(frozen=True, slots=True)
class Auth:
    """Client → server: its own nonce and HMAC(token, server nonce, client nonce)."""

    nonce: bytes
    mac: bytes


@dataclass(frozen=True, slots=True)
class AuthOk:
    """Server → client: the server's proof that it holds the token too."""

    mac: bytes


class Range(NamedTuple):
    """(shard, offset, length): a tuple, so a READ of many is decoded and built cheaply."""

    shard: int
    offset: int
    length: int


_as_range = functools.partial(tuple.__new__, Range)  # a (shard, offset, length) as a Range

@dataclass(frozen=True, slots=True)
class Read:
    """Client → server: many byte ranges in one request."""

    request_id: int
    ranges: tuple[Range, ...]


@dataclass(frozen=True, slots=True)
class Data:
    """Server → client: one slot per range asked, in order; ``None`` where not served."""

    request_id: int
    chunks: tuple[bytes | memoryview | None, ...]
    statuses: tuple[int, ...] = ()

    def status(self, i: int) -> int:
        if self.statuses:
            return self.statuses[i]
        return OK if self.chunks[i] is not None else NOT_HELD


@dataclass(frozen=True, slots=True)
class StatusRequest:
    pass


@dataclass(frozen=True, slots=True)
class Status:
    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Error:
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Check:
    """Client → server: bytes of this shard from this node (or relayed by it) failed their
    checksum; check the copy (answered with a STATUS: ``{"check": outcome}``)."""

    shard: int


Message = Challenge | Auth | AuthOk | Read | Data | StatusRequest | Status | Error | Check


def _frame(mtype: int, payload_len: int) -> bytes:
    if payload_len > MAX_FRAME:
        raise ProtocolError(f"frame of {payload_len} bytes exceeds the limit of {MAX_FRAME}")
    return HEADER.pack(MAGIC, VERSION, mtype, 0, payload_len)


def encode_parts(msg: Message) -> list[bytes | memoryview]:
    """The frame of ``msg`` as a list of buffers (DATA payloads are not copied)."""
    if isinstance(msg, Data):
        slots = bytearray(_COUNT.pack(msg.request_id, len(msg.chunks)))
        body: list[bytes | memoryview] = []
        for i, c in enumerate(msg.chunks):
            st = msg.status(i)
            if c is None or st != OK:
                slots += _SLOT.pack(st if st != OK else NOT_HELD, 0)
            else:
                if not isinstance(c, bytes | memoryview):  # a relay's pipes are sent apart
                    raise TypeError("encode_parts: a DATA chunk must be bytes or a memoryview")
                slots += _SLOT.pack(OK, len(c))
                body.append(c)
        total = len(slots) + sum(len(b) for b in body)
        return [_frame(T_DATA, total) + bytes(slots), *body]
    mtype, payload = _payload(msg)
    return [_frame(mtype, len(payload)) + payload]


def encode(msg: Message) -> bytes:
    return b"".join(encode_parts(msg))


def _payload(msg: Message) -> tuple[int, bytes]:
    if isinstance(msg, Challenge):
        _check_len("nonce", msg.nonce, NONCE_SIZE)
        _check_len("pack id", msg.pack_id, 16)
        return T_CHALLENGE, msg.nonce + msg.pack_id
    if isinstance(msg, Auth):
        _check_len("nonce", msg.nonce, NONCE_SIZE)
        _check_len("mac", msg.mac, MAC_SIZE)
        return T_AUTH, msg.nonce + msg.mac
    if isinstance(msg, AuthOk):
        _check_len("mac", msg.mac, MAC_SIZE)
        return T_AUTH_OK, msg.mac
    if isinstance(msg, Read):
        if len(msg.ranges) > MAX_RANGES:
            raise ProtocolError(f"{len(msg.ranges)} ranges in one READ (limit {MAX_RANGES})")
        try:
            parts = [_COUNT.pack(msg.request_id, len(msg.ranges))]
            parts += [_RANGE.pack(*r) for r in msg.ranges]
        except struct.error as exc:
            raise ProtocolError(f"range out of bounds: {exc}") from exc
        return T_READ, b"".join(parts)
    if isinstance(msg, StatusRequest):
        return T_STATUS_REQ, b""
    if isinstance(msg, Status):
        return T_STATUS, json.dumps(msg.info, sort_keys=True).encode()
    if isinstance(msg, Error):
        return T_ERROR, _ERR.pack(msg.code) + msg.message.encode("utf-8", "replace")
    if isinstance(msg, Check):
        try:
            return T_CHECK, _SHARD.pack(msg.shard)
        except struct.error as exc:
            raise ProtocolError(f"shard out of bounds: {exc}") from exc
    raise ProtocolError(f"cannot encode {type(msg).__name__}")


def _check_len(what: str, value: bytes, size: int) -> None:
    if len(value) != size:
        raise ProtocolError(f"{what} must be {size} bytes, not {len(value)}")


def parse_header(header: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME
                 ) -> tuple[int, int]:
    """Check a 12-byte frame header; return (message type, payload length)."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"frame header is {HEADER.size} bytes, got {len(header)}")
    magic, version, mtype, _flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"not a stagefs frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolVersionError(
            f"peer speaks protocol version {version}, this stagefs speaks {VERSION}: run the "
            "same stagefs version on every node"
        )
    if not T_CHALLENGE <= mtype <= T_CHECK:
        raise ProtocolError(f"unknown message type {mtype}")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    return mtype, length


def decode_payload(mtype: int, payload: bytes | bytearray | memoryview) -> Message:
    """The message of type ``mtype`` in ``payload`` (DATA chunks are views of ``payload``)."""
    p = memoryview(payload)
    n = len(p)
    if mtype == T_CHALLENGE:
        _need(n == NONCE_SIZE + 16, "CHALLENGE", n)
        return Challenge(bytes(p[:NONCE_SIZE]), bytes(p[NONCE_SIZE:]))
    if mtype == T_AUTH:
        _need(n == NONCE_SIZE + MAC_SIZE, "AUTH", n)
        return Auth(bytes(p[:NONCE_SIZE]), bytes(p[NONCE_SIZE:]))
    if mtype == T_AUTH_OK:
        _need(n == MAC_SIZE, "AUTH_OK", n)
        return AuthOk(bytes(p))
    if mtype == T_READ:
        _need(n >= _COUNT.size, "READ", n)
        rid, count = _COUNT.unpack_from(p)
        _need(count <= MAX_RANGES and n == _COUNT.size + count * _RANGE.size, "READ", n)
        ranges = tuple(map(_as_range, _RANGE.iter_unpack(p[_COUNT.size :])))
        return Read(rid, ranges)
    if mtype == T_DATA:
        return _decode_data(p)
    if mtype == T_STATUS_REQ:
        _need(n == 0, "STATUS_REQ", n)
        return StatusRequest()
    if mtype == T_STATUS:
        try:
            info = json.loads(bytes(p).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"STATUS payload is not JSON: {exc}") from None
        if not isinstance(info, dict):
            raise ProtocolError("STATUS payload is not a JSON object")
        return Status(info)
    if mtype == T_ERROR:
        _need(n >= _ERR.size, "ERROR", n)
        (code,) = _ERR.unpack_from(p)
        return Error(code, bytes(p[_ERR.size :]).decode("utf-8", "replace"))
    if mtype == T_CHECK:
        _need(n == _SHARD.size, "CHECK", n)
        return Check(_SHARD.unpack_from(p)[0])
    raise ProtocolError(f"unknown message type {mtype}")


def data_head(head: bytes | bytearray | memoryview, payload_len: int) -> tuple[int, int]:
    """(request id, count) from the first ``DATA_HEAD`` bytes of a DATA payload of
    ``payload_len`` bytes: the slot table that follows must fit in it."""
    _need(len(head) == _COUNT.size and payload_len >= _COUNT.size, "DATA", payload_len)
    rid, count = _COUNT.unpack_from(head)
    _need(count <= MAX_RANGES and _COUNT.size + count * _SLOT.size <= payload_len, "DATA",
          payload_len)
    return rid, count


def data_slots(table: bytes | bytearray | memoryview, count: int, payload_len: int
               ) -> tuple[list[int], list[int]]:
    """(statuses, lengths) of the ``count`` slots in ``table``, checked: an OK slot's bytes
    follow the table back to back and fill the rest of the payload exactly, a NOT_HELD or
    INVALID slot has length 0. A receiver that takes the bytes slot by slot off a stream
    (net/client.py) checks the frame as the whole-frame decoder does."""
    _need(len(table) == count * _SLOT.size, "DATA", payload_len)
    statuses: list[int] = []
    lengths: list[int] = []
    for st, length in _SLOT.iter_unpack(table):
        if not (st == OK or (st in (NOT_HELD, INVALID) and length == 0)):
            raise ProtocolError(f"DATA slot with status {st} and length {length}")
        statuses.append(st)
        lengths.append(length)
    body = payload_len - _COUNT.size - len(table)
    if sum(lengths) != body:
        raise ProtocolError(f"DATA frame of {body} data bytes announces {sum(lengths)}")
    return statuses, lengths


def _decode_data(p: memoryview) -> Data:
    n = len(p)
    rid, count = data_head(p[: _COUNT.size], n)
    table_end = _COUNT.size + count * _SLOT.size
    statuses, lengths = data_slots(p[_COUNT.size : table_end], count, n)
    chunks: list[memoryview | None] = []
    pos = table_end
    for st, length in zip(statuses, lengths, strict=True):
        chunks.append(p[pos : pos + length] if st == OK else None)
        pos += length
    return Data(rid, tuple(chunks), tuple(statuses))


def _need(ok: bool, what: str, n: int) -> None:
    if not ok:
        raise ProtocolError(f"malformed {what} message ({n} payload bytes)")


class FrameDecoder:
    """Feed bytes in, take messages out. Holds at most one partial frame."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_message(self) -> Message | None:
        """The next complete message, or None if more bytes are needed."""
        if len(self._buf) < HEADER.size:
            return None
        mtype, length = parse_header(bytes(self._buf[: HEADER.size]), self.max_frame)
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return decode_payload(mtype, payload)

    def has_frame(self) -> bool:
        """Whether a whole frame is buffered (ProtocolError if its header is malformed)."""
        if len(self._buf) < HEADER.size:
            return False
        _, length = parse_header(bytes(self._buf[: HEADER.size]), self.max_frame)
        return len(self._buf) >= HEADER.size + length

    def messages(self) -> list[Message]:
        out: list[Message] = []
        while (m := self.next_message()) is not None:
            out.append(m)
        return out

    def eof(self) -> None:
        """The stream ended: a partial frame left over is an error."""
        if self._buf:
            raise ProtocolError(f"connection closed inside a frame ({len(self._buf)} bytes)")

    @property
    def pending(self) -> int:
        return len(self._buf)


def ranges_from(seq: Sequence[tuple[int, int, int]]) -> tuple[Range, ...]:
    return tuple(Range(s, o, n) for s, o, n in seq)
