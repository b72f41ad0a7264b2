"""Property tests of bitcoll.kernels against the plain numpy reference.

Every kernel is run through the public API twice: as called normally ("serial") and with the
parallel dispatch forced on tiny chunks ("parallel": threshold 0, a pretend thread count of 2,
a few elements per chunk), so that chunk boundaries fall everywhere. Lengths cover 0, 1, 7, 8,
9, 63, 64, 65, other non-multiples of 8 and larger odd sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from errcheck import raises_usage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bitcoll.kernels as K
from bitcoll.errors import UsageError
from bitcoll.kernels import bits as B
from bitcoll.kernels import reference as R

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

EDGE_LENGTHS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 191, 193,
                1000, 4097, 12_345]
lengths = st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, 3000))
seeds = st.integers(0, 2**32 - 1)
FLOATS = [np.float16, np.float32, np.float64]
MODES = ["serial", "parallel"]


@contextmanager
def dispatch_mode(mode: str) -> Iterator[None]:
    """Force the parallel kernels (on small chunks) for the duration, or leave things as is."""
    if mode == "serial":
        yield
        return
    names = ("PARALLEL_MIN_ELEMENTS", "_CHUNK_ELEMENTS", "_nb_get_num_threads",
             "_process_threads")
    saved = [getattr(K, name) for name in names]
    # threshold 0; 3 blocks, 24 bytes, 3 words or 24 groups per chunk; a pool of 2 threads,
    # no process-wide count
    for name, value in zip(names, (0, 3 * 64, lambda: 2, None), strict=True):
        setattr(K, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(K, name, value)


def votes_input(rng: np.random.Generator, n: int, dtype: Any) -> npt.NDArray[Any]:
    """Random floats with plenty of zeros of both signs, infinities and subnormals."""
    info = np.finfo(dtype)
    x = rng.standard_normal(n).astype(dtype)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, info.smallest_subnormal,
                         -info.smallest_subnormal, info.max, -info.max, info.tiny, -info.tiny],
                        dtype=dtype)
    pick = rng.random(n) < 0.3
    x[pick] = rng.choice(specials, size=int(pick.sum()))
    return x


def random_packed(rng: np.random.Generator, p: int, n: int) -> npt.NDArray[np.uint8]:
    """p random vote vectors; the padding bits are random too (they must be ignored)."""
    return rng.integers(0, 256, size=(p, K.packed_nbytes(n)), dtype=np.uint8)


def assert_padding_zero(buf: npt.NDArray[np.uint8], nbits: int) -> None:
    if nbits % 8:
        assert int(buf[-1]) >> (nbits % 8) == 0


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------


def test_packed_nbytes() -> None:
    assert K.packed_nbytes(0) == 0
    assert K.packed_nbytes(1) == 1
    assert K.packed_nbytes(8) == 1
    assert K.packed_nbytes(9) == 2
    assert K.packed_nbytes(9, 3) == 4  # 27 bits
    assert K.packed_nbytes(8, 5) == 5
    assert K.packed_nbytes(np.int64(65), 16) == 130  # type: ignore[arg-type]
    for bad in [(-1, 1), (3, 0), (1.5, 1), (True, 1)]:
        with pytest.raises(UsageError):
            K.packed_nbytes(*bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# pack_signs / pack_ternary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2], ids=["signs", "ternary"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(n=lengths, seed=seeds)
def test_pack_votes_matches_reference(width: int, mode: str, dtype: Any, n: int,
                                      seed: int) -> None:
    """pack_signs (width 1) and pack_ternary (width 2, read back as sign(x) by
    unpack_fields) against their reference twins."""
    pack, ref = (K.pack_signs, R.pack_signs) if width == 1 else (K.pack_ternary, R.pack_ternary)
    x = votes_input(np.random.default_rng(seed), n, dtype)
    with dispatch_mode(mode):
        got = pack(x)
        if width == 2:
            signs = K.unpack_fields(got, n, 2, 1, dtype=np.int8)
            np.testing.assert_array_equal(signs, np.sign(x).astype(np.int8))
    assert got.dtype == np.uint8 and got.shape == (K.packed_nbytes(n, width),)
    np.testing.assert_array_equal(got, ref(x))
    assert_padding_zero(got, width * n)


def test_pack_signs_zero_votes_positive() -> None:
    x = np.array([0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, -1.0, 2.0, -0.0], np.float32)
    got = np.unpackbits(K.pack_signs(x), count=x.size, bitorder="little")
    np.testing.assert_array_equal(got, [1, 1, 1, 0, 1, 0, 0, 1, 1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(data=st.data(), n=st.integers(1, 700), seed=seeds)
def test_pack_signs_nan_reports_first_index(mode: str, dtype: Any, data: st.DataObject,
                                            n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = votes_input(rng, n, dtype)
    where = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
    # NaNs with either sign and arbitrary payloads (quiet and signalling)
    ut = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}[dtype]
    u = x.view(ut)
    bits = 8 * np.dtype(dtype).itemsize
    inf = int(np.array(np.inf, dtype).view(ut))
    for i in where:
        payload = data.draw(st.integers(1, (1 << (np.finfo(dtype).nmant)) - 1))
        sign = data.draw(st.booleans())
        u[i] = ut(inf | payload | ((1 << (bits - 1)) if sign else 0))
    assert np.isnan(x[where]).all()
    for fn in (K.pack_signs, K.pack_ternary):
        with dispatch_mode(mode), raises_usage("x", index=where[0]):
            fn(x)


# --------------------------------------------------------------------------------------------
# unpack_signs
# --------------------------------------------------------------------------------------------

SIGN_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(n=lengths, seed=seeds, dtype=st.sampled_from(SIGN_DTYPES),
       scale=st.sampled_from([1, -1, 3, 0, -100, 0.5, -1e-3, 2.0]))
def test_unpack_signs_matches_reference(mode: str, n: int, seed: int, dtype: Any,
                                        scale: float) -> None:
    if np.dtype(dtype).kind == "i" and not float(scale).is_integer():
        scale = 7
    bits = np.random.default_rng(seed).integers(0, 256, K.packed_nbytes(n), dtype=np.uint8)
    with dispatch_mode(mode):
        got = K.unpack_signs(bits, n, dtype=dtype, scale=scale)
        out = np.full(n, 99, dtype=dtype)
        same = K.unpack_signs(bits, n, out=out, dtype=dtype, scale=scale)
    assert same is out
    assert got.dtype == np.dtype(dtype) and got.shape == (n,)
    want = R.unpack_signs(bits, n, dtype, scale)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, want)


def test_unpack_signs_roundtrip_and_defaults() -> None:
    x = np.array([-2.0, 0.0, 3.0, -0.0, -1e-9], np.float64)
    got = K.unpack_signs(K.pack_signs(x), 5)
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, [-1, 1, 1, 1, -1])
    lr = 1e-3
    upd = K.unpack_signs(K.pack_signs(x), 5, dtype=np.float32, scale=-lr)
    np.testing.assert_array_equal(upd, np.float32(lr) * np.array([1, -1, -1, -1, 1], np.float32))


def test_unpack_signs_errors() -> None:
    bits = np.zeros(2, np.uint8)
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, dtype=np.int8, scale=0.5)
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, dtype=np.int8, scale=128)
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, dtype=np.int8, scale=-128)
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, dtype=np.float16, scale=1e6)
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, dtype=np.float32, scale=float("nan"))
    with raises_usage("dtype"):
        K.unpack_signs(bits, 9, dtype=np.uint8)
    with raises_usage("dtype"):
        K.unpack_signs(bits, 9, dtype=np.complex64)
    with raises_usage("bits"):  # 17 signs take 3 bytes
        K.unpack_signs(bits, 17)
    with raises_usage("bits"):  # 8 take 1 byte
        K.unpack_signs(bits, 8)
    with raises_usage("out"):
        K.unpack_signs(bits, 9, out=np.zeros(9, np.float32))  # dtype defaults to int8
    with raises_usage("out"):
        K.unpack_signs(bits, 9, out=np.zeros(10, np.int8))
    with raises_usage("scale"):
        K.unpack_signs(bits, 9, scale=True)
    with raises_usage("n"):
        K.unpack_signs(bits, -1)


# --------------------------------------------------------------------------------------------
# count_votes / majority
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(n=lengths, p=st.integers(0, 19), seed=seeds)
def test_count_votes_matches_reference(mode: str, n: int, p: int, seed: int) -> None:
    packed = random_packed(np.random.default_rng(seed), p, n)
    with dispatch_mode(mode):
        got = K.count_votes(packed, n)
        out = np.full(n, -5, np.int32)
        same = K.count_votes(packed, n, out=out)
    assert same is out and got.dtype == np.int32 and got.shape == (n,)
    want = R.count_votes(packed, n)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("mode", MODES)
def test_count_votes_many_rows(mode: str) -> None:
    # more rows than one byte-lane counter holds (255)
    rng = np.random.default_rng(7)
    n = 333
    packed = random_packed(rng, 600, n)
    packed[:300, 0] = 0xFF  # elements 0..7 get >= 300 votes
    with dispatch_mode(mode):
        got = K.count_votes(packed, n)
    np.testing.assert_array_equal(got, R.count_votes(packed, n))
    assert (got[:8] >= 300).all()


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(n=lengths, p=st.integers(1, 18), seed=seeds,
       tie=st.sampled_from([K.TIE_POSITIVE, K.TIE_NEGATIVE, K.TIE_ALTERNATE]),
       offset=st.integers(-5, 2**40))
def test_majority_matches_reference(mode: str, n: int, p: int, seed: int, tie: int,
                                    offset: int) -> None:
    rng = np.random.default_rng(seed)
    packed = random_packed(rng, p, n)
    if p % 2 == 0 and p >= 2:  # make ties frequent: half the rows are complements
        packed[p // 2:] = ~packed[: p // 2]
        flip = rng.random(packed.shape) < 0.1
        packed[flip] ^= rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
    with dispatch_mode(mode):
        got = K.majority(packed, n, tie, tie_offset=offset)
        out = np.full(K.packed_nbytes(n), 0xFF, np.uint8)
        same = K.majority(packed, n, tie, offset, out=out)
    assert same is out and got.shape == (K.packed_nbytes(n),) and got.dtype == np.uint8
    want = R.majority(packed, n, tie, offset)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, want)
    assert_padding_zero(got, n)


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(n=lengths, groups=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=seeds,
       tie=st.sampled_from([K.TIE_POSITIVE, K.TIE_NEGATIVE, K.TIE_ALTERNATE]),
       offset=st.integers(-5, 2**40))
def test_count_planes_and_majority_of_counts(mode: str, n: int, groups: list[int], seed: int,
                                             tie: int, offset: int) -> None:
    """Counting each group of voters into bit planes and taking the majority of the groups'
    planes gives the flat majority of all voters bit for bit (the two-level majority), and
    the planes hold exactly the counts with zero padding."""
    rng = np.random.default_rng(seed)
    p = sum(groups)
    packed = random_packed(rng, p, n)
    if p % 2 == 0:  # frequent ties
        packed[p // 2:] = ~packed[: p // 2]
    stack, shifts, first = [], [], 0
    with dispatch_mode(mode):
        for g in groups:
            width = g.bit_length()
            planes = K.count_planes(packed[first:first + g], n, width)
            assert planes.shape == (width, K.packed_nbytes(n))
            counts = sum(np.unpackbits(planes[j], count=n, bitorder="little").astype(np.int64)
                         << j for j in range(width))
            np.testing.assert_array_equal(counts, R.count_votes(packed[first:first + g], n))
            for row in planes:
                assert_padding_zero(row, n)
            stack.append(planes)
            shifts += list(range(width))
            first += g
        got = K.majority_of_counts(np.concatenate(stack), shifts, p, n, tie, offset)
    np.testing.assert_array_equal(got, R.majority(packed, n, tie, offset))


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(n=lengths, before=st.integers(0, 300), after=st.integers(0, 100),
       rows=st.integers(0, 7), seed=seeds)
def test_count_planes_of_a_sub_range(mode: str, n: int, before: int, after: int, rows: int,
                                     seed: int) -> None:
    """``start`` counts elements ``start .. start + n`` of longer rows: the planes of that
    slice of the rows, with zero padding (the votes after it do not leak in)."""
    start = 8 * before
    total = start + n + after
    packed = random_packed(np.random.default_rng(seed), rows, total)
    width = max(1, rows.bit_length())
    sliced = np.zeros((rows, K.packed_nbytes(n)), np.uint8)
    for r in range(rows):
        bits = np.unpackbits(packed[r], count=total, bitorder="little")[start:start + n]
        sliced[r] = np.packbits(bits, bitorder="little")[:K.packed_nbytes(n)] \
            if n else sliced[r]
    with dispatch_mode(mode):
        got = K.count_planes(packed, n, width, start=start)
        out = np.full((width, K.packed_nbytes(n)), 0xFF, np.uint8)
        assert K.count_planes(packed, n, width, out=out, start=start) is out
    want = K.count_planes(sliced, n, width)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, want)
    for row in got:
        assert_padding_zero(row, n)


def test_count_planes_errors() -> None:
    packed = np.zeros((3, 2), np.uint8)
    with raises_usage("start"):
        K.count_planes(packed, 8, 2, start=4)
    with raises_usage("packed"):  # needs 3 bytes per row
        K.count_planes(packed, 9, 2, start=8)
    with raises_usage("width"):
        K.count_planes(packed, 16, 1)
    with raises_usage("out"):
        K.count_planes(packed, 16, 2, out=np.zeros((2, 3), np.uint8))
    with raises_usage("shifts"):
        K.majority_of_counts(packed, [0], 3, 16, K.TIE_POSITIVE)
    with raises_usage("shifts"):
        K.majority_of_counts(packed, [0, 1, 2], 3, 16, K.TIE_POSITIVE)
    with raises_usage("votes"):
        K.majority_of_counts(packed, [0, 0, 0], 0, 16, K.TIE_POSITIVE)


@SETTINGS
@given(n=lengths, p=st.integers(1, 9), seed=seeds,
       tie=st.sampled_from([K.TIE_POSITIVE, K.TIE_NEGATIVE, K.TIE_ALTERNATE]),
       offset=st.integers(-5, 2**40), fdt=st.sampled_from(FLOATS),
       odt=st.sampled_from(SIGN_DTYPES))
def test_sign_votes_prepared_matches_the_checked_kernels(n: int, p: int, seed: int, tie: int,
                                                         offset: int, fdt: Any,
                                                         odt: Any) -> None:
    """SignVotes (prepared once, unchecked calls) packs like pack_signs and decides like
    majority followed by unpack_signs, bit for bit, ties and signed zeros included."""
    rng = np.random.default_rng(seed)
    votes = K.SignVotes(n, fdt, p, odt)
    assert (votes.n, votes.p, votes.nbytes) == (n, p, K.packed_nbytes(n))
    x = rng.standard_normal(n).astype(fdt)
    x[rng.random(n) < 0.1] = 0.0
    x[rng.random(n) < 0.1] = -0.0
    row = np.full(votes.nbytes, 0xAB, np.uint8)
    votes.pack(x, row)
    np.testing.assert_array_equal(row, K.pack_signs(x))
    packed = random_packed(rng, p, n)
    if p % 2 == 0:  # ties everywhere but where a tenth of the bytes are redrawn
        packed[p // 2:] = ~packed[: p // 2]
        flip = rng.random(packed.shape) < 0.1
        packed[flip] = rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
    bits = np.full(votes.nbytes, 0xCD, np.uint8)
    out = np.full(n, 7, odt)
    votes.decide(packed, tie, offset, bits, out)
    want = R.majority(packed, n, tie, offset)
    np.testing.assert_array_equal(bits, want)
    np.testing.assert_array_equal(out, K.unpack_signs(want, n, dtype=odt))


def test_sign_votes_checks_its_shape_once_and_names_nans() -> None:
    with raises_usage("p", match="p must be >= 1"):
        K.SignVotes(8, np.float32, 0, np.int8)
    with raises_usage("in_dtype", match="in_dtype must be float16, float32 or float64"):
        K.SignVotes(8, np.int32, 2, np.int8)
    with raises_usage("out_dtype", match="out_dtype uint8 not supported"):
        K.SignVotes(8, np.float32, 2, np.uint8)
    with raises_usage("in_dtype/out_dtype"):
        K.SignVotes(8, "no such dtype", 2, np.int8)
    with raises_usage("n", match="must be below"):
        K.SignVotes(K.PARALLEL_MIN_ELEMENTS, np.float32, 2, np.int8)
    with raises_usage("n", match="n must be >= 0"):
        K.SignVotes(-1, np.float32, 2, np.int8)
    votes = K.SignVotes(9, np.float64, 3, np.float32)
    x = np.zeros(9)
    x[[4, 6]] = np.nan
    with raises_usage("x", index=4, match="NaN in vote input at index 4"):
        votes.pack(x, np.empty(2, np.uint8))


def test_majority_tie_rules_explicit() -> None:
    # p = 2: element i votes (+1, -1) -> tie everywhere; (+1, +1) -> +1; (-1, -1) -> -1
    a = np.array([1, 1, 1, 1, 0, 1, 0, 1, 1], bool)
    b = np.array([0, 0, 0, 0, 0, 1, 1, 0, 0], bool)
    packed = np.stack([np.packbits(a, bitorder="little"), np.packbits(b, bitorder="little")])

    def bits(tie: int, off: int = 0) -> list[int]:
        res = K.majority(packed, 9, tie, off)
        return [int(v) for v in np.unpackbits(res, count=9, bitorder="little")]

    assert bits(K.TIE_POSITIVE) == [1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert bits(K.TIE_NEGATIVE) == [0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert bits(K.TIE_ALTERNATE) == [1, 0, 1, 0, 0, 1, 1, 0, 1]
    assert bits(K.TIE_ALTERNATE, 3) == [0, 1, 0, 1, 0, 1, 0, 1, 0]



@pytest.mark.parametrize("p", [1, 2, 4, 5])
@pytest.mark.parametrize("tie", ["positive", "negative", "alternate"])
def test_majority_of_sums_agrees_with_the_packed_reference(p: int, tie: str) -> None:
    """The reference majority from vote sums (what tests and benchmarks expect of the
    collectives) and the reference majority of packed votes give the same votes."""
    n = 1001
    votes = np.random.default_rng(p).integers(0, 2, (p, n)).astype(bool)
    sums = (2 * votes.astype(np.int32) - 1).sum(axis=0)
    packed = np.stack([np.packbits(v, bitorder="little") for v in votes])
    code = {"positive": R.TIE_POSITIVE, "negative": R.TIE_NEGATIVE,
            "alternate": R.TIE_ALTERNATE}[tie]
    for offset in (0, 3):
        bits = np.unpackbits(R.majority(packed, n, code, offset), count=n, bitorder="little")
        got = R.majority_of_sums(sums, tie, offset)
        assert got.dtype == np.int8
        np.testing.assert_array_equal(got, 2 * bits.astype(np.int8) - 1)
    with raises_usage("tie"):
        R.majority_of_sums(sums, "random")

@pytest.mark.parametrize("p", [1, 2, 3, 8, 31, 32, 33, 64, 255, 256, 257])
def test_majority_thresholds(p: int) -> None:
    # element c has exactly c of the p votes at +1, for c = 0..p
    n = p + 1
    rows = np.zeros((p, n), bool)
    for c in range(n):
        rows[:c, c] = True
    packed = np.packbits(rows, axis=1, bitorder="little")
    for tie in (K.TIE_POSITIVE, K.TIE_NEGATIVE, K.TIE_ALTERNATE):
        got = np.unpackbits(K.majority(packed, n, tie, 1), count=n, bitorder="little")
        np.testing.assert_array_equal(got, np.unpackbits(R.majority(packed, n, tie, 1),
                                                         count=n, bitorder="little"))
        count = np.arange(n)
        assert (got[2 * count > p] == 1).all() and (got[2 * count < p] == 0).all()


def test_votes_errors() -> None:
    packed = np.zeros((3, 2), np.uint8)
    with raises_usage("packed"):
        K.majority(packed, 17, K.TIE_POSITIVE)
    with raises_usage("packed"):
        K.count_votes(packed, 8)
    with raises_usage("packed"):
        K.count_votes(packed.ravel(), 16)
    with raises_usage("packed"):
        K.majority(packed.astype(np.int8), 16, K.TIE_POSITIVE)
    with raises_usage("packed"):
        K.majority(np.zeros((3, 4), np.uint8)[:, ::2], 16, K.TIE_POSITIVE)
    with raises_usage("packed"):
        K.majority(np.zeros((0, 2), np.uint8), 16, K.TIE_POSITIVE)
    with raises_usage("tie"):
        K.majority(packed, 16, 3)
    with raises_usage("tie_offset"):
        K.majority(packed, 16, K.TIE_ALTERNATE, tie_offset=0.5)  # type: ignore[arg-type]
    with raises_usage("out"):
        K.majority(packed, 16, K.TIE_POSITIVE, out=np.zeros(3, np.uint8))
    with raises_usage("out"):
        K.count_votes(packed, 16, out=np.zeros(16, np.int64))


# --------------------------------------------------------------------------------------------
# fields
# --------------------------------------------------------------------------------------------

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def field_values(rng: np.random.Generator, n: int, width: int, bias: int,
                 dtype: Any) -> npt.NDArray[Any]:
    """Valid values for (width, bias) in dtype, with the extremes well represented."""
    lo, hi = -bias, (1 << width) - 1 - bias
    info = np.iinfo(dtype)
    lo, hi = max(lo, int(info.min)), min(hi, int(info.max))
    v = rng.integers(lo, hi, size=n, endpoint=True, dtype=np.int64)
    edge = rng.random(n) < 0.2
    v[edge] = rng.choice([lo, hi], size=int(edge.sum()))
    return v.astype(dtype)


# Every (width, dtype) pair compiles its own kernels, so the tests below share a few pairs:
# int32 values/results at every width, every dtype at width 7 (pack) and 9 (unpack), and the
# parallel variants at PARALLEL_WIDTHS only.
PARALLEL_WIDTHS = [2, 3, 8, 13]


def check_fields_roundtrip(n: int, width: int, bias: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = field_values(rng, n, width, bias, np.int32)
    packed = K.pack_fields(v, width, bias)
    assert packed.shape == (K.packed_nbytes(n, width),) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, R.pack_fields(v, width, bias))
    assert_padding_zero(packed, n * width)
    out = np.full(n, 12345, np.int32)
    assert K.unpack_fields(packed, n, width, bias, out=out) is out
    np.testing.assert_array_equal(out, v)
    acc = rng.integers(-1000, 1000, n).astype(np.int32)
    want = R.add_fields(packed, n, width, bias, acc.copy())
    assert K.add_fields(packed, n, width, bias, acc) is acc
    np.testing.assert_array_equal(acc, want)


@SETTINGS
@given(n=lengths, width=st.integers(1, 16), seed=seeds, data=st.data())
def test_fields_roundtrip_all_widths(n: int, width: int, seed: int,
                                     data: st.DataObject) -> None:
    bias = data.draw(st.integers(0, (1 << width) - 1), label="bias")
    check_fields_roundtrip(n, width, bias, seed)


@SETTINGS
@given(n=lengths, width=st.sampled_from(PARALLEL_WIDTHS), seed=seeds, data=st.data())
def test_fields_roundtrip_parallel(n: int, width: int, seed: int, data: st.DataObject) -> None:
    bias = data.draw(st.integers(0, (1 << width) - 1), label="bias")
    with dispatch_mode("parallel"):
        check_fields_roundtrip(n, width, bias, seed)


# 2: the 8-bit lane path; 1, 3, 8: 16-bit lanes; 16: element by element
SUM_SIGN_WIDTHS = [1, 2, 3, 8, 16]
# 42: the most the 8-bit lanes sum (2-bit fields); 200 rows of 8 bits: past the 16-bit lanes
SUM_SIGN_ROWS = [0, 1, 2, 3, 4, 5, 8, 42, 43, 200]


def check_sum_sign(rows: int, n: int, width: int, bias: int, seed: int) -> None:
    """sum_sign_fields of random rows (fields at both extremes, random padding bits, which
    must be ignored) against the reference, with and without ``out``."""
    rng = np.random.default_rng(seed)
    nb = K.packed_nbytes(n, width)
    packed = rng.integers(0, 256, size=(rows, nb), dtype=np.uint8)
    if rows and n:  # some elements the same on every row: sums of rows times one field
        for i in range(rows):
            packed[i, : nb // 4] = packed[0, : nb // 4]
    want = R.sum_sign_fields(packed, n, width, bias)
    got = K.sum_sign_fields(packed, n, width, bias)
    assert got.shape == (K.packed_nbytes(n, 2),) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)
    assert_padding_zero(got, 2 * n)
    out = np.full(K.packed_nbytes(n, 2), 0xFF, np.uint8)
    assert K.sum_sign_fields(packed, n, width, bias, out=out) is out
    np.testing.assert_array_equal(out, want)


@SETTINGS
@given(n=lengths, width=st.sampled_from(SUM_SIGN_WIDTHS),
       rows=st.sampled_from(SUM_SIGN_ROWS), seed=seeds, data=st.data())
def test_sum_sign_fields(n: int, width: int, rows: int, seed: int,
                         data: st.DataObject) -> None:
    bias = data.draw(st.integers(0, (1 << width) - 1), label="bias")
    check_sum_sign(rows, n, width, bias, seed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 4, 42, 43])
@pytest.mark.parametrize("bias", [0, 1, 3])
def test_sum_sign_fields_two_bits_edges(mode: str, rows: int, bias: int) -> None:
    """The 2-bit fields' lane paths at their limits (every field 0 or every field 3 on every
    row: the largest lane sums; 42 rows in 8-bit lanes, 43 in 16-bit lanes) and at every
    length around their 32-element words; the parallel kernels with chunk boundaries
    everywhere."""
    with dispatch_mode(mode):
        for n in (0, 1, 31, 32, 33, 63, 64, 65, 95, 1000, 12_345):
            for fill in (0x00, 0xFF, 0x55, 0xAA):
                packed = np.full((rows, K.packed_nbytes(n, 2)), fill, np.uint8)
                np.testing.assert_array_equal(K.sum_sign_fields(packed, n, 2, bias),
                                              R.sum_sign_fields(packed, n, 2, bias))
            check_sum_sign(rows, n, 2, bias, n)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5])
def test_sum_sign_parallel_chunks_off_the_lane_words(chunk: int) -> None:
    """Parallel chunks of 1-5 groups of 8 (not whole 32-element words): a chunk that starts
    inside a word of the 8-bit lane path takes the 16-bit lanes: the same result."""
    rng = np.random.default_rng(chunk)
    for width in (2, 3):
        n = 1001
        packed = rng.integers(0, 256, size=(4, K.packed_nbytes(n, width)), dtype=np.uint8)
        out = np.empty(K.packed_nbytes(n, 2), np.uint8)
        B.field_kernels(width).sum_sign_parallel(packed, n, np.int64(1), out, chunk)
        np.testing.assert_array_equal(out, R.sum_sign_fields(packed, n, width, 1))


def test_sum_sign_fields_errors() -> None:
    rows = np.zeros((3, 3), np.uint8)
    with raises_usage("rows"):
        K.sum_sign_fields(rows, 13, 2, 1)  # 13 fields of 2 bits take 4 bytes
    with raises_usage("rows"):
        K.sum_sign_fields(rows[0], 12, 2, 1)  # not 2-D
    with raises_usage("rows"):
        K.sum_sign_fields(np.zeros((3, 6), np.uint8)[:, ::2], 12, 2, 1)  # not contiguous
    with raises_usage("rows"):
        K.sum_sign_fields(rows.astype(np.int8), 12, 2, 1)
    with raises_usage("out"):
        K.sum_sign_fields(rows, 12, 2, 1, out=np.zeros(4, np.uint8))
    with raises_usage("width"):
        K.sum_sign_fields(rows, 12, 17, 1)
    with raises_usage("bias"):
        K.sum_sign_fields(rows, 12, 2, 4)


@pytest.mark.parametrize("width", [2, 7], ids=["byte-aligned", "general"])
@SETTINGS
@given(n=lengths, seed=seeds, dtype=st.sampled_from(INT_DTYPES),
       bias_kind=st.sampled_from(["zero", "mid", "neg"]))
def test_pack_fields_value_dtypes(width: int, n: int, seed: int, dtype: Any,
                                  bias_kind: str) -> None:
    bias = {"zero": 0, "mid": 1 << (width - 1), "neg": -3}[bias_kind]
    rng = np.random.default_rng(seed)
    v = field_values(rng, n, width, bias, dtype)
    packed = K.pack_fields(v, width, bias)
    np.testing.assert_array_equal(packed, R.pack_fields(v, width, bias))


@SETTINGS
@given(n=lengths, seed=seeds, dtype=st.sampled_from([*INT_DTYPES, np.float32, np.float64]))
def test_unpack_fields_out_dtypes(n: int, seed: int, dtype: Any) -> None:
    width = 9
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    bias = 0 if dt.kind == "u" else 1 << (width - 1)
    packed = K.pack_fields(field_values(rng, n, width, bias, np.int32), width, bias)
    if dt.kind in "iu" and (1 << width) - 1 - bias > np.iinfo(dt).max:
        with raises_usage("dtype"):
            K.unpack_fields(packed, n, width, bias, dtype=dtype)
        return
    got = K.unpack_fields(packed, n, width, bias, dtype=dtype)
    assert got.dtype == dt
    np.testing.assert_array_equal(got, R.unpack_fields(packed, n, width, bias, dtype))
    out = np.empty(n, dtype)
    assert K.unpack_fields(packed, n, width, bias, out=out, dtype=dtype) is out
    np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize(("width", "bias"), [(4, 5), (9, 300)], ids=["byte-aligned", "general"])
@SETTINGS
@given(n=lengths, seed=seeds, dtype=st.sampled_from([np.int16, np.int32, np.int64]))
def test_add_fields_acc_dtypes_wrap(width: int, bias: int, n: int, seed: int,
                                    dtype: Any) -> None:
    rng = np.random.default_rng(seed)
    packed = K.pack_fields(field_values(rng, n, width, bias, np.int32), width, bias)
    info = np.iinfo(dtype)
    acc = rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)  # sums wrap
    want = R.add_fields(packed, n, width, bias, acc.copy())
    got = K.add_fields(packed, n, width, bias, acc)
    assert got is acc
    np.testing.assert_array_equal(acc, want)


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(data=st.data(), n=st.integers(1, 500), seed=seeds)
def test_pack_fields_out_of_range(mode: str, data: st.DataObject, n: int, seed: int) -> None:
    width: int
    dtype: Any
    if mode == "parallel":
        width, dtype = data.draw(st.sampled_from(PARALLEL_WIDTHS)), np.int32
    else:
        width, dtype = data.draw(st.one_of(
            st.tuples(st.integers(1, 16), st.just(np.int32)),
            st.tuples(st.sampled_from([2, 4, 7]), st.sampled_from(INT_DTYPES))))
    rng = np.random.default_rng(seed)
    bias = data.draw(st.sampled_from([0, 1 << (width - 1), -3]), label="bias")
    v = field_values(rng, n, width, bias, dtype)
    lo, hi = -bias, (1 << width) - 1 - bias
    info = np.iinfo(dtype)
    bad_values = [x for x in (lo - 1, hi + 1, int(info.min), int(info.max))
                  if info.min <= x <= info.max and not lo <= x <= hi]
    if not bad_values:
        return
    where = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
    for i in where:
        v[i] = data.draw(st.sampled_from(bad_values))
    with dispatch_mode(mode), raises_usage("values", index=where[0]):
        K.pack_fields(v, width, bias)


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(data=st.data(), n=st.integers(0, 500), seed=seeds)
def test_pack_fields_valid_range(mode: str, data: st.DataObject, n: int, seed: int) -> None:
    """``valid=(lo, hi)`` narrows the accepted values inside the field's range, in the same
    pass: the fields of an accepted vector are those without ``valid``; otherwise the first
    value outside ``[lo, hi]`` is named (1-byte values take byte lanes: the range must hold
    modulo 2**8 too). The parallel kernels are compiled for fewer dtypes and widths."""
    dtype: Any
    if mode == "parallel":
        width = data.draw(st.sampled_from([w for w in PARALLEL_WIDTHS if w <= 8]), label="width")
        dtype = data.draw(st.sampled_from([np.int8, np.int32]), label="dtype")
    else:
        width = data.draw(st.sampled_from([1, 2, 4, 7, 8]), label="width")
        dtype = data.draw(st.sampled_from(INT_DTYPES), label="dtype")
    bias = data.draw(st.sampled_from([0, 1 << (width - 1), -3]), label="bias")
    info = np.iinfo(dtype)
    flo = max(-bias, int(info.min))
    fhi = min((1 << width) - 1 - bias, int(info.max))
    if flo > fhi:
        return
    lo = data.draw(st.integers(flo, fhi), label="lo")
    hi = data.draw(st.integers(lo, fhi), label="hi")
    rng = np.random.default_rng(seed)
    v = rng.integers(lo, hi, n, endpoint=True).astype(dtype)
    outside = [x for x in (lo - 1, hi + 1, flo, fhi, int(info.min), int(info.max))
               if info.min <= x <= info.max and not lo <= x <= hi]
    where: list[int] = []
    if n and outside and data.draw(st.booleans(), label="spoil"):
        where = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
        for i in where:
            v[i] = data.draw(st.sampled_from(outside))
    with dispatch_mode(mode):
        if where:
            with raises_usage("values", index=where[0]):
                K.pack_fields(v, width, bias, valid=(lo, hi))
        else:
            np.testing.assert_array_equal(K.pack_fields(v, width, bias, valid=(lo, hi)),
                                          R.pack_fields(v, width, bias))


def test_pack_fields_extreme_values() -> None:
    # values whose wrap-around modulo 2**8, 2**16 or 2**32 would land inside the range must
    # be rejected (only 1-byte values are packed in byte lanes)
    for dtype, x in ((np.int16, 256), (np.int16, -32768), (np.uint16, 257), (np.int32, 1 << 16),
                     (np.int64, 1 << 32), (np.uint32, (1 << 32) - 255)):
        for width in (1, 2, 4, 7, 8):
            w: npt.NDArray[Any] = np.zeros(19, dtype)  # two groups of 8 (the vector loop), a tail
            w[1], w[9] = 1, x
            with raises_usage("values", index=9):
                K.pack_fields(w, width, 0)
            with raises_usage("values", index=9):
                K.pack_fields(w, width, 0, valid=(0, 1))
    # values whose 64-bit wrap-around would land inside the range must still be rejected
    v = np.array([0, 2**64 - 1], np.uint64)
    with raises_usage("values", index=1):
        K.pack_fields(v, 7, 1)
    v = np.array([3, -(2**63)], np.int64)
    with raises_usage("values", index=1):
        K.pack_fields(v, 7, 0)
    # no uint8 value can be valid with this bias
    with raises_usage("values", index=0):
        K.pack_fields(np.array([5], np.uint8), 4, -300)
    assert K.pack_fields(np.array([], np.uint8), 4, -300).size == 0
    # a large bias that is still valid
    v = np.array([-(2**62), -(2**62) + 127], np.int64)
    packed = K.pack_fields(v, 7, 2**62)
    np.testing.assert_array_equal(K.unpack_fields(packed, 2, 7, 2**62, dtype=np.int64), v)


def test_fields_errors() -> None:
    v = np.zeros(10, np.int32)
    for w in (0, 17, 2.0, True):
        with raises_usage("width"):
            K.pack_fields(v, w, 0)  # type: ignore[arg-type]
    with raises_usage("bias"):
        K.pack_fields(v, 4, 0.5)  # type: ignore[arg-type]
    with raises_usage("bias"):
        K.pack_fields(v, 4, 2**63)
    with raises_usage("values"):
        K.pack_fields(v.astype(np.float32), 4, 0)
    with raises_usage("out"):
        K.pack_fields(v, 4, 0, out=np.zeros(6, np.uint8))
    packed = K.pack_fields(v, 4, 0)
    with raises_usage("packed"):  # 11 4-bit fields take 6 bytes
        K.unpack_fields(packed, 11, 4, 0)
    with raises_usage("dtype"):
        K.unpack_fields(packed, 10, 4, 1, dtype=np.uint8)
    with raises_usage("dtype"):
        K.unpack_fields(packed, 10, 4, 0, dtype=np.float16)
    with raises_usage("out"):
        K.unpack_fields(packed, 10, 4, 0, out=np.zeros(10, np.int64))
    with raises_usage("acc"):
        K.add_fields(packed, 10, 4, 0, np.zeros(10, np.int8))
    with raises_usage("acc"):
        K.add_fields(packed, 10, 4, 0, np.zeros(11, np.int32))
    with raises_usage("acc"):
        K.add_fields(packed, 10, 4, 0, np.zeros(10, np.float32))


# --------------------------------------------------------------------------------------------
# common argument rules, dispatch, threads
# --------------------------------------------------------------------------------------------


def test_input_and_out_validation() -> None:
    x = np.ones(20, np.float32)
    with raises_usage("x"):
        K.pack_signs([1.0, 2.0])  # type: ignore[arg-type]
    with raises_usage("x"):
        K.pack_signs(x.reshape(4, 5))
    with raises_usage("x"):
        K.pack_signs(x[::2])
    with raises_usage("x"):
        K.pack_signs(x.astype(np.int32))
    with raises_usage("out"):
        K.pack_signs(x, out=np.zeros(4, np.int8))
    with raises_usage("out"):
        K.pack_ternary(x, out=np.zeros(4, np.uint8))
    ro = np.zeros(3, np.uint8)
    ro.flags.writeable = False
    with raises_usage("out"):
        K.pack_signs(x, out=ro)
    with raises_usage("out"):
        K.pack_signs(x, out=np.zeros(6, np.uint8)[::2])
    # read-only inputs and caller buffers are fine
    x.flags.writeable = False
    buf = np.full(3, 0xAA, np.uint8)
    assert K.pack_signs(x, out=buf) is buf
    np.testing.assert_array_equal(buf, [0xFF, 0xFF, 0x0F])


def test_unaligned_buffers() -> None:
    # arrays carved out of a byte buffer at an odd offset (e.g. received messages)
    rng = np.random.default_rng(5)
    n = 301
    raw = np.zeros(4 * n + 1, np.uint8)
    x = raw[1:].view(np.float32)
    assert not x.flags.aligned
    x[:] = votes_input(rng, n, np.float32)
    np.testing.assert_array_equal(K.pack_signs(x), R.pack_signs(x))
    raw_out = np.zeros(4 * n + 1, np.uint8)
    out = raw_out[1:].view(np.float32)
    bits = K.pack_signs(x)
    K.unpack_signs(bits, n, out=out, dtype=np.float32, scale=0.5)
    np.testing.assert_array_equal(out, R.unpack_signs(bits, n, np.float32, 0.5))


def test_kernels_are_nogil_and_cached() -> None:
    fk = B.field_kernels(5)
    kernels = [B.pack_votes_serial, B.pack_votes_parallel,
               B.unpack_signs_serial, B.unpack_signs_parallel,
               B.count_votes_serial, B.count_votes_parallel, B.majority_serial,
               B.majority_parallel, *fk]
    for kern in kernels:
        assert getattr(kern, "targetoptions", {}).get("nogil") is True, kern
        assert type(getattr(kern, "_cache", None)).__name__ == "FunctionCache", kern
    assert B.field_kernels(5) is fk


def test_busy_pool_falls_back_to_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    serial, parallel = B.pack_votes_serial, B.pack_votes_parallel

    def spy_serial(*a: Any) -> int:
        calls.append("serial")
        return int(serial(*a))

    def spy_parallel(*a: Any) -> int:
        calls.append("parallel")
        return int(parallel(*a))

    monkeypatch.setattr(B, "pack_votes_serial", spy_serial)
    monkeypatch.setattr(B, "pack_votes_parallel", spy_parallel)
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    want = R.pack_signs(x)
    with dispatch_mode("parallel"):
        np.testing.assert_array_equal(K.pack_signs(x), want)
        with K._pool_lock:  # another thread is using the pool
            np.testing.assert_array_equal(K.pack_signs(x), want)
    monkeypatch.setattr(K, "_nb_get_num_threads", lambda: 1)  # a pool of one thread
    np.testing.assert_array_equal(K.pack_signs(x), want)
    assert calls == ["parallel", "serial", "serial"]


@pytest.mark.timeout(120)
def test_concurrent_calls_from_threads() -> None:
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(50_001).astype(np.float32) for _ in range(4)]
    results: dict[int, list[npt.NDArray[np.uint8]]] = {}

    def work(k: int) -> None:
        results[k] = [K.pack_signs(xs[k]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    for k in range(4):
        want = R.pack_signs(xs[k])
        assert len(results[k]) == 20
        for got in results[k]:
            np.testing.assert_array_equal(got, want)


def test_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_num_threads is process-wide: a helper thread's kernels use the count too."""
    monkeypatch.setattr(K, "_process_threads", None)  # restored afterwards
    monkeypatch.setattr(K, "_explicit_threads", False)
    n = K.get_num_threads()
    assert n >= 1
    K.set_num_threads(1)
    seen: list[int] = []
    helper = threading.Thread(target=lambda: seen.append(K.get_num_threads()))
    helper.start()
    helper.join(timeout=30)
    assert K.get_num_threads() == 1 and seen == [1]
    monkeypatch.setattr(K, "_nb_get_num_threads", lambda: 2)  # a pool of 2 would be free
    with K.parallel_slot(10**9) as par:
        assert not par  # the process-wide count decides
    K.set_num_threads(n)
    with pytest.raises(UsageError):
        K.set_num_threads(0)
    with pytest.raises(UsageError):
        K.set_num_threads(10**6)
    assert K.get_num_threads() == n


