"""The byte layout of bitcoll's data connections: frame header, abort notice, integrity tag.

No sockets here: only how frames look on the wire (the peer hello of the TCP transport is in
:mod:`bitcoll.transport.handshake`).

Frame
-----
A frame is a 40-byte header (:class:`FrameHeader`; little-endian ``u32 magic, u16 version,
u16 kind, u64 seq, u32 step, u32 signature, u64 length, u64 argmap``), then ``length``
payload bytes, then,
on connections with frame integrity on, a :data:`FRAME_TAG_BYTES`-byte tag
(:func:`frame_tag`).

Abort notice
------------
A frame of kind :attr:`FrameKind.ABORT` whose payload is the UTF-8 reason (at most
:data:`MAX_REASON_BYTES` bytes; ``seq``, ``step`` and ``signature`` are zero). On connections
with frame integrity on it carries a tag like a data frame (:func:`abort_frame` with a key):
its number is the count of data frames written before it on the connection, which is the
count the receiver has checked when it reads the notice, so a notice inserted on the way, or
one replayed from another connection or position, does not verify.
"""

from __future__ import annotations

import struct
from typing import Any, Final, NamedTuple

from ..arguments import differing_slots
from ..errors import ProtocolError, UsageError

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "FRAME_TAG_BYTES",
    "MAX_REASON_BYTES",
    "FrameKind",
    "FrameHeader",
    "abort_frame",
    "decode_reason",
    "blake3_module",
    "tag_hasher",
    "frame_tag",
]

MAGIC: Final = 0xB17C0110
PROTOCOL_VERSION: Final = 3
# magic, version, kind, seq, step, signature, length, argmap
_HEADER: Final = struct.Struct("<IHHQIIQQ")
HEADER_SIZE: Final = _HEADER.size  # 40 bytes
#: Bytes of a frame's integrity tag (``integrity=True``): keyed BLAKE3, 128 bits.
FRAME_TAG_BYTES: Final = 16
#: Longest abort reason carried by an ABORT frame or read from one.
MAX_REASON_BYTES: Final = 16 << 10


class FrameKind:
    """Values of the header's ``kind`` field."""

    DATA = 1
    ABORT = 2


class FrameHeader(NamedTuple):
    """A frame header (immutable; a named tuple, as every frame makes one).

    ``seq`` is the communicator's collective sequence number (identical on every rank for the
    same call), ``step`` counts the frames of this collective between one ordered pair of ranks,
    ``signature`` is a 32-bit digest of the collective's name and arguments (so a rank in a
    different collective is detected), ``length`` is the payload size in bytes, ``argmap`` the
    call's argument map (:func:`bitcoll.arguments.argument_map`: a small digest per argument,
    so that a rank that receives a different signature can name the arguments that differ; 0
    in frames that are no collective's).
    """

    seq: int
    step: int
    signature: int
    length: int
    kind: int = FrameKind.DATA
    magic: int = MAGIC
    version: int = PROTOCOL_VERSION
    argmap: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(self.magic, self.version, self.kind, self.seq, self.step,
                            self.signature, self.length, self.argmap)

    def pack_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        _HEADER.pack_into(buf, offset, self.magic, self.version, self.kind, self.seq,
                          self.step, self.signature, self.length, self.argmap)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> FrameHeader:
        """Decode a header; raise ProtocolError on a wrong size, magic or version."""
        if len(data) != HEADER_SIZE:
            raise ProtocolError(f"frame header has {len(data)} bytes, expected {HEADER_SIZE}")
        magic, version, kind, seq, step, sig, length, argmap = _HEADER.unpack(data)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic 0x{magic:08x} (expected 0x{MAGIC:08x}): "
                                "the peer is not a bitcoll rank or the stream is corrupt")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks bitcoll protocol version {version}, "
                                f"this rank speaks {PROTOCOL_VERSION}")
        return cls(seq=seq, step=step, signature=sig, length=length, kind=kind, magic=magic,
                   version=version, argmap=argmap)

    def differing(self, expected: FrameHeader) -> tuple[int, ...] | None:
        """When this (received) header is another call's than ``expected`` (same sequence
        number, different signature): the slots of the two argument maps that differ (0: the
        collective, ``i``: its argument ``i``; :func:`bitcoll.arguments.differing_slots`;
        empty when the maps do not tell) for :attr:`ProtocolError.slots`; else None."""
        if self.seq != expected.seq or self.signature == expected.signature:
            return None
        return differing_slots(self.argmap, expected.argmap)

    def mismatch(self, expected: FrameHeader, peer: int) -> str | None:
        """Describe how this (received) header differs from ``expected``, or None if equal."""
        if self.seq != expected.seq:
            return (f"rank {peer} sent a frame of collective #{self.seq} while this rank is in "
                    f"collective #{expected.seq}: the ranks called different numbers of "
                    "collectives")
        if self.signature != expected.signature:
            slots = self.differing(expected) or ()
            if 0 in slots:
                return f"collective #{expected.seq}: rank {peer} called a different collective"
            which = f" ({', '.join(f'argument {i}' for i in slots)})" if slots else ""
            return (f"collective #{expected.seq}: rank {peer} called it with different "
                    f"arguments{which}")
        if self.step != expected.step:
            return f"rank {peer} sent step {self.step}, expected step {expected.step}"
        if self.length != expected.length:
            return (f"rank {peer} sent {self.length} payload bytes, this rank expected "
                    f"{expected.length}: mismatched lengths or dtypes across ranks")
        if self.kind != expected.kind:
            return f"rank {peer} sent a frame of kind {self.kind}, expected {expected.kind}"
        return None


def abort_frame(reason: str, key: bytes | None = None, counter: int = 0) -> bytes:
    """The complete ABORT frame carrying ``reason`` (UTF-8, cut to :data:`MAX_REASON_BYTES`);
    with ``key`` (frame integrity on) followed by its :func:`frame_tag` as frame number
    ``counter`` of its direction."""
    text = reason.encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    head = FrameHeader(seq=0, step=0, signature=0, length=len(text),
                       kind=FrameKind.ABORT).pack()
    if key is None:
        return head + text
    return head + text + frame_tag(key, counter, head, text)


def decode_reason(raw: bytes | bytearray | memoryview) -> str:
    """The text of an ABORT frame's payload (invalid UTF-8 replaced, never raises)."""
    return bytes(raw).decode("utf-8", errors="replace")


def blake3_module() -> Any:
    """The ``blake3`` module (the keyed hash of ``integrity=True``); UsageError when it is
    not installed."""
    try:
        import blake3
    except ImportError:
        raise UsageError("integrity=True needs the blake3 package: pip install "
                         "'bitcoll[integrity]' (or pip install blake3)") from None
    return blake3


def tag_hasher(key: bytes, counter: int, head: bytes) -> Any:
    """A keyed BLAKE3 over ``counter`` (the frame's number in its direction) and ``head``,
    to be fed the payload; its first :data:`FRAME_TAG_BYTES` digest bytes are the tag."""
    h = blake3_module().blake3(key=key)
    h.update(counter.to_bytes(8, "little"))
    h.update(head)
    return h


def frame_tag(key: bytes, counter: int, head: bytes,
              payload: bytes | bytearray | memoryview) -> bytes:
    """The integrity tag of one frame: keyed BLAKE3 of its number in this direction, its
    header and its payload, truncated to :data:`FRAME_TAG_BYTES` bytes."""
    h = tag_hasher(key, counter, head)
    h.update(payload)
    return bytes(h.digest(FRAME_TAG_BYTES))
