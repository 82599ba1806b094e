"""Framing shared by every byte-stream transport: pure encode/decode, no I/O.

A frame is a 9-byte header (kind: u8, length: u64, network order) followed by `length` payload bytes.
kind MSG carries a msgpack-encoded dict; kind BULK carries raw bytes the receiver already sized a
buffer for. msgpack is decoded with strict limits and never into arbitrary objects, so a hostile peer
can at worst cause a ProtocolError.
"""

from __future__ import annotations

import struct

import msgpack

from ftrun.env.base import Message, ProtocolError

HEADER = struct.Struct("!BQ")
HEADER_SIZE = HEADER.size
KIND_MSG = 1
KIND_BULK = 2
MAX_MSG_BYTES = 16 * 1024 * 1024
# A control message's receive buffer starts at this size and at most doubles once the bytes already
# allocated have arrived, so memory follows what a peer actually sent, not what its header claims.
ALLOC_STEP = 64 * 1024


def encode_msg(msg: Message) -> bytes:
    """Header + msgpack payload of one control message."""
    if not isinstance(msg, dict):
        raise TypeError(f"a control message must be a dict, not {type(msg).__name__}")
    payload = msgpack.packb(msg, use_bin_type=True)
    if len(payload) > MAX_MSG_BYTES:
        raise ValueError(f"control message of {len(payload)} bytes exceeds {MAX_MSG_BYTES}")
    return HEADER.pack(KIND_MSG, len(payload)) + payload


def bulk_header(nbytes: int) -> bytes:
    return HEADER.pack(KIND_BULK, nbytes)


def parse_header(header: bytes | memoryview) -> tuple[int, int]:
    """(kind, length) of a frame header; ProtocolError for an unknown kind or oversized message."""
    kind, length = HEADER.unpack(header)
    if kind not in (KIND_MSG, KIND_BULK):
        raise ProtocolError(f"unknown frame kind {kind}")
    if kind == KIND_MSG and length > MAX_MSG_BYTES:
        raise ProtocolError(f"control message of {length} bytes exceeds {MAX_MSG_BYTES}")
    return kind, length


def next_alloc(received: int, length: int) -> int:
    """Bytes to add to a receive buffer that holds `received` of a `length`-byte message (0: done)."""
    if not 0 <= received <= length:
        raise ValueError(f"received {received} of a {length}-byte message")
    return min(length - received, max(received, ALLOC_STEP))


def decode_msg(payload: bytes | bytearray | memoryview) -> Message:
    """The dict in a MSG payload; ProtocolError if it is not valid msgpack or not a dict."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable control message: {e}") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"control message must be a map, got {type(msg).__name__}")
    return msg


def expect_kind(got: int, want: int, length: int, want_length: int | None = None) -> None:
    """Raise ProtocolError unless the frame is of the kind (and size) the receiver asked for."""
    names = {KIND_MSG: "control message", KIND_BULK: "bulk frame"}
    if got != want:
        raise ProtocolError(f"expected a {names[want]}, got a {names[got]} of {length} bytes")
    if want_length is not None and length != want_length:
        raise ProtocolError(f"expected a bulk frame of {want_length} bytes, got {length}")
