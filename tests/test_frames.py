import pytest
from hypothesis import given
from hypothesis import strategies as st

from bitcoll import arguments
from bitcoll.errors import ProtocolError, UsageError
from bitcoll.transport import base, wire
from bitcoll.transport.base import HEADER_SIZE, MAGIC, FrameHeader, FrameKind, TrafficStats
from bitcoll.transport.local import LocalTransport


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64 - 1), st.sampled_from([FrameKind.DATA, FrameKind.ABORT]))
def test_header_round_trip(seq: int, step: int, sig: int, length: int, kind: int) -> None:
    h = FrameHeader(seq=seq, step=step, signature=sig, length=length, kind=kind)
    raw = h.pack()
    assert len(raw) == HEADER_SIZE == 40
    assert FrameHeader.unpack(raw) == h
    buf = bytearray(HEADER_SIZE + 8)
    h.pack_into(buf, 8)
    assert FrameHeader.unpack(bytes(buf[8:])) == h


def test_header_rejects_bad_magic_version_size() -> None:
    good = FrameHeader(seq=1, step=2, signature=3, length=4)
    with pytest.raises(ProtocolError, match="magic"):
        FrameHeader.unpack(FrameHeader(1, 2, 3, 4, magic=MAGIC ^ 1).pack())
    with pytest.raises(ProtocolError, match="version"):
        FrameHeader.unpack(FrameHeader(1, 2, 3, 4, version=99).pack())
    with pytest.raises(ProtocolError, match=f"{HEADER_SIZE - 1} bytes, expected {HEADER_SIZE}"):
        FrameHeader.unpack(good.pack()[:-1])


def test_header_mismatch_messages() -> None:
    want = FrameHeader(seq=5, step=0, signature=77, length=16)
    assert want.mismatch(want, 1) is None
    assert "collective #6" in str(FrameHeader(6, 0, 77, 16).mismatch(want, 1))
    assert "different arguments" in str(FrameHeader(5, 0, 78, 16).mismatch(want, 1))
    assert FrameHeader(5, 0, 78, 16).differing(want) == ()  # argument maps both 0
    assert FrameHeader(6, 0, 78, 16).differing(want) is None  # another call, not other args
    assert FrameHeader(5, 1, 77, 16).differing(want) is None  # the same call
    assert "step" in str(FrameHeader(5, 1, 77, 16).mismatch(want, 1))
    assert "8 payload bytes" in str(FrameHeader(5, 0, 77, 8).mismatch(want, 2))


def test_argument_maps_name_what_differs() -> None:
    """The argument map in every header names the fields of a different call."""
    def header(name: str, *fields: object) -> FrameHeader:
        sig, argmap = arguments.split(arguments.call_signature(name, fields))
        return FrameHeader(seq=3, step=0, signature=sig, length=8, argmap=argmap)

    mine = header("allreduce", "sum", "<f4", 10, "ring")
    assert header("allreduce", "sum", "<f4", 11, "ring").differing(mine) == (3,)
    assert header("allreduce", "max", "<f4", 10, "ring").differing(mine) == (1,)
    assert 0 in (header("allgather", "<f4", 10, "ring").differing(mine) or ())
    assert arguments.slot_fields("allreduce", (3,)) == ("element count",)
    assert arguments.slot_fields("allreduce", (1, 4)) == ("op", "algorithm")
    assert arguments.slot_fields("allreduce", (0, 3)) == ("collective",)
    # a header round trip keeps the map; the map never changes whether calls match
    h = header("sign_allreduce", "majority", "sign", 1, "alternate", "<f4", 7, None, True)
    assert FrameHeader.unpack(h.pack()) == h and h.argmap != 0
    err = ProtocolError("raw", rank=1, peer=0, sequence=3, slots=(3,))
    before = err.fields  # None: which collective is not known yet
    err.add_context(rank=1, collective="allreduce", sequence=3)
    assert before is None and err.fields == ("element count",)
    assert str(err) == ("allreduce #3: the ranks called it with different element count "
                        "(rank 0 and rank 1)")


def test_traffic_stats() -> None:
    s = TrafficStats()
    s.add_sent(40)
    s.add_sent(32, messages=2)
    s.add_received(33)
    assert s.snapshot() == {"bytes_sent": 72, "bytes_received": 33, "messages_sent": 3,
                            "messages_received": 1}
    assert str(s) == "sent 72 B in 3 messages, received 33 B in 1 messages"
    s.add_sent(1_499_928)
    assert str(s).startswith("sent 1.5 MB in 4 messages")
    s.reset()
    assert set(s.snapshot().values()) == {0}


@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE))
def test_header_parser_takes_any_bytes(data: bytes) -> None:
    """Any bytes give a header or a ProtocolError: never another exception."""
    try:
        h = FrameHeader.unpack(data)
    except ProtocolError:
        return
    assert h.magic == MAGIC and len(data) >= HEADER_SIZE
    assert h.mismatch(FrameHeader(h.seq, h.step, h.signature, h.length, h.kind), 1) is None


def test_abort_frame_carries_its_reason_cut_to_the_limit() -> None:
    raw = wire.abort_frame("disk full ✓")
    h = FrameHeader.unpack(raw[:HEADER_SIZE])
    assert (h.kind, h.seq, h.step, h.signature) == (FrameKind.ABORT, 0, 0, 0)
    assert h.length == len(raw) - HEADER_SIZE
    assert wire.decode_reason(raw[HEADER_SIZE:]) == "disk full ✓"
    long = wire.abort_frame("x" * (wire.MAX_REASON_BYTES + 5))
    assert FrameHeader.unpack(long[:HEADER_SIZE]).length == wire.MAX_REASON_BYTES
    # A reason cut inside a multi-byte character still decodes.
    assert wire.decode_reason("é".encode()[:1]) == "\ufffd"


def test_base_reexports_the_wire_names() -> None:
    assert base.FrameHeader is wire.FrameHeader and base.HEADER_SIZE == wire.HEADER_SIZE
    assert base.MAGIC == wire.MAGIC and base.FrameKind is wire.FrameKind


def test_receive_side_consumers_are_optional() -> None:
    """A transport without receive-side consumers says so with a UsageError naming itself
    (algorithms ask ``consumes_on_receive`` first)."""
    t = LocalTransport()
    assert not t.consumes_on_receive
    with pytest.raises(UsageError, match="local transport cannot hand a payload over"):
        t.irecv_consume(0, 8, FrameHeader(seq=0, step=0, signature=0, length=8),
                        lambda offset, chunk: None)