def test_fit_threads_to_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's cores shared by its ranks, at most numba's pool; NUMBA_NUM_THREADS in the
    environment or an explicit set_num_threads wins."""
    monkeypatch.setattr(K, "_process_threads", None)
    monkeypatch.setattr(K, "_explicit_threads", False)
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(K, "usable_cores", lambda: 8)
    monkeypatch.setattr(K, "_nb_get_num_threads", lambda: 6)  # the pool numba started
    assert [K.fit_threads_to_host(k) for k in (1, 2, 3, 4, 8, 16)] == [6, 4, 2, 2, 1, 1]
    assert K.get_num_threads() == 1
    K._process_threads = None
    monkeypatch.setenv("NUMBA_NUM_THREADS", "6")
    assert K.fit_threads_to_host(4) == 6 and K._process_threads is None
    monkeypatch.delenv("NUMBA_NUM_THREADS")
    monkeypatch.setattr(K, "_nb_set_num_threads", lambda n: None)
    K.set_num_threads(5)
    assert K.fit_threads_to_host(4) == 5  # the explicit choice stays


def test_int_range_is_iinfo() -> None:
    dt: Any
    for dt in INT_DTYPES:
        info = np.iinfo(dt)
        assert K.int_range(np.dtype(dt)) == (int(info.min), int(info.max))
