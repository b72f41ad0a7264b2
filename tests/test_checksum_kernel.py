"""CRC32C (:mod:`bitcoll.kernels.checksum`) and the checksummed stream kernel
(:func:`bitcoll.kernels.stream.run_stream_checked`).

The checksum's values are checked against a bitwise reference written from the definition and
published test vectors; its detection claims (every error of one or two bits, of an odd
number of bits, every burst of at most 32 bits, in frames under 2**31 bits) are checked by
flipping bits, and the two-bit claim also algebraically (the order of ``x`` modulo the
polynomial). The stream kernel runs on one end of a socket pair, the test writing and reading
the other end, so every byte on the wire is known.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage

from bitcoll.kernels import checksum as C
from bitcoll.kernels import stream as S

POLY = 0x82F63B78  # reflected 0x1EDC6F41
LENGTHS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 255, 256, 257, 767, 768, 769, 1000,
           3 * 8192 - 1, 3 * 8192, 3 * 8192 + 9, 100_003]
IMPLS = [pytest.param(True, id="hardware"), pytest.param(False, id="software")]


def reference(data: bytes, crc: int = 0) -> int:
    """CRC32C bit by bit, from the definition."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def _impl(hardware: bool) -> None:
    if hardware and not C.HARDWARE:
        pytest.skip("this CPU has no SSE4.2 crc32 instruction")


@pytest.mark.parametrize("hardware", IMPLS)
def test_published_vectors(hardware: bool) -> None:
    _impl(hardware)
    # RFC 3720 (iSCSI), B.4, and the common check value.
    assert C.crc32c(b"123456789", hardware=hardware) == 0xE3069283
    assert C.crc32c(bytes(32), hardware=hardware) == 0x8A9136AA
    assert C.crc32c(b"\xff" * 32, hardware=hardware) == 0x62A8AB43
    assert C.crc32c(bytes(range(32)), hardware=hardware) == 0x46DD794E
    assert C.crc32c(bytes(range(31, -1, -1)), hardware=hardware) == 0x113FDB5C
    assert C.crc32c(b"", hardware=hardware) == 0


