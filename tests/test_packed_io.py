"""Packed input and output: comm.packed_sign_allreduce / packed_quantized_allreduce and their
reduce-scatter forms, and the public layout helpers (bitcoll.layout)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from hypothesis import given, settings
from hypothesis import strategies as st
from inproc import run_threads
from multiproc import run_world
from sweeps import (
    pack_bits_ref,
    pack_fields_ref,
    packed_bandwidth,
    packed_io_sweep,
    set_padding,
    vote_input,
)

import bitcoll
from bitcoll import kernels, layout
from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, PeerLostError, ProtocolError, UsageError

LENGTHS = (0, 1, 7, 8, 9, 100_003)


# ---------------------------------------------------------------------- layout helpers
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_pack_signs_is_numpy_packbits(n: int, dtype: str) -> None:
    x = vote_input(1, 0, n, dtype)
    want = np.packbits(x >= 0, bitorder="little")
    got = layout.pack_signs(x)
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert np.array_equal(layout.pack_signs(x >= 0), want)  # booleans: bit = element
    assert np.array_equal(layout.unpack_signs(got, n), np.where(x >= 0, 1, -1).astype(np.int8))
    out = np.full(layout.packed_nbytes(n), 0xAB, np.uint8)
    assert layout.pack_signs(x, out=out) is out and np.array_equal(out, want)
    # 2-D input: read flattened in C order
    if n % 2 == 0:
        assert np.array_equal(layout.pack_signs(x.reshape(2, -1)), want)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("levels", [1, 3, 7, 127])
def test_pack_fields_matches_numpy_reference(n: int, levels: int) -> None:
    q = np.random.default_rng([n, levels]).integers(-levels, levels + 1, n).astype(np.int16)
    w = layout.field_width(levels)
    assert w == int(np.ceil(np.log2(2 * levels + 1)))
    packed = layout.pack_fields(q, w, levels)
    assert packed.size == layout.packed_nbytes(n, w) == -(-n * w // 8)
    assert np.array_equal(packed, pack_fields_ref(q, w, levels))
    assert np.array_equal(layout.unpack_fields(packed, n, w, levels), q.astype(np.int32))
    # padding bits are ignored when read
    assert np.array_equal(layout.unpack_fields(set_padding(packed, n * w), n, w, levels), q)


def test_layout_errors() -> None:
    with raises_usage("x", 2):  # the first NaN
        layout.pack_signs(np.array([1.0, -1.0, np.nan]))
    with raises_usage("values", 1):  # the first value outside the field
        layout.pack_fields(np.array([0, 4]), 2, 0)
    # levels 1: the 2-bit field holds -1..2; valid= refuses the 2 in the same pass
    q = np.zeros(21, np.int8)
    q[[3, 13]] = 2
    assert np.array_equal(layout.pack_fields(q, 2, 1), pack_fields_ref(q, 2, 1))
    with raises_usage("values", 3):
        layout.pack_fields(q, 2, 1, valid=(-1, 1))
    with raises_usage("valid"):
        layout.pack_fields(q, 2, 1, valid=(-1, 1.5))  # type: ignore[arg-type]
    with raises_usage("bits"):  # not uint8
        layout.unpack_signs(np.zeros(2, np.int8), 9)
    with raises_usage("bits"):  # 3 bytes for 9 votes
        layout.unpack_signs(np.zeros(3, np.uint8), 9)
    with raises_usage("max_abs"):
        layout.field_width(-1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.data())
def test_fields_round_trip_hypothesis(width: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 300))
    bias = data.draw(st.integers(0, (1 << width) - 1))
    vals = np.array(data.draw(st.lists(st.integers(-bias, (1 << width) - 1 - bias),
                                       min_size=n, max_size=n)), dtype=np.int64)
    packed = layout.pack_fields(vals, width, bias)
    assert np.array_equal(packed, pack_fields_ref(vals, width, bias))
    assert np.array_equal(layout.unpack_fields(packed, n, width, bias, dtype=np.int64), vals)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=300))
def test_signs_round_trip_hypothesis(votes: list[bool]) -> None:
    b = np.array(votes, dtype=bool)
    packed = layout.pack_signs(b)
    assert np.array_equal(packed, np.packbits(b, bitorder="little"))
    assert np.array_equal(layout.unpack_signs(packed, b.size), np.where(b, 1, -1))
    assert np.array_equal(layout.pack_signs(np.where(b, 1.0, -1.0)), packed)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40), st.data())
def test_bit_ranges_hypothesis(src_b: bytes, dst_b: bytes, data: st.DataObject) -> None:
    """extract_bits / insert_bits (the seam of the packed forms) against numpy bit arrays."""
    from bitcoll.kernels import reference as R

    src = np.frombuffer(src_b, np.uint8).copy()
    start = data.draw(st.integers(0, 8 * src.size))
    nbits = data.draw(st.integers(0, 8 * src.size - start))
    got = kernels.extract_bits(src, start, nbits)
    assert np.array_equal(got, R.extract_bits(src, start, nbits))
    dst = np.frombuffer(dst_b, np.uint8).copy()
    at = data.draw(st.integers(0, 8 * dst.size))
    k = data.draw(st.integers(0, min(8 * dst.size - at, 8 * src.size)))
    piece = set_padding(kernels.extract_bits(src, 0, k), k)  # padding of src is ignored
    want = R.insert_bits(dst, at, piece, k)
    assert kernels.insert_bits(dst, at, piece, k) is dst
    assert np.array_equal(dst, want)


# ---------------------------------------------------------------------- packed collectives
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_packed_forms_equal_unpacked_threads(size: int) -> None:
    results = run_threads(size, packed_io_sweep, timeout=120)
    assert results[0][0] > 100
    assert all(digests == results[0][1] for _, digests in results)  # identical on every rank


@pytest.mark.parametrize("size", [2, 3, 5])
def test_packed_forms_multi_segment_threads(size: int) -> None:
    # 8-byte segments: the direct pipeline runs many segments per block, and segment and
    # block boundaries fall inside bytes of the packed streams.
    def body(c: Communicator) -> tuple[int, list[int]]:
        return packed_io_sweep(c, lengths=(65, 1031), levels_list=(3, 7))

    results = run_threads(size, body, timeout=120, packed_segment_bytes=8)
    assert all(digests == results[0][1] for _, digests in results)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_packed_forms_byte_bounds_threads(size: int) -> None:
    """The packed forms put exactly the unpacked forms' bytes on the wire."""
    def body(c: Communicator) -> tuple[dict[str, Any], dict[str, Any]]:
        return packed_bandwidth(c), packed_bandwidth(c, packed=True)

    for unpacked, packed in run_threads(size, body, timeout=120):
        assert packed == unpacked


