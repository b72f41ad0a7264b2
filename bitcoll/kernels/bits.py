"""The numba kernels behind :mod:`bitcoll.kernels`.

These functions do no argument checking: :mod:`bitcoll.kernels` validates shapes, dtypes and
ranges and then calls them. Every kernel is compiled lazily on its first call, cached on disk
(``cache=True``) and releases the GIL (``nogil=True``), so a caller thread can overlap it with
socket I/O. Kernels whose name ends in ``_parallel`` split the work with ``prange`` into
independent chunks (``chunk`` is counted in the kernel's own unit: 64-element blocks, bytes,
words or 8-element groups); they give the same results as their serial twins for any chunk size.

Layout (see :mod:`bitcoll.kernels`): bit ``i`` of a packed vector is element ``i``, little-endian
within each byte; a ``w``-bit field stream puts element ``i`` at stream bits
``[i*w, (i+1)*w)``, least significant bit first. Eight ``w``-bit fields are exactly ``w`` bytes,
which is the unit (a *group*) the field kernels work in. Padding bits are always written as 0.

Floating-point inputs are processed through an unsigned integer view of their bits (``uint16``
for float16, ``uint32`` for float32, ``uint64`` for float64); the caller passes the masks:
``sign`` (only the sign bit set), ``absm`` (every bit but the sign) and ``inf`` (the bits of
+inf). For a raw value ``u``: ``u <= sign`` votes +1 (x >= 0, including -0.0), ``u & absm == 0``
is a zero, ``u & absm > inf`` is a NaN.

Error reporting: a kernel that validates its input returns the index of the first offending
element, or -1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]  # llvmlite ships no types
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = [
    "pack_votes_serial",
    "pack_votes_parallel",
    "unpack_signs_serial",
    "unpack_signs_parallel",
    "count_votes_serial",
    "count_votes_parallel",
    "majority_serial",
    "majority_parallel",
    "majority_signs_serial",
    "FieldKernels",
    "field_kernels",
    "extract_bits",
    "insert_bits",
    "first_field_above",
    "bf16_widen",
    "bf16_narrow",
    "BLOCK",
    "GROUP",
]

if sys.byteorder != "little":  # _store_u64 writes words in native byte order
    raise ImportError("bitcoll.kernels supports little-endian machines only")

_F = TypeVar("_F", bound=Callable[..., Any])

BLOCK = 64
"""Elements per block of the sign kernels (one uint64 word of packed bits)."""

GROUP = 8
"""Elements per group of the field kernels (``width`` bytes of packed fields)."""

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_B8 = np.uint64(0xFF)


def _kernel(parallel: bool = False) -> Callable[[_F], _F]:
    """``numba.njit`` with the options every kernel uses, typed for mypy."""
    return cast(Callable[[_F], _F], njit(cache=True, nogil=True, parallel=parallel))


def _helper() -> Callable[[_F], _F]:
    """A helper called by kernels (LLVM inlines the small ones)."""
    return cast(Callable[[_F], _F], njit(cache=True, nogil=True))


def _inline_ir() -> Callable[[_F], _F]:
    """A helper inlined into its caller by numba itself, before typing.

    The field kernels pass their width as a closure constant to such helpers, so that after
    inlining every shift and byte offset is a compile-time constant.
    """
    return cast(Callable[[_F], _F], njit(cache=True, nogil=True, inline="always"))


# --------------------------------------------------------------------------------------------
# Vector compare to a bit mask (the core of the sign kernels).
#
# LLVM turns "compare 64 lanes, then bitcast <64 x i1> to i64" into vector compares followed
# by movemask instructions (or the equivalent on other targets), which is several times fewer
# instructions than any scalar formulation numba can vectorize.
# --------------------------------------------------------------------------------------------


def _le_bits64_typer(typingctx: Any, arr: Any, idx: Any, mask: Any, bound: Any) -> Any:
    if not (isinstance(arr, types.Array) and isinstance(arr.dtype, types.Integer)
            and not getattr(arr.dtype, "signed", True) and isinstance(idx, types.Integer)
            and isinstance(mask, types.Integer) and isinstance(bound, types.Integer)):
        return None
    sig = types.uint64(arr, idx, mask, bound)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aty, _, mty, bty = signature.args
        elem = aty.dtype
        lty = ir.IntType(elem.bitwidth)
        vty = ir.VectorType(lty, 64)
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        vptr = builder.bitcast(ptr, vty.as_pointer())
        vals = builder.load(vptr, align=1)

        def splat(value: Any, fromty: Any) -> Any:
            scalar = context.cast(builder, value, fromty, elem)
            undef = ir.Constant(vty, ir.Undefined)
            one = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
            return builder.shuffle_vector(one, undef, zeros)

        masked = builder.and_(vals, splat(args[2], mty))
        hit = builder.icmp_unsigned("<=", masked, splat(args[3], bty))
        return builder.bitcast(hit, ir.IntType(64))

    return sig, codegen


_le_bits64: Callable[..., Any] = intrinsic(_le_bits64_typer)
"""``_le_bits64(a, i, mask, bound)`` -> uint64 whose bit k is ``(a[i + k] & mask) <= bound``.

``a`` is a 1-D unsigned integer array with at least ``i + 64`` elements (not checked); ``mask``
and ``bound`` are converted to ``a``'s dtype.
"""



def _store_u64_typer(typingctx: Any, arr: Any, idx: Any, value: Any) -> Any:
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8
            and isinstance(idx, types.Integer) and value == types.uint64):
        return None
    sig = types.none(arr, idx, value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        wptr = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        builder.store(args[2], wptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


_store_u64: Callable[..., Any] = intrinsic(_store_u64_typer)
"""``_store_u64(out, j, v)``: store the 8 little-endian bytes of ``v`` at ``out[j:j+8]``.