@pytest.mark.parametrize("hardware", IMPLS)
def test_values_and_chaining_match_the_reference(hardware: bool) -> None:
    """Every length around the three-stream block sizes; any split point chains."""
    _impl(hardware)
    rng = np.random.default_rng(3)
    for n in LENGTHS:
        a = rng.integers(0, 256, n, dtype=np.uint8)
        want = reference(a.tobytes()) if n <= 30_000 else C.crc32c(a, hardware=False)
        assert C.crc32c(a, hardware=hardware) == want, n
        for cut in {0, 1, n // 3, n // 2, n - 1, n} - {-1}:
            if 0 <= cut <= n:
                head = C.crc32c(a[:cut], hardware=hardware)
                assert C.crc32c(a[cut:], head, hardware=hardware) == want, (n, cut)
    # Any dtype: its bytes; unaligned starts.
    f = rng.standard_normal(1001).astype(np.float32)
    assert C.crc32c(f) == reference(f.tobytes())
    b = bytes(rng.integers(0, 256, 5000, dtype=np.uint8))
    assert C.crc32c(memoryview(b)[3:]) == reference(b[3:])
    # The transport's running value: the C call continued piece by piece.
    assert C.crc32c_raw(memoryview(b)[10:], C.crc32c_raw(b[:10])) == reference(b)


def test_frame_checksum_is_the_crc_of_header_then_payload() -> None:
    """The transport's per-frame trailer: the little-endian CRC32C of the header and the
    payload as one byte string, for every length (bytes, bytearray and memoryview inputs)."""
    rng = np.random.default_rng(11)
    for n in LENGTHS:
        head = bytes(rng.integers(0, 256, 40, dtype=np.uint8))
        payload = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        want = (reference(head + bytes(payload)) if n <= 30_000
                else C.crc32c(payload, C.crc32c(head))).to_bytes(4, "little")
        assert C.frame_checksum(head, memoryview(payload)) == want, n
        assert C.frame_checksum(bytearray(head), memoryview(payload)[:n]) == want, n


def test_bad_input_is_a_usage_error() -> None:
    with raises_usage("data"):
        C.crc32c(12)
    with raises_usage("data"):
        C.crc32c(np.zeros((4, 4), np.uint8)[:, 1])
    with raises_usage("value"):
        C.crc32c(b"x", 1 << 32)


def _flip(a: np.ndarray, bits: list[int]) -> np.ndarray:
    b = a.copy()
    for i in bits:
        b[i // 8] ^= np.uint8(1 << (i % 8))
    return b


def test_detects_single_double_odd_and_burst_errors() -> None:
    """The claims of the module docstring, by flipping bits of random frames: every single
    bit of a 4 KiB frame; random pairs, odd counts and bursts of 2..32 bits at random places
    of a 1 MiB frame (the burst's first and last bit flipped, the bits between at random)."""
    rng = np.random.default_rng(11)
    small = rng.integers(0, 256, 4096, dtype=np.uint8)
    good = C.crc32c(small)
    for i in range(small.size * 8):
        small[i // 8] ^= np.uint8(1 << (i % 8))
        assert C.crc32c(small) != good, i
        small[i // 8] ^= np.uint8(1 << (i % 8))
    big = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    good = C.crc32c(big)
    nbits = big.size * 8
    for _ in range(300):
        i, j = sorted(rng.choice(nbits, 2, replace=False).tolist())
        assert C.crc32c(_flip(big, [i, j])) != good, (i, j)
        odd = rng.choice(nbits, int(rng.choice([3, 5, 7, 33])), replace=False).tolist()
        assert C.crc32c(_flip(big, odd)) != good, odd
        length = int(rng.integers(2, 33))
        start = int(rng.integers(0, nbits - length))
        inner = [start + k for k in range(1, length - 1) if rng.random() < 0.5]
        assert C.crc32c(_flip(big, [start, *inner, start + length - 1])) != good


def _polymulmod(a: int, b: int, p: int, deg: int) -> int:
    """``a * b mod p`` over GF(2) (bit i: the coefficient of x^i)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a >> deg & 1:
            a ^= p
    return out


def test_two_bit_errors_are_caught_below_2_to_31_bits() -> None:
    """Two flipped bits ``d`` apart go unseen iff ``x**d == 1`` modulo the polynomial; the
    order of ``x`` is 2**31 - 1 (a prime: it is that or 1), so every frame shorter than 2**31
    bits has every two-bit error caught."""
    p = (1 << 32) | 0x1EDC6F41
    e = (1 << 31) - 1
    result, base = 1, 2  # x**0, x
    while e:
        if e & 1:
            result = _polymulmod(result, base, p, 32)
        base = _polymulmod(base, base, p, 32)
        e >>= 1
    assert result == 1 and base != 1
    assert bin(p).count("1") % 2 == 0  # an even number of terms: x + 1 divides it (odd errors)


# --------------------------------------------------------------------------------------------
# The stream kernel with checksums, on one end of a socket pair
# --------------------------------------------------------------------------------------------

HSZ = 32


def _header(step: int, nbytes: int) -> bytes:
    return step.to_bytes(4, "little") * 4 + nbytes.to_bytes(8, "little") + bytes(8)


def _csum_frame(step: int, payload: bytes) -> bytes:
    head = _header(step, len(payload))
    return head + payload + C.crc32c(head + payload).to_bytes(4, "little")


def _run(work: np.ndarray, src: np.ndarray, sends: list[tuple[int, int, bool, int]],
         recvs: list[tuple[int, int, int]], incoming: bytes,
         piece: int) -> tuple[int, np.ndarray, bytes]:
    """Run the plan on one end of a socket pair whose other end has written ``incoming``
    (from a thread) and reads everything sent; return (status, state, bytes sent)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(20)
    isz = work.itemsize
    s_head = np.array([np.frombuffer(_header(i, (z - s) * isz), np.uint8)
                       for i, (s, z, _, _) in enumerate(sends)], np.uint8).reshape(-1, HSZ)
    r_head = np.array([np.frombuffer(_header(j, (z - s) * isz), np.uint8)
                       for j, (s, z, _) in enumerate(recvs)], np.uint8).reshape(-1, HSZ)
    out_len = sum(HSZ + (z - s) * isz + 4 for s, z, _, _ in sends)
    got = bytearray()

    def peer() -> None:
        try:
            b.sendall(incoming)
        except (BrokenPipeError, ConnectionResetError):
            return  # the stream stopped at a bad frame and shut its end (nothing more to read)
        while len(got) < out_len:
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    th = threading.Thread(target=peer)
    th.start()
    r, w = socket.socketpair()
    state = np.zeros(S.STATE_SIZE, np.int64)
    try:
        status = int(S.Status.IDLE)
        for _ in range(2000):
            run: Any = S.run_stream_checked
            status = int(run(
                work, src, S.OP_SUM, work.dtype.type(1), a.fileno(), a.fileno(), r.fileno(),
                np.zeros(0, np.int32), s_head,
                np.array([s for s, _, _, _ in sends], np.int64),
                np.array([z - s for s, z, _, _ in sends], np.int64),
                np.array([f for _, _, f, _ in sends], np.int64),
                np.array([x for _, _, _, x in sends], np.int64), r_head,
                np.array([s for s, _, _ in recvs], np.int64),
                np.array([z - s for s, z, _ in recvs], np.int64),
                np.array([m for _, _, m in recvs], np.int64),
                np.zeros(piece, work.dtype), np.zeros(HSZ, np.uint8), np.zeros(6, np.int32),
                state, 20, True, np.zeros(S.TRAILER_SIZE, np.uint8)))
            if status != S.Status.IDLE:
                break
        if status != S.Status.DONE:
            a.shutdown(socket.SHUT_RDWR)
        th.join(20)
        return status, state, bytes(got)
    finally:
        for s in (a, b, r, w):
            s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
def test_stream_sends_checksums_and_checks_them(dtype: str) -> None:
    """A two-rank ring pass (block 1 sent from ``src``, block 0 folded piece by piece and
    forwarded cut through, block 1 landed, an empty frame): every frame sent carries the
    CRC32C of its header and payload, correct ones are accepted, and one flipped bit in any
    frame's header-checked payload or checksum ends the call with CHECKSUM at that frame."""
    rng = np.random.default_rng(5)
    dt = np.dtype(dtype)
    piece = 1000  # elements of the bounce buffer: folds and sends cross pieces
    n0, n1 = 3 * piece + 5, 20 * piece + 1  # the landed block crosses LAND_CRC_BYTES
    src = rng.integers(0, 100, n0 + n1).astype(dt)
    peer_src = rng.integers(0, 100, n0 + n1).astype(dt)
    segs0 = [(0, 2 * piece), (2 * piece, n0), (n0, n0)]
    segs1 = [(n0, n0 + n1)]
    sends = [(s, z, True, -1) for s, z in segs1] + \
        [(s, z, False, j) for j, (s, z) in enumerate(segs0)]
    recvs = [(s, z, S.MODE_FOLD) for s, z in segs0] + [(s, z, S.MODE_LAND) for s, z in segs1]
    final1 = src[n0:] + peer_src[n0:]
    frames = [_csum_frame(j, peer_src[s:z].tobytes()) for j, (s, z) in enumerate(segs0)]
    frames.append(_csum_frame(len(segs0), final1.tobytes()))

    work = np.zeros_like(src)
    status, state, sent = _run(work, src, sends, recvs, b"".join(frames), piece)
    assert status == S.Status.DONE
    folded = src[:n0] + peer_src[:n0]
    assert np.array_equal(work[:n0], folded) and np.array_equal(work[n0:], final1)
    expected = [_csum_frame(0, src[n0:].tobytes())] + \
        [_csum_frame(1 + j, folded[s:z].tobytes()) for j, (s, z) in enumerate(segs0)]
    assert sent == b"".join(expected)

    # One bit flipped in a payload or a checksum: CHECKSUM at that frame.
    for frame, where in [(0, HSZ + 7), (1, len(frames[1]) - 2), (2, HSZ + 1), (3, HSZ + 3),
                         (3, len(frames[3]) - 7)]:
        bad = [bytearray(f) for f in frames]
        bad[frame][where] ^= 0x10
        work = np.zeros_like(src)
        status, state, _ = _run(work, src, sends, recvs, b"".join(bytes(f) for f in bad),
                                piece)
        assert status == S.Status.CHECKSUM and state[2] == frame, (frame, where)