def _tcp_world(comm: Communicator) -> tuple[list[int], dict[str, Any]]:
    _, digests = packed_io_sweep(comm)
    comm.packed_segment_bytes = 8
    packed_io_sweep(comm, lengths=(65, 1031), levels_list=(7,))
    comm.packed_segment_bytes = None
    unpacked, packed = packed_bandwidth(comm), packed_bandwidth(comm, packed=True)
    assert packed == unpacked
    return digests, packed


@pytest.mark.tcp
def test_packed_forms_tcp() -> None:
    results = run_world(3, _tcp_world, timeout=300)
    assert all(digests == results[0][0] for digests, _ in results)


def test_packed_async_and_torch_out() -> None:
    torch = pytest.importorskip("torch")

    def body(c: Communicator) -> bytes:
        n = 1001
        x = vote_input(2, c.rank, n, "float32")
        bits = torch.from_numpy(pack_bits_ref(x >= 0))
        out = torch.zeros(layout.packed_nbytes(n), dtype=torch.uint8)
        work = c.packed_sign_allreduce(bits, n, tie="positive", out=out, async_op=True)
        assert work.wait(timeout=60) is out
        want = c.sign_allreduce(x, tie="positive")
        assert np.array_equal(out.numpy(), pack_bits_ref(want > 0))
        return bytes(out.numpy())

    res = run_threads(3, body)
    assert res[0] == res[1] == res[2]