``out`` is a 1-D uint8 array with at least ``j + 8`` elements (not checked). One unaligned
8-byte store: unlike eight byte stores of shifted values, it keeps LLVM from scalarizing the
vector compare that produced ``v``. (Little-endian targets only, like every other layout
assumption here.)
"""


def _load_u64_typer(typingctx: Any, arr: Any, idx: Any) -> Any:
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8
            and isinstance(idx, types.Integer)):
        return None
    sig = types.uint64(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        wptr = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        return builder.load(wptr, align=1)

    return sig, codegen


_load_u64: Callable[..., Any] = intrinsic(_load_u64_typer)
"""``_load_u64(a, j)``: the 8 bytes ``a[j:j+8]`` of a 1-D uint8 array as a little-endian
word (one unaligned load; at least ``j + 8`` elements, not checked)."""


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


@_helper()
def _ctz64(x: np.uint64) -> int:
    """Index of the lowest set bit of a non-zero word (error paths only)."""
    k = 0
    while (x >> np.uint64(k)) & np.uint64(1) == 0:
        k += 1
    return k


@_helper()
def _st64(out: Any, j: int, v: np.uint64) -> None:
    """Store the 8 little-endian bytes of ``v`` at ``out[j:j+8]`` (LLVM merges the stores)."""
    for k in range(8):
        out[j + k] = np.uint8((v >> np.uint64(8 * k)) & _B8)


@_helper()
def _st_partial(out: Any, j: int, v: np.uint64, nb: int) -> None:
    """Store the low ``nb`` bytes of ``v`` at ``out[j:j+nb]``."""
    for k in range(nb):
        out[j + k] = np.uint8((v >> np.uint64(8 * k)) & _B8)


@_helper()
def _ld_row_partial(a: Any, r: int, j: int, nb: int) -> np.uint64:
    v = np.uint64(0)
    for k in range(nb):
        v |= np.uint64(a[r, j + k]) << np.uint64(8 * k)
    out: np.uint64 = v  # (numpy's stubs type the expression as Any on Python 3.10)
    return out


@_helper()
def _spread32(x: np.uint64) -> np.uint64:
    """Move bit k of the low 32 bits of ``x`` to bit 2k (the others become 0)."""
    x &= np.uint64(0x00000000FFFFFFFF)
    x = (x | (x << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    x = (x | (x << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x << np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    x = (x | (x << np.uint64(2))) & np.uint64(0x3333333333333333)
    x = (x | (x << np.uint64(1))) & np.uint64(0x5555555555555555)
    return x


@_helper()
def _spread8(b: Any) -> np.uint64:
    """Move bit k of the byte ``b`` to bit 8k (one 0/1 count per byte lane)."""
    x = (np.uint64(b) * np.uint64(0x0101010101010101)) & np.uint64(0x8040201008040201)
    out: np.uint64 = \
        ((x + np.uint64(0x7F7F7F7F7F7F7F7F)) >> np.uint64(7)) & np.uint64(0x0101010101010101)
    return out


@_helper()
def _first_error(errs: Any) -> int:
    """The smallest non-negative entry of ``errs``, or -1."""
    best = -1
    for e in errs:
        if e >= 0 and (best < 0 or e < best):
            best = e
    return best


# --------------------------------------------------------------------------------------------
# pack_signs and pack_ternary: float bits (uintN view) -> 1 bit per element (the +1 votes) or,
# with ``ternary``, 2-bit fields sign(x) + 1 (0: x < 0, 1: x == 0, 2: x > 0); NaN check in the
# same pass. One pair of drivers serves both: ``ternary`` picks the block helper once per chunk.
# --------------------------------------------------------------------------------------------


@_helper()
def _pack_signs_blocks(u: Any, out: Any, b0: int, b1: int, sign: Any, absm: Any,
                       inf: Any) -> int:
    for b in range(b0, b1):
        i = b * 64
        votes = _le_bits64(u, i, _ALL, sign)
        ok = _le_bits64(u, i, absm, inf)
        if ok != _ALL:
            return i + _ctz64(~ok)
        _store_u64(out, b * 8, votes)
    return -1


@_helper()
def _pack_ternary_blocks(u: Any, out: Any, b0: int, b1: int, sign: Any, absm: Any,
                         inf: Any) -> int:
    for b in range(b0, b1):
        i = b * 64
        nonneg = _le_bits64(u, i, _ALL, sign)
        zero = _le_bits64(u, i, absm, 0)
        ok = _le_bits64(u, i, absm, inf)
        if ok != _ALL:
            return i + _ctz64(~ok)
        pos = nonneg & ~zero
        lo = _spread32(zero) | (_spread32(pos) << np.uint64(1))
        hi = (_spread32(zero >> np.uint64(32))
              | (_spread32(pos >> np.uint64(32)) << np.uint64(1)))
        _store_u64(out, b * 16, lo)
        _store_u64(out, b * 16 + 8, hi)
    return -1


@_helper()
def _pack_blocks(u: Any, out: Any, b0: int, b1: int, sign: Any, absm: Any, inf: Any,
                 ternary: bool) -> int:
    """Pack the 64-element blocks ``b0 .. b1`` (8 bytes each, 16 when ``ternary``); the
    index of the first NaN, or -1."""
    if ternary:
        return _pack_ternary_blocks(u, out, b0, b1, sign, absm, inf)
    return _pack_signs_blocks(u, out, b0, b1, sign, absm, inf)


@_helper()
def _pack_votes_tail(u: Any, out: Any, sign: Any, absm: Any, inf: Any, ternary: bool) -> int:
    """Pack the elements after the last whole block, a byte at a time: 8 sign bits, or 4
    2-bit fields when ``ternary``; the index of the first NaN, or -1."""
    n: int = u.size
    per = 4 if ternary else 8  # elements per byte
    j = (n // 64) * (64 // per)
    while j * per < n:
        byte = 0
        for k in range(min(per, n - j * per)):
            v = u[j * per + k]
            m = v & absm
            if m > inf:
                return j * per + k
            if ternary:
                if m == 0:
                    byte |= 1 << (2 * k)
                elif v <= sign:
                    byte |= 2 << (2 * k)
            elif v <= sign:
                byte |= 1 << k
        out[j] = np.uint8(byte)
        j += 1
    return -1


@_kernel()
def pack_votes_serial(u: Any, out: Any, sign: Any, absm: Any, inf: Any, ternary: bool) -> int:
    """Pack the +1 votes of the raw float bits ``u`` into ``out`` (``ceil(n/8)`` bytes) or,
    when ``ternary``, sign(x) + 1 as 2-bit fields (``ceil(n/4)`` bytes).

    Returns the index of the first NaN, or -1 (``out`` is then partly written).
    """
    e = _pack_blocks(u, out, 0, u.size // 64, sign, absm, inf, ternary)
    if e >= 0:
        return e
    return _pack_votes_tail(u, out, sign, absm, inf, ternary)


@_kernel(parallel=True)
def pack_votes_parallel(u: Any, out: Any, sign: Any, absm: Any, inf: Any, ternary: bool,
                        chunk: int) -> int:
    """:func:`pack_votes_serial` split into chunks of ``chunk`` 64-element blocks."""
    nblocks = u.size // 64
    nchunks = (nblocks + chunk - 1) // chunk
    errs = np.empty(nchunks + 1, np.int64)
    for c in prange(nchunks):
        errs[c] = _pack_blocks(u, out, c * chunk, min(nblocks, (c + 1) * chunk),
                               sign, absm, inf, ternary)
    errs[nchunks] = _pack_votes_tail(u, out, sign, absm, inf, ternary)
    return _first_error(errs)


# --------------------------------------------------------------------------------------------
# unpack_signs: bits -> out[i] = pos if bit i else neg (out is an unsigned view of the result).
# A uint8 ``out`` takes 8 elements per store (_unpack_signs8_bytes), wider ones one element per
# store; the choice is made from out's type when a kernel is compiled (_unpack_bytes).
# --------------------------------------------------------------------------------------------


@_helper()
def _unpack_signs_bytes(bits: Any, out: Any, j0: int, j1: int, pos: Any, neg: Any) -> None:
    n = out.size
    full = min(j1, n // 8)
    for j in range(j0, full):
        b = bits[j]
        for k in range(8):
            out[8 * j + k] = pos if (b >> k) & 1 else neg
    for j in range(max(j0, full), j1):
        b = bits[j]
        for k in range(n - 8 * j):
            out[8 * j + k] = pos if (b >> k) & 1 else neg


@_helper()
def _unpack_signs8_bytes(bits: Any, out: Any, j0: int, j1: int, pos: Any, neg: Any) -> None:
    """:func:`_unpack_signs_bytes` for 1-byte outputs: each packed byte becomes one 8-byte
    word (bit k spread to byte lane k, then selected between ``pos`` and ``neg``)."""
    n = out.size
    full = min(j1, n // 8)
    rep = np.uint64(0x0101010101010101)
    hi = np.uint64(pos) * rep
    lo = np.uint64(neg) * rep
    for j in range(j0, full):
        m = _spread8(bits[j]) * _B8
        _store_u64(out, 8 * j, (m & hi) | (~m & lo))
    _unpack_signs_bytes(bits, out, max(j0, full), j1, pos, neg)


def _unpack_bytes(bits: Any, out: Any, j0: int, j1: int, pos: Any, neg: Any) -> None:
    """Unpack the bytes ``j0 .. j1`` of ``bits`` into ``out``: :func:`_unpack_signs8_bytes`
    for a 1-byte ``out``, else :func:`_unpack_signs_bytes` (in kernels only)."""
    raise RuntimeError("_unpack_bytes can only be called from a numba kernel")


def _unpack_bytes_typer(bits: Any, out: Any, j0: Any, j1: Any, pos: Any, neg: Any) -> Any:
    # Chosen from out's numba type, not by a run-time flag: _store_u64 in the word version
    # types for a uint8 out only. numba wants the implementations' parameters, annotations
    # included, to be exactly the typer's; they are not cached on their own, and need not be:
    # the kernels that call them are, with them compiled in.
    if out.dtype.bitwidth == 8:
        def words(bits: Any, out: Any, j0: Any, j1: Any, pos: Any, neg: Any) -> Any:
            _unpack_signs8_bytes(bits, out, j0, j1, pos, neg)

        return words

    def elements(bits: Any, out: Any, j0: Any, j1: Any, pos: Any, neg: Any) -> Any:
        _unpack_signs_bytes(bits, out, j0, j1, pos, neg)

    return elements


# prefer_literal: the serial kernel's start byte 0 reaches the helper as the constant it is
# in a direct call (numba types it Literal[int](0)); typed int64 instead, the serial unpack to
# 4-byte elements took about 1.7 times as long (64M elements).
overload(_unpack_bytes, jit_options={"nogil": True}, prefer_literal=True)(_unpack_bytes_typer)


@_kernel()
def unpack_signs_serial(bits: Any, out: Any, pos: Any, neg: Any) -> int:
    """``out[i] = pos if bit i of bits else neg`` for ``i < out.size``; returns 0."""
    _unpack_bytes(bits, out, 0, (out.size + 7) // 8, pos, neg)
    return 0


@_kernel(parallel=True)
def unpack_signs_parallel(bits: Any, out: Any, pos: Any, neg: Any, chunk: int) -> int:
    """:func:`unpack_signs_serial` split into chunks of ``chunk`` bytes."""
    nbytes = (out.size + 7) // 8
    nchunks = (nbytes + chunk - 1) // chunk
    for c in prange(nchunks):
        _unpack_bytes(bits, out, c * chunk, min(nbytes, (c + 1) * chunk), pos, neg)
    return 0


# --------------------------------------------------------------------------------------------
# count_votes: packed[p, nbytes] -> int32 counts, SWAR: 8 byte-lane counters per input byte
# --------------------------------------------------------------------------------------------

_COUNT_TILE = 256  # bytes of each row processed together (the counters stay in L1)


@_helper()
def _count_bytes(packed: Any, out: Any, j0: int, j1: int) -> None:
    p = packed.shape[0]
    n = out.size
    acc = np.empty(_COUNT_TILE, np.uint64)
    for t0 in range(j0, j1, _COUNT_TILE):
        m = min(_COUNT_TILE, j1 - t0)
        if p == 0:
            for i in range(t0 * 8, min(n, (t0 + m) * 8)):
                out[i] = 0
        for r0 in range(0, p, 255):  # byte lanes hold counts up to 255
            for j in range(m):
                acc[j] = 0
            for r in range(r0, min(p, r0 + 255)):
                for j in range(m):
                    acc[j] += _spread8(packed[r, t0 + j])
            for j in range(m):
                a = acc[j]
                base = (t0 + j) * 8
                cnt = min(8, n - base)
                if r0 == 0:
                    for k in range(cnt):
                        out[base + k] = np.int32((a >> np.uint64(8 * k)) & _B8)
                else:
                    for k in range(cnt):
                        out[base + k] += np.int32((a >> np.uint64(8 * k)) & _B8)


@_kernel()
def count_votes_serial(packed: Any, out: Any) -> int:
    """``out[i]`` = number of rows of ``packed`` whose bit ``i`` is 1; returns 0."""
    _count_bytes(packed, out, 0, (out.size + 7) // 8)
    return 0


@_kernel(parallel=True)
def count_votes_parallel(packed: Any, out: Any, chunk: int) -> int:
    """:func:`count_votes_serial` split into chunks of ``chunk`` bytes."""
    nbytes = (out.size + 7) // 8
    nchunks = (nbytes + chunk - 1) // chunk
    for c in prange(nchunks):
        _count_bytes(packed, out, c * chunk, min(nbytes, (c + 1) * chunk))
    return 0


# --------------------------------------------------------------------------------------------
# majority: bit-sliced counting.
#
# For every 64-element word a vertical counter of S + 1 bit planes (2**S > p) starts at
# 2**S - T in every lane, T = p // 2 + 1 the smallest winning count, and each of the p rows is
# added to it with a ripple-carry chain of AND/XOR. Afterwards plane S is set exactly where
# count >= T (2c > p), and planes 0..S-1 are all set exactly where count == T - 1, which for an
# even p is a tie (2c == p). The caller passes tie_mask = 0 for odd p.
# --------------------------------------------------------------------------------------------

_MAJ_TILE = 256  # words processed together (the planes stay in L1)


@_helper()
def _st_word(out: Any, word: int, v: np.uint64, n: int) -> None:
    """Store the 64 bits of elements ``64 word ..`` of an ``n``-bit packed vector ``out``;
    bits at or past ``n`` are cleared and bytes past the end of ``out`` are not written."""
    j = word * 8
    valid = n - word * 64
    if valid >= 64:
        _st64(out, j, v)
    else:
        v &= (np.uint64(1) << np.uint64(valid)) - np.uint64(1)
        _st_partial(out, j, v, out.shape[0] - j)


@_helper()
def _st_tile(out: Any, t0: int, m: int, tile: Any, n: int) -> None:
    """Store words ``tile[0 .. m]`` as words ``t0 .. t0 + m`` of the ``n``-bit packed vector
    ``out`` (1-D uint8), as :func:`_st_word` does word by word: the words wholly below bit
    ``n`` through a word view (one 64-bit store each), the last ones masked and cut."""
    whole = min(m, n // 64 - t0)
    if whole > 0:
        words = out[t0 * 8:(t0 + whole) * 8].view(np.uint64)
        for w in range(whole):
            words[w] = tile[w]
    for w in range(max(whole, 0), m):
        _st_word(out, t0 + w, tile[w], n)


@_helper()
def _add_row(packed: Any, r: int, t0: int, m: int, full: int, planes: Any, carry: Any,
             shift: int, b0: int, nbytes: int) -> None:
    """Add row ``r`` of ``packed`` (words ``t0 .. t0 + m`` of the ``nbytes`` bytes from byte
    ``b0``, ``full`` of them complete) at weight ``2**shift`` to the vertical counter
    ``planes`` (ripple carry through the planes from ``shift`` up)."""
    if full > 0:
        # One 64-bit load per word through a word view of the row (byte loads of a 2-D
        # array are not merged by LLVM: 13x slower here).
        words = packed[r, b0 + t0 * 8:b0 + (t0 + full) * 8].view(np.uint64)
        for w in range(full):
            carry[w] = words[w]
    for w in range(max(full, 0), m):
        j = (t0 + w) * 8
        carry[w] = _ld_row_partial(packed, r, b0 + j, nbytes - j)
    for s in range(shift, planes.shape[0]):
        for w in range(m):
            c = carry[w]
            x = planes[s, w]
            planes[s, w] = x ^ c
            carry[w] = x & c


@_helper()
def _majority_words(packed: Any, shifts: Any, out: Any, n: int, w0: int, w1: int,
                    nplanes: int, init: int, tie_mask: np.uint64) -> None:
    p = packed.shape[0]
    nbytes = packed.shape[1]
    top = nplanes - 1
    planes = np.empty((nplanes, _MAJ_TILE), np.uint64)
    carry = np.empty(_MAJ_TILE, np.uint64)
    for t0 in range(w0, w1, _MAJ_TILE):
        m = min(_MAJ_TILE, w1 - t0)
        full = min(m, nbytes // 8 - t0)  # words of the tile with all 8 bytes present
        for s in range(nplanes):
            v = _ALL if (init >> s) & 1 else np.uint64(0)
            for w in range(m):
                planes[s, w] = v
        for r in range(p):  # row r counts 2**shifts[r] votes
            _add_row(packed, r, t0, m, full, planes, carry, shifts[r], 0, nbytes)
        for w in range(m):
            tie = _ALL
            for s in range(top):
                tie &= planes[s, w]
            carry[w] = planes[top, w] | (tie & tie_mask)
        _st_tile(out, t0, m, carry, n)


@_kernel()
def majority_serial(packed: Any, shifts: Any, out: Any, n: int, nplanes: int, init: int,
                    tie_mask: np.uint64) -> int:
    """Majority of the rows of ``packed`` into ``out`` (see the section comment); row ``r``
    counts ``2**shifts[r]`` votes; returns 0."""
    _majority_words(packed, shifts, out, n, 0, (packed.shape[1] + 7) // 8, nplanes, init,
                    tie_mask)
    return 0


@_kernel()
def majority_signs_serial(packed: Any, shifts: Any, bits: Any, out: Any, n: int, nplanes: int,
                          init: int, tie_mask: np.uint64, pos: Any, neg: Any) -> int:
    """:func:`majority_serial` into ``bits``, then :func:`unpack_signs_serial` of ``bits``
    into ``out`` (one call where a small vote needs its result as values); returns 0."""
    _majority_words(packed, shifts, bits, n, 0, (packed.shape[1] + 7) // 8, nplanes, init,
                    tie_mask)
    _unpack_bytes(bits, out, 0, (out.size + 7) // 8, pos, neg)
    return 0


@_kernel(parallel=True)
def majority_parallel(packed: Any, shifts: Any, out: Any, n: int, nplanes: int, init: int,
                      tie_mask: np.uint64, chunk: int) -> int:
    """:func:`majority_serial` split into chunks of ``chunk`` 64-element words."""
    nwords = (packed.shape[1] + 7) // 8
    nchunks = (nwords + chunk - 1) // chunk
    for c in prange(nchunks):
        _majority_words(packed, shifts, out, n, c * chunk, min(nwords, (c + 1) * chunk),
                        nplanes, init, tie_mask)
    return 0


# Counts as bit planes: the same vertical counter started at 0, with ``width`` planes
# (2**width > p), stored plane by plane: plane s holds bit s of every element's count, packed
# like signs. Two-level majority sends a host's counts in this form and adds them with the
# majority kernel above (a plane of bit s counts 2**s votes).


@_helper()
def _count_plane_words(packed: Any, out: Any, n: int, b0: int, w0: int, w1: int) -> None:
    """Count planes of words ``w0 .. w1`` of the ``n`` elements from byte ``b0`` of each
    row."""
    p = packed.shape[0]
    nbytes = (n + 7) // 8
    width = out.shape[0]
    planes = np.empty((width, _MAJ_TILE), np.uint64)
    carry = np.empty(_MAJ_TILE, np.uint64)
    for t0 in range(w0, w1, _MAJ_TILE):
        m = min(_MAJ_TILE, w1 - t0)
        full = min(m, nbytes // 8 - t0)
        for s in range(width):
            for w in range(m):
                planes[s, w] = np.uint64(0)
        for r in range(p):
            _add_row(packed, r, t0, m, full, planes, carry, 0, b0, nbytes)
        for s in range(width):
            _st_tile(out[s], t0, m, planes[s], n)


@_kernel()
def count_planes_serial(packed: Any, out: Any, n: int, b0: int) -> int:
    """The vote counts of elements ``8 b0 .. 8 b0 + n`` of the rows of ``packed`` as the bit
    planes ``out``; returns 0."""
    _count_plane_words(packed, out, n, b0, 0, (n + 63) // 64)
    return 0


@_kernel(parallel=True)
def count_planes_parallel(packed: Any, out: Any, n: int, b0: int, chunk: int) -> int:
    """:func:`count_planes_serial` split into chunks of ``chunk`` 64-element words."""
    nwords = (n + 63) // 64
    nchunks = (nwords + chunk - 1) // chunk
    for c in prange(nchunks):
        _count_plane_words(packed, out, n, b0, c * chunk, min(nwords, (c + 1) * chunk))
    return 0


# --------------------------------------------------------------------------------------------
# Fields: one set of kernels per width, so that every shift is a compile-time constant.
#
# The helpers take the width ``W`` as an argument and are inlined (by numba) into the per-width
# kernels built by ``_make_field_kernels``, which pass their closure constant. Eight W-bit
# fields are one group of W bytes, held in two words: ``lw`` (bytes 0..7) and ``hw`` (8..15).
# --------------------------------------------------------------------------------------------


@_inline_ir()
def _put_field(lw: np.uint64, hw: np.uint64, f: np.uint64, k: int,
               W: int) -> tuple[np.uint64, np.uint64]:
    pos = k * W
    if pos < 64:
        lw |= f << np.uint64(pos)
        if pos + W > 64:
            hw |= f >> np.uint64(64 - pos)
    else:
        hw |= f << np.uint64(pos - 64)
    return lw, hw


@_inline_ir()
def _get_field(lw: np.uint64, hw: np.uint64, k: int, W: int) -> np.int64:
    pos = k * W
    fmask = (np.uint64(1) << np.uint64(W)) - np.uint64(1)
    if pos + W <= 64:
        f = (lw >> np.uint64(pos)) & fmask
    elif pos < 64:
        f = ((lw >> np.uint64(pos)) | (hw << np.uint64(64 - pos))) & fmask
    else:
        f = (hw >> np.uint64(pos - 64)) & fmask
    out: np.int64 = np.int64(f)
    return out


@_helper()
def _first_bad(values: Any, i0: int, i1: int, lo: np.uint64, span: np.uint64) -> int:
    for i in range(i0, i1):
        if np.uint64(values[i]) - lo > span:
            return i
    return -1


def _lane(values: Any, x: Any) -> Any:
    """``x`` (uint64) in the width of ``values``' elements: uint8 for 1-byte values, else
    ``x`` itself (in kernels only)."""
    raise RuntimeError("_lane can only be called from a numba kernel")


def _lane_typer(values: Any, x: Any) -> Any:
    # For 1-byte values the pack's arithmetic is exact modulo 2**8: the valid range
    # [lo, lo + span] lies inside the dtype's 256 values (pack_fields clips it), so
    # ``values[i] - lo`` (mod 2**8) <= span holds exactly for the valid elements, as it does
    # modulo 2**64. Typed uint8, LLVM vectorizes the pack in byte lanes (64 per AVX-512
    # register) instead of widening every element to 64 bits: 10.75M int8 at 2 bits took
    # 3.15 ms in uint64 lanes.
    if values.dtype.bitwidth == 8:
        def narrow(values: Any, x: Any) -> Any:
            return np.uint8(x)

        return narrow

    def wide(values: Any, x: Any) -> Any:
        return x

    return wide


overload(_lane, jit_options={"nogil": True}, inline="always")(_lane_typer)


@_inline_ir()
def _pack_aligned(values: Any, out: Any, g0: int, g1: int, lo: np.uint64, span: np.uint64,
                  off: np.uint64, W: int) -> int:
    """:func:`_pack_groups` for a width that divides 8 (1, 2, 4, 8): byte by byte, each
    byte ``8 / W`` whole fields, the validity check folded over the range (a loop LLVM
    vectorizes). An invalid element may leave garbage in its byte; the caller reports it."""
    per = 8 // W
    bad: Any = False
    span_l = _lane(values, span)
    off_l = _lane(values, off)
    for j in range(g0 * W, g1 * W):
        b = np.uint64(0)
        for k in range(per):
            d = _lane(values, np.uint64(values[j * per + k]) - lo)
            bad |= d > span_l
            b |= np.uint64(d + off_l) << np.uint64(W * k)
        out[j] = np.uint8(b & _B8)
    if bad:
        return _first_bad(values, 8 * g0, 8 * g1, lo, span)
    return -1


@_inline_ir()
def _pack_groups(values: Any, out: Any, g0: int, g1: int, lo: np.uint64, span: np.uint64,
                 off: np.uint64, W: int) -> int:
    """Pack groups ``[g0, g1)`` of 8 elements (``W`` bytes each); the first invalid index
    of the range, or -1. Widths that divide 8 take :func:`_pack_aligned` (``W`` is a
    constant there: one branch is compiled)."""
    if 8 % W == 0:
        return _pack_aligned(values, out, g0, g1, lo, span, off, W)
    bad: Any = False
    span_l = _lane(values, span)
    for g in range(g0, g1):
        lw = np.uint64(0)
        hw = np.uint64(0)
        for k in range(8):
            d = _lane(values, np.uint64(values[8 * g + k]) - lo)
            bad |= d > span_l
            lw, hw = _put_field(lw, hw, np.uint64(d) + off, k, W)
        o = g * W
        for b in range(min(W, 8)):
            out[o + b] = np.uint8((lw >> np.uint64(8 * b)) & _B8)
        for b in range(8, W):
            out[o + b] = np.uint8((hw >> np.uint64(8 * (b - 8))) & _B8)
    if bad:
        return _first_bad(values, 8 * g0, 8 * g1, lo, span)
    return -1


@_inline_ir()
def _pack_tail(values: Any, out: Any, lo: np.uint64, span: np.uint64, off: np.uint64,
               W: int) -> int:
    n = values.size
    g = n // 8
    count = n - 8 * g
    if count == 0:
        return -1
    e = _first_bad(values, 8 * g, n, lo, span)
    if e >= 0:
        return e
    lw = np.uint64(0)
    hw = np.uint64(0)
    for k in range(count):
        lw, hw = _put_field(lw, hw, (np.uint64(values[8 * g + k]) - lo) + off, k, W)
    o = g * W
    nb = (count * W + 7) // 8
    for b in range(min(nb, 8)):
        out[o + b] = np.uint8((lw >> np.uint64(8 * b)) & _B8)
    for b in range(8, nb):
        out[o + b] = np.uint8((hw >> np.uint64(8 * (b - 8))) & _B8)
    return -1


@_inline_ir()
def _unpack_aligned(packed: Any, out: Any, g0: int, g1: int, bias: np.int64, accumulate: bool,
                    W: int) -> None:
    """:func:`_unpack_groups` for a width that divides 8: byte by byte."""
    per = 8 // W
    fmask = (np.uint64(1) << np.uint64(W)) - np.uint64(1)
    if accumulate:
        for j in range(g0 * W, g1 * W):
            b = np.uint64(packed[j])
            for k in range(per):
                out[j * per + k] += np.int64((b >> np.uint64(W * k)) & fmask) - bias
    else:
        for j in range(g0 * W, g1 * W):
            b = np.uint64(packed[j])
            for k in range(per):
                out[j * per + k] = np.int64((b >> np.uint64(W * k)) & fmask) - bias


@_inline_ir()
def _unpack_groups(packed: Any, out: Any, g0: int, g1: int, bias: np.int64, accumulate: bool,
                   W: int) -> None:
    """Unpack groups ``[g0, g1)`` of 8 fields; widths that divide 8 take
    :func:`_unpack_aligned`."""
    if 8 % W == 0:
        _unpack_aligned(packed, out, g0, g1, bias, accumulate, W)
        return
    for g in range(g0, g1):
        o = g * W
        lw = np.uint64(0)
        hw = np.uint64(0)
        for b in range(min(W, 8)):
            lw |= np.uint64(packed[o + b]) << np.uint64(8 * b)
        for b in range(8, W):
            hw |= np.uint64(packed[o + b]) << np.uint64(8 * (b - 8))
        if accumulate:
            for k in range(8):
                out[8 * g + k] += _get_field(lw, hw, k, W) - bias
        else:
            for k in range(8):
                out[8 * g + k] = _get_field(lw, hw, k, W) - bias


@_inline_ir()
def _unpack_tail(packed: Any, out: Any, bias: np.int64, accumulate: bool, W: int) -> None:
    n = out.size
    g = n // 8
    count = n - 8 * g
    if count:
        o = g * W
        nb = (count * W + 7) // 8
        lw = np.uint64(0)
        hw = np.uint64(0)
        for b in range(min(nb, 8)):
            lw |= np.uint64(packed[o + b]) << np.uint64(8 * b)
        for b in range(8, nb):
            hw |= np.uint64(packed[o + b]) << np.uint64(8 * (b - 8))
        for k in range(count):
            if accumulate:
                out[8 * g + k] += _get_field(lw, hw, k, W) - bias
            else:
                out[8 * g + k] = _get_field(lw, hw, k, W) - bias


_LANES_3 = np.uint64(0x0303030303030303)
_LANES_1 = np.uint64(0x0101010101010101)
_LANES_H = np.uint64(0x8080808080808080)

SUM_SIGN_SWAR_ROWS = 42
"""Most rows the 2-bit ``sum_sign`` kernel sums in 8-bit lanes (3 * 42 = 126: every lane's
sum and its ``+ 1`` stay below 128, so lane-wise compares need no borrow between lanes)."""


@_helper()
def _sign_code(t: np.uint64, c_plus_1: np.uint64, c_high: np.uint64) -> np.uint64:
    """Per 8-bit lane of ``t`` (sums below 127), ``sign(t - c) + 1``: ``c_plus_1`` holds
    ``c + 1`` and ``c_high`` holds ``c | 0x80`` in every lane (``c`` below 127)."""
    gt = (((t | _LANES_H) - c_plus_1) & _LANES_H) >> np.uint64(7)  # t >= c + 1
    lt = ((c_high - (t + _LANES_1)) & _LANES_H) >> np.uint64(7)  # c >= t + 1
    out: np.uint64 = _LANES_1 + gt - lt
    return out


@_helper()
def _sum_sign_w2(rows: Any, out: Any, e0: int, e1: int, bias: np.int64) -> None:
    """Elements ``[e0, e1)`` (multiples of 32) of the 2-bit ``sum_sign`` kernel, 32 at a
    time in 64-bit words: each row's word split into its four fields of every byte, one per
    8-bit lane, summed over the rows (at most :data:`SUM_SIGN_SWAR_ROWS`), compared with
    ``rows * bias`` lane by lane and packed back."""
    r = rows.shape[0]
    c = np.uint64(np.int64(r) * bias)
    c_plus_1 = (c + np.uint64(1)) * _LANES_1
    c_high = (c * _LANES_1) | _LANES_H
    for j in range(e0 // 4, e1 // 4, 8):
        a0 = np.uint64(0)
        a1 = np.uint64(0)
        a2 = np.uint64(0)
        a3 = np.uint64(0)
        for i in range(r):
            w = _load_u64(rows[i], j)
            a0 += w & _LANES_3
            a1 += (w >> np.uint64(2)) & _LANES_3
            a2 += (w >> np.uint64(4)) & _LANES_3
            a3 += (w >> np.uint64(6)) & _LANES_3
        _store_u64(out, j, _sign_code(a0, c_plus_1, c_high)
                   | (_sign_code(a1, c_plus_1, c_high) << np.uint64(2))
                   | (_sign_code(a2, c_plus_1, c_high) << np.uint64(4))
                   | (_sign_code(a3, c_plus_1, c_high) << np.uint64(6)))


@_inline_ir()
def _group_words(row: Any, o: int, nb: int) -> tuple[np.uint64, np.uint64]:
    """Bytes ``[o, o + nb)`` of ``row`` (1-D uint8, ``nb <= 16``) as two little-endian
    words, bytes 8 and up in the second. The first is one 8-byte load where ``row`` holds 8
    bytes from ``o``: bytes past ``nb`` then fill it, so callers read only the fields of
    those ``nb`` bytes."""
    if o + 8 <= row.size:
        lw = _load_u64(row, o)
    else:
        lw = np.uint64(0)
        for b in range(min(nb, 8)):
            lw |= np.uint64(row[o + b]) << np.uint64(8 * b)
    hw = np.uint64(0)
    for b in range(8, nb):
        hw |= np.uint64(row[o + b]) << np.uint64(8 * (b - 8))
    return lw, hw


_LANES16_1 = np.uint64(0x0001000100010001)
_LANES16_H = np.uint64(0x8000800080008000)

SUM_SIGN_LANES16_LIMIT = 32767
"""The 16-bit lane path of ``sum_sign`` takes ``rows * (2**width - 1)`` below this (every
lane's sum and its ``+ 1`` stay below 32768)."""


@_helper()
def _sign_code16(t: np.uint64, c_plus_1: np.uint64, c_high: np.uint64) -> np.uint64:
    """:func:`_sign_code` in 16-bit lanes (sums and ``c`` below 32767), the four lanes'
    codes packed as 2-bit fields (8 bits)."""
    gt = (((t | _LANES16_H) - c_plus_1) & _LANES16_H) >> np.uint64(15)
    lt = ((c_high - (t + _LANES16_1)) & _LANES16_H) >> np.uint64(15)
    code = _LANES16_1 + gt - lt
    out: np.uint64 = (code & np.uint64(3)) | ((code >> np.uint64(14)) & np.uint64(0xC)) \
        | ((code >> np.uint64(28)) & np.uint64(0x30)) \
        | ((code >> np.uint64(42)) & np.uint64(0xC0))
    return out


@_inline_ir()
def _sum_sign_lanes16(rows: Any, out: Any, g0: int, g1: int, bias: np.int64, W: int) -> None:
    """Whole groups ``[g0, g1)`` of 8 elements of ``sum_sign`` at any width: each row's 8
    fields of a group spread over two words of four 16-bit lanes and summed over the rows,
    then compared with ``rows * bias`` lane by lane and packed as 16 bits. One pass over the
    packed rows and nothing else (no buffer of sums)."""
    r = rows.shape[0]
    c = np.uint64(np.int64(r) * bias)
    c_plus_1 = (c + np.uint64(1)) * _LANES16_1
    c_high = (c * _LANES16_1) | _LANES16_H
    for g in range(g0, g1):
        o = g * W
        a_lo = np.uint64(0)
        a_hi = np.uint64(0)
        for i in range(r):
            lw, hw = _group_words(rows[i], o, W)
            a_lo += np.uint64(_get_field(lw, hw, 0, W)) \
                | (np.uint64(_get_field(lw, hw, 1, W)) << np.uint64(16)) \
                | (np.uint64(_get_field(lw, hw, 2, W)) << np.uint64(32)) \
                | (np.uint64(_get_field(lw, hw, 3, W)) << np.uint64(48))
            a_hi += np.uint64(_get_field(lw, hw, 4, W)) \
                | (np.uint64(_get_field(lw, hw, 5, W)) << np.uint64(16)) \
                | (np.uint64(_get_field(lw, hw, 6, W)) << np.uint64(32)) \
                | (np.uint64(_get_field(lw, hw, 7, W)) << np.uint64(48))
        out[2 * g] = np.uint8(_sign_code16(a_lo, c_plus_1, c_high))
        out[2 * g + 1] = np.uint8(_sign_code16(a_hi, c_plus_1, c_high))


@_inline_ir()
def _sum_sign_groups(rows: Any, out: Any, g0: int, g1: int, n: int, bias: np.int64,
                     W: int) -> None:
    """Groups ``[g0, g1)`` of 8 elements (the last one may be partial: ``n`` elements in
    all) of :func:`field_kernels`' ``sum_sign``: per element the sum over the rows of
    ``field - bias``, its sign + 1 packed as a 2-bit field (2 bytes per group; the padding
    bits of a partial group's last byte are 0). 2-bit fields of few rows take
    :func:`_sum_sign_w2`, whole groups whose sums fit 16 bits :func:`_sum_sign_lanes16`,
    the rest (a partial last group, very many rows or wide fields) the loop below."""
    if W == 2 and rows.shape[0] <= SUM_SIGN_SWAR_ROWS and 0 <= bias <= 3 and \
            (8 * g0) % 32 == 0:
        e_swar = 8 * g0 + (min(n, 8 * g1) - 8 * g0) // 32 * 32
        _sum_sign_w2(rows, out, 8 * g0, e_swar, bias)
        g0 = e_swar // 8  # left: fewer than 32 elements
        if g0 >= g1:
            return
    if rows.shape[0] * ((1 << W) - 1) < SUM_SIGN_LANES16_LIMIT:
        whole = min(g1, n // 8)
        if g0 < whole:
            _sum_sign_lanes16(rows, out, g0, whole, bias, W)
            g0 = whole  # left: a last partial group, element by element below
        if g0 >= g1:
            return
    r = rows.shape[0]
    acc = np.zeros(8, np.int64)
    total_bias = np.int64(r) * bias
    for g in range(g0, g1):
        count = min(8, n - 8 * g)
        nb = (count * W + 7) // 8
        o = g * W
        for k in range(8):
            acc[k] = 0
        for i in range(r):
            lw, hw = _group_words(rows[i], o, nb)
            for k in range(8):  # (fields from count on may hold bytes past the group: unused)
                acc[k] += _get_field(lw, hw, k, W)
        word = np.int64(0)
        for k in range(count):
            t = acc[k] - total_bias
            word |= (np.int64(2) if t > 0 else (np.int64(0) if t < 0 else np.int64(1))) \
                << np.int64(2 * k)
        out[2 * g] = np.uint8(word & 0xFF)
        if count > 4:
            out[2 * g + 1] = np.uint8((word >> np.int64(8)) & 0xFF)


class FieldKernels(NamedTuple):
    """The field kernels of one width (see :func:`field_kernels`)."""

    pack_serial: Callable[..., int]
    pack_parallel: Callable[..., int]
    unpack_serial: Callable[..., int]
    unpack_parallel: Callable[..., int]
    sum_sign_serial: Callable[..., int]
    sum_sign_parallel: Callable[..., int]


@cache
def field_kernels(width: int) -> FieldKernels:
    """Build (not compile) the field kernels of ``width`` bits, 1 <= width <= 16.

    ``pack_*(values, out, lo, span, off[, chunk])``: field i = ``(values[i] - lo) + off``
    computed modulo 2**64 (``lo``, ``span``, ``off`` are uint64); an element is valid iff
    ``values[i] - lo`` (mod 2**64) <= ``span``. Returns the first invalid index or -1.
    ``unpack_*(packed, out, bias, accumulate[, chunk])``: ``out[i] = field i - bias`` (cast to
    out's dtype), or ``out[i] += field i - bias`` (wrapping in out's dtype) when ``accumulate``.
    ``sum_sign_*(rows, n, bias, out[, chunk])``: for ``rows`` (``uint8[r, ceil(n*width/8)]``,
    r >= 0) and each element i < n, ``t = sum over the rows of (field i - bias)``, written to
    ``out`` (``uint8[ceil(n/4)]``) as the 2-bit field ``sign(t) + 1`` (what unpacking every
    row, adding, ``np.sign`` and packing at width 2 with bias 1 give, in one pass).
    Chunks are counted in groups of 8 elements.
    """
    return _make_field_kernels(width)


def _make_field_kernels(width: int) -> FieldKernels:
    # The kernels' only closure variable is this int: numba compiles it in as a constant and
    # keys its on-disk cache on it, so each width is compiled once per machine.
    W = width

    @_kernel()
    def pack_serial(values: Any, out: Any, lo: np.uint64, span: np.uint64,
                    off: np.uint64) -> int:
        e = _pack_groups(values, out, 0, values.size // 8, lo, span, off, W)
        if e >= 0:
            return e
        return _pack_tail(values, out, lo, span, off, W)

    @_kernel(parallel=True)
    def pack_parallel(values: Any, out: Any, lo: np.uint64, span: np.uint64, off: np.uint64,
                      chunk: int) -> int:
        ngroups = values.size // 8
        nchunks = (ngroups + chunk - 1) // chunk
        errs = np.empty(nchunks + 1, np.int64)
        for c in prange(nchunks):
            errs[c] = _pack_groups(values, out, c * chunk, min(ngroups, (c + 1) * chunk),
                                   lo, span, off, W)
        errs[nchunks] = _pack_tail(values, out, lo, span, off, W)
        return _first_error(errs)

    @_kernel()
    def unpack_serial(packed: Any, out: Any, bias: np.int64, accumulate: bool) -> int:
        _unpack_groups(packed, out, 0, out.size // 8, bias, accumulate, W)
        _unpack_tail(packed, out, bias, accumulate, W)
        return 0

    @_kernel(parallel=True)
    def unpack_parallel(packed: Any, out: Any, bias: np.int64, accumulate: bool,
                        chunk: int) -> int:
        ngroups = out.size // 8
        nchunks = (ngroups + chunk - 1) // chunk
        for c in prange(nchunks):
            _unpack_groups(packed, out, c * chunk, min(ngroups, (c + 1) * chunk), bias,
                           accumulate, W)
        _unpack_tail(packed, out, bias, accumulate, W)
        return 0

    @_kernel()
    def sum_sign_serial(rows: Any, n: int, bias: np.int64, out: Any) -> int:
        _sum_sign_groups(rows, out, 0, (n + 7) // 8, n, bias, W)
        return 0

    @_kernel(parallel=True)
    def sum_sign_parallel(rows: Any, n: int, bias: np.int64, out: Any, chunk: int) -> int:
        ngroups = (n + 7) // 8
        nchunks = (ngroups + chunk - 1) // chunk
        for c in prange(nchunks):
            _sum_sign_groups(rows, out, c * chunk, min(ngroups, (c + 1) * chunk), n, bias, W)
        return 0

    return FieldKernels(pack_serial, pack_parallel, unpack_serial, unpack_parallel,
                        sum_sign_serial, sum_sign_parallel)


# --------------------------------------------------------------------------------------------
# Bit ranges: copy ``nbits`` bits between streams at any bit offsets (packed collectives with
# packed input and output), and the check of a field stream's values.
# --------------------------------------------------------------------------------------------


@_helper()
def _copy_bytes(src: Any, i: int, out: Any, o: int, count: int) -> None:
    """``out[o:o + count] = src[i:i + count]``, 8 bytes at a time."""
    k0 = 0
    while k0 + 8 <= count:
        _store_u64(out, o + k0, _load_u64(src, i + k0))
        k0 += 8
    for k in range(k0, count):
        out[o + k] = src[i + k]


@_helper()
def _shift_bytes(src: Any, i: int, t: int, out: Any, o: int, count: int) -> None:
    """``out[o + k] = bits [8 (i + k) + t, 8 (i + k) + t + 8)`` of ``src`` for ``k < count``
    (``1 <= t <= 7``; bits past the end of ``src`` read as 0)."""
    full = max(0, min(count, src.size - i - 1))  # bytes whose two source bytes both exist
    k0 = 0
    while k0 + 8 <= full:  # 8 bytes at a time (their 9 source bytes exist)
        lo = _load_u64(src, i + k0)
        hi = np.uint64(src[i + k0 + 8])
        _store_u64(out, o + k0, (lo >> np.uint64(t)) | (hi << np.uint64(64 - t)))
        k0 += 8
    for k in range(k0, full):
        out[o + k] = np.uint8(((np.int64(src[i + k]) >> t)
                               | (np.int64(src[i + k + 1]) << (8 - t))) & 0xFF)
    for k in range(max(0, full), count):
        out[o + k] = np.uint8(np.int64(src[i + k]) >> t)


@_kernel()
def extract_bits(src: Any, start: int, nbits: int, out: Any) -> int:
    """Bits ``[start, start + nbits)`` of ``src`` to ``out`` from bit 0 (``ceil(nbits/8)``
    bytes); the padding bits of the last byte are written as 0."""
    nb = (nbits + 7) >> 3
    b0 = start >> 3
    t = start & 7
    if t == 0:
        _copy_bytes(src, b0, out, 0, nb)
    else:
        _shift_bytes(src, b0, t, out, 0, nb)
    tail = nbits & 7
    if tail:
        out[nb - 1] = np.uint8(np.int64(out[nb - 1]) & ((1 << tail) - 1))
    return 0


@_kernel()
def insert_bits(dst: Any, start: int, src: Any, nbits: int) -> int:
    """Bits ``[0, nbits)`` of ``src`` to bits ``[start, start + nbits)`` of ``dst``; every
    other bit of ``dst`` keeps its value."""
    if nbits == 0:
        return 0
    s = start & 7
    b0 = start >> 3
    b_last = (start + nbits - 1) >> 3
    e = (start + nbits - 1) & 7  # last bit written in byte b_last
    if s == 0:
        full = nbits >> 3
        _copy_bytes(src, 0, dst, b0, full)
        if nbits & 7:
            m = (1 << (nbits & 7)) - 1
            dst[b0 + full] = np.uint8((np.int64(dst[b0 + full]) & ~m & 0xFF)
                                      | (np.int64(src[full]) & m))
        return 0
    # first byte: its bits s..7 (fewer when the range ends in it) come from src bits 0..
    m0 = ((1 << min(8 - s, nbits)) - 1) << s
    dst[b0] = np.uint8((np.int64(dst[b0]) & ~m0 & 0xFF) | ((np.int64(src[0]) << s) & m0))
    if b_last == b0:
        return 0
    # interior bytes b0+1 .. b_last-1: every bit written; dst byte d holds src bits from
    # 8 (d - b0) - s = 8 k + (8 - s) with k = d - b0 - 1
    _shift_bytes(src, 0, 8 - s, dst, b0 + 1, b_last - b0 - 1)
    k = b_last - b0 - 1
    v = np.int64(src[k]) >> (8 - s)
    if k + 1 < src.size:
        v |= (np.int64(src[k + 1]) << s) & 0xFF
    m1 = (1 << (e + 1)) - 1
    dst[b_last] = np.uint8((np.int64(dst[b_last]) & ~m1 & 0xFF) | (v & m1))
    return 0


@_kernel()
def first_field_above(packed: Any, n: int, w: int, limit: int) -> int:
    """Index of the first of ``n`` ``w``-bit fields (``w <= 16``) above ``limit``, or -1."""
    fmask = np.uint64((1 << w) - 1)
    lim = np.uint64(limit)
    for g in range(n // 8):  # 8 fields are w bytes
        o = g * w
        lw = np.uint64(0)
        hw = np.uint64(0)
        for b in range(min(w, 8)):
            lw |= np.uint64(packed[o + b]) << np.uint64(8 * b)
        for b in range(8, w):
            hw |= np.uint64(packed[o + b]) << np.uint64(8 * (b - 8))
        for k in range(8):
            pos = k * w
            if pos + w <= 64:
                f = (lw >> np.uint64(pos)) & fmask
            elif pos < 64:
                f = ((lw >> np.uint64(pos)) | (hw << np.uint64(64 - pos))) & fmask
            else:
                f = (hw >> np.uint64(pos - 64)) & fmask
            if f > lim:
                return 8 * g + k
    for i in range((n // 8) * 8, n):
        bit = i * w
        v = np.uint64(0)
        for b in range(3):  # a field of <= 16 bits at bit offset <= 7 spans <= 3 bytes
            j = (bit >> 3) + b
            if j < packed.size:
                v |= np.uint64(packed[j]) << np.uint64(8 * b)
        if (v >> np.uint64(bit & 7)) & fmask > lim:
            return i
    return -1


# --------------------------------------------------------------------------------------------
# bfloat16 <-> float32 (bfloat16 is the upper half of a float32's bits)
# --------------------------------------------------------------------------------------------


@_kernel()
def bf16_widen(bits: Any, out: Any) -> int:
    """``out[i]`` (uint32 view of float32) = ``bits[i] << 16``: exact."""
    for i in range(bits.size):
        out[i] = np.uint32(bits[i]) << np.uint32(16)
    return 0


@_kernel()
def bf16_narrow(u: Any, out: Any) -> int:
    """``out[i]`` = float32 bits ``u[i]`` rounded to bfloat16, to nearest, ties to even; NaN
    becomes the quiet NaN ``0x7FC0`` (torch's scalar conversion; the rest is torch's too)."""
    for i in range(u.size):
        v = u[i]
        if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16(0x7FC0)
        else:
            bias = ((v >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
            out[i] = np.uint16((v + bias) >> np.uint32(16))
    return 0