def test_packed_input_of_any_shape() -> None:
    with bitcoll.init("local") as comm:
        bits = np.arange(8, dtype=np.uint8).reshape(2, 4)
        got = comm.packed_sign_allreduce(bits, 64)
        assert got.shape == (8,) and np.array_equal(got, bits.reshape(-1))
        got = comm.packed_sign_allreduce(set_padding(np.array([0xFF], np.uint8), 3), 3)
        assert got.tolist() == [0b111]  # padding bits ignored on input, zero on output


@pytest.mark.parametrize("call,argument,index", [
    (lambda c: c.packed_sign_allreduce(np.zeros(2, np.int8), 9), "bits", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(3, np.uint8), 9), "bits", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(1, np.uint8), 9), "bits", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(4, np.uint8)[::2], 9), "bits", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(0, np.uint8), -1), "count", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(0, np.uint8), True), "count", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(0, np.uint8), 1.0), "count", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(2, np.uint8), 9, tie="coin"), "tie", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(2, np.uint8), 9, algorithm="x"), "algorithm",
     None),
    (lambda c: c.packed_sign_allreduce(np.zeros(2, np.uint8), 9,
                                       out=np.zeros(3, np.uint8)), "out", None),
    (lambda c: c.packed_sign_allreduce(np.zeros(2, np.uint8), 9,
                                       out=np.zeros(2, np.int8)), "out", None),
    (lambda c: (lambda b: c.packed_sign_allreduce(b, 9, out=b))(np.zeros(2, np.uint8)),
     "out", None),
    (lambda c: c.packed_quantized_allreduce(np.zeros(2, np.uint8), 5, 0), "levels", None),
    (lambda c: c.packed_quantized_allreduce(np.zeros(2, np.uint8), 5, 40000), "levels", None),
    (lambda c: c.packed_quantized_allreduce(np.zeros(2, np.uint8), 5, 7), "fields", None),
    # levels 3: 3-bit fields hold value + 3 in [0, 6]; field 2 holds 7, out of range
    (lambda c: c.packed_quantized_allreduce(pack_fields_ref(np.array([0, 0, 4]), 3, 3), 3, 3),
     "fields", 2),
])
def test_packed_usage_errors(call: Any, argument: str, index: int | None) -> None:
    comm = bitcoll.init("local")
    with raises_usage(argument, index):
        call(comm)
    assert comm.packed_sign_allreduce(np.array([5], np.uint8), 3).tolist() == [5]


def test_out_of_range_field_fails_every_rank_fast() -> None:
    outcomes: dict[int, str] = {}

    def body(c: Communicator) -> None:
        q = np.zeros(100, np.int64)
        if c.rank == 1:
            q[57] = 4  # field 7 = value 4, outside [-3, 3]
        fields = pack_fields_ref(q, 3, 3)
        try:
            c.packed_quantized_allreduce(fields, 100, 3)
        except (UsageError, CommError) as exc:
            outcomes[c.rank] = type(exc).__name__ + ": " + str(exc)

    run_threads(3, body, timeout=20)
    assert outcomes[1].startswith("UsageError") and "field 57" in outcomes[1], outcomes
    assert all(isinstance(k, int) for k in outcomes) and len(outcomes) == 3
    assert outcomes[0].startswith(PeerLostError.__name__), outcomes


def test_packed_and_unpacked_calls_do_not_pair() -> None:
    """A rank calling the packed form while another calls the unpacked form is a mismatch."""
    kinds: dict[int, type] = {}

    def body(c: Communicator) -> None:
        x = vote_input(0, c.rank, 64, "float32")
        try:
            if c.rank == 0:
                c.packed_sign_allreduce(pack_bits_ref(x >= 0), 64)
            else:
                c.sign_allreduce(x)
        except CommError as exc:
            kinds[c.rank] = type(exc)

    run_threads(2, body, timeout=20)
    assert ProtocolError in kinds.values() and len(kinds) == 2
