"""Vote codecs: how packed-bit collectives encode contributions and aggregate them.

A codec fixes three things for one packed collective:

* the **input field width** ``w_in`` and the encoder of a rank's contribution:
  1-bit signs (majority; ``x >= 0`` and ``-0.0`` vote +1), 2-bit ternary signs
  (``sign(x)`` in {-1, 0, 1}), or ``ceil(log2(2 L + 1))``-bit integers in ``[-L, L]``;
* the **owner's aggregation** of ``p`` packed rows into the result: the majority bit (with
  the tie rule), the exact sum, or the exact sum's sign, packed in ``w_out`` bits (1 for
  majority, ``ceil(log2(2 L p + 1))`` for sums, biased by ``L p``, 2 for signs, biased by 1);
* the **decoder** of the packed result into the caller's output (int8 +-1 for majority, the
  sums or signs in the output's integer dtype).

Bit order everywhere: element ``i`` occupies stream bits ``[i w, (i + 1) w)``, little-endian
(``numpy.packbits(bits, bitorder="little")`` is the 1-bit layout). Segments of a block are
multiples of 8 elements, so the packing of a block is the concatenation of its segments'.

Packed input and output (``packed_in`` / ``packed_out``, the ``packed_*`` collectives): the
caller's input already is the ``w_in``-bit field stream of its contribution, and its output is
the ``w_out``-bit field stream of the result. These are the two ends of the same pipeline:
encoding elements ``[lo, hi)`` then only moves stream bits ``[lo w_in, hi w_in)`` to bit 0 of
the wire buffer, and decoding moves the result's bits into place in the output stream. The
algorithms address inputs and outputs by element range only (:meth:`VoteCodec.encode`,
:meth:`VoteCodec.decode`), so every algorithm serves both forms unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from .. import kernels
from ..errors import UsageError

__all__ = ["VoteCodec", "MajorityCodec", "SumCodec", "TernarySumCodec", "make_codec",
           "field_width", "TIES"]

Array = npt.NDArray[Any]

TIES = {"positive": kernels.TIE_POSITIVE, "negative": kernels.TIE_NEGATIVE,
        "alternate": kernels.TIE_ALTERNATE}


def field_width(max_abs: int) -> int:
    """Bits needed for integers in ``[-max_abs, max_abs]``: ``ceil(log2(2 max_abs + 1))``."""
    return max(1, int(2 * max_abs).bit_length())


@dataclass(frozen=True)
class VoteCodec(ABC):
    """Encoding and aggregation of one packed collective (see the module docstring); one
    subclass per kind of contribution: :class:`MajorityCodec` (1-bit sign votes),
    :class:`TernarySumCodec` (2-bit ternary signs, summed), :class:`SumCodec` (integers in
    ``[-levels, levels]``, summed). :func:`make_codec` picks the class.

    ``levels``: the largest magnitude of a contribution (1 for signs); ``size``: the world
    size. ``tie``: a kernels.TIE_* constant; ``tie_call``: the communicator's majority call
    counter. ``packed_in``: the input is the ``w_in``-bit field stream of the contribution
    (uint8) instead of values; ``packed_out``: the output is the ``w_out``-bit field stream of
    the result (uint8) instead of values. Element ranges are the same either way.
    """

    levels: int
    size: int
    tie: int = kernels.TIE_ALTERNATE
    tie_call: int = 0
    packed_in: bool = False
    packed_out: bool = False

    #: Whether the owner decides a majority bit (True) or keeps exact sums (False): the
    #: two-level algorithm moves majority counts as bit planes and sums as fields.
    majority: ClassVar[bool] = False

    @property
    def w_in(self) -> int:
        """Bits of one encoded contribution."""
        return field_width(self.levels)

    @property
    def bias_in(self) -> int:
        """What is added to a contribution to make its field non-negative."""
        return self.levels

    @property
    def w_out(self) -> int:
        """Bits of one packed result."""
        return field_width(self.levels * self.size)

    @property
    def bias_out(self) -> int:
        """What is added to a result to make its field non-negative."""
        return self.levels * self.size

    def count_field(self, contributions: int) -> tuple[int, int]:
        """(width, bias) of a partial aggregate of ``contributions`` inputs, as the ring and
        the two-level algorithm move it: sums of ``contributions`` values in
        ``[-levels, levels]``."""
        return field_width(self.levels * contributions), self.levels * contributions

    def encode(self, x: Array, lo: int, hi: int, out: Array) -> None:
        """Pack elements ``[lo, hi)`` of this rank's input ``x`` into ``out`` (uint8,
        ``ceil((hi - lo) w_in / 8)`` bytes, from bit 0; padding bits 0)."""
        if self.packed_in:
            kernels.extract_bits(x, lo * self.w_in, (hi - lo) * self.w_in, out=out)
            return
        try:
            self._encode_values(x[lo:hi], out)
        except UsageError as exc:
            if exc.index is None or not lo:
                raise
            # The kernel counts from the slice's start: name the element of ``x``.
            text = str(exc).replace(f"index {exc.index}", f"index {lo + exc.index}")
            raise UsageError(text, argument=exc.argument, index=lo + exc.index) from None

    def combine(self, rows: Array, n: int, first: int, out: Array,
                work: Array | None = None) -> None:
        """Aggregate ``rows`` (uint8 ``(p, nbytes)``, one packed contribution per rank) for
        ``n`` elements whose first global index is ``first``; write the packed result.
        ``work``: int32, exactly ``n`` elements, overwritten (a caller's reused buffer: no
        fresh pages per call), or None for a new one."""
        self.finish(self.totals(rows, n, np.empty(n, np.int32) if work is None else work),
                    first, out)

    def totals(self, rows: Array, n: int, work: Array) -> Array:
        """The exact sums over ``rows`` (uint8 ``(r, nbytes)``, packed contributions at
        ``w_in`` bits) of ``n`` elements, written to ``work`` (int32[n], its contents
        ignored) and returned. The first row is written, not added to zeros: no pass to
        clear the totals."""
        if not len(rows):
            work.fill(0)
            return work
        kernels.unpack_fields(rows[0], n, self.w_in, self.bias_in, out=work)
        for row in rows[1:]:
            kernels.add_fields(row, n, self.w_in, self.bias_in, work)
        return work

    def finish(self, totals: Array, first: int, out: Array) -> None:
        """Write the packed result of ``totals`` (int32, one partial aggregate of all
        ``size`` contributions per element, as :meth:`count_field` of ``size`` describes)
        for elements whose first global index is ``first``. ``totals`` may be overwritten."""
        kernels.pack_fields(totals, self.w_out, self.bias_out, out=out)

    def decode(self, packed: Array, out: Array, lo: int, hi: int) -> None:
        """Write the ``hi - lo`` results packed in ``packed`` (from bit 0, ``w_out`` bits each)
        to elements ``[lo, hi)`` of ``out``; with ``packed_out``, to stream bits
        ``[lo w_out, hi w_out)`` of ``out`` (its other bits are left as they are)."""
        if self.packed_out:
            kernels.insert_bits(out, lo * self.w_out, packed, (hi - lo) * self.w_out)
        else:
            self._decode_values(packed, out[lo:hi])

    def local(self, x: Array, out: Array, n: int) -> None:
        """The result of a one-rank world (``n`` elements): each vote or value is its own
        aggregate."""
        if self.packed_in or self.packed_out:
            # Through the codec's own steps: encode, aggregate one row, decode.
            row = np.empty((1, kernels.packed_nbytes(n, self.w_in)), np.uint8)
            self.encode(x, 0, n, row[0])
            res = np.empty(kernels.packed_nbytes(n, self.w_out), np.uint8)
            self.combine(row, n, 0, res)
            self.decode(res, out, 0, n)
        else:
            self._local_values(x, out)

    @abstractmethod
    def _encode_values(self, x: Array, out: Array) -> None:
        """Pack the values ``x`` into ``out`` (``w_in`` bits each)."""

    def _decode_values(self, packed: Array, dst: Array) -> None:
        """The sums in ``dst``'s integer dtype."""
        if (1 << self.w_out) - 1 - self.bias_out <= kernels.int_range(dst.dtype)[1]:
            kernels.unpack_fields(packed, dst.size, self.w_out, self.bias_out, out=dst,
                                  dtype=dst.dtype)
        else:
            # The sums fit ``dst`` (checked by the communicator) but the field's full range
            # does not: decode wider, then narrow.
            wide = kernels.unpack_fields(packed, dst.size, self.w_out, self.bias_out,
                                         dtype=np.int32)
            np.copyto(dst, wide, casting="unsafe")

    def _local_values(self, x: Array, out: Array) -> None:
        np.copyto(out, x, casting="unsafe")


@dataclass(frozen=True)
class MajorityCodec(VoteCodec):
    """1-bit sign votes (``x >= 0`` and ``-0.0`` vote +1); the result is the majority bit
    with the tie rule, decoded to int8 +-1."""

    majority: ClassVar[bool] = True

    @property
    def w_in(self) -> int:
        return 1

    @property
    def bias_in(self) -> int:
        return 0

    @property
    def w_out(self) -> int:
        return 1

    @property
    def bias_out(self) -> int:
        return 0

    def count_field(self, contributions: int) -> tuple[int, int]:
        """Counts of +1 votes in ``[0, contributions]``: ``ceil(log2(contributions + 1))``
        bits, no bias."""
        return max(1, contributions.bit_length()), 0

    def combine(self, rows: Array, n: int, first: int, out: Array,
                work: Array | None = None) -> None:
        # Counts the rows' bits in the kernel: no totals, ``work`` is not used.
        kernels.majority(rows, n, self.tie, first + self.tie_call, out=out)

    def finish(self, totals: Array, first: int, out: Array) -> None:
        # A count c of +1 votes out of p decides like two rows: (2c >= p, 2c > p) has two
        # ones above half, two zeros below half and one of each on a tie.
        p = self.size
        votes = np.empty((2, out.size), np.uint8)
        kernels.pack_fields((2 * totals >= p).astype(np.int8), 1, 0, out=votes[0])
        kernels.pack_fields((2 * totals > p).astype(np.int8), 1, 0, out=votes[1])
        kernels.majority(votes, totals.size, self.tie, first + self.tie_call, out=out)

    def _encode_values(self, x: Array, out: Array) -> None:
        kernels.pack_signs(x, out=out)

    def _decode_values(self, packed: Array, dst: Array) -> None:
        kernels.unpack_signs(packed, dst.size, out=dst, dtype=dst.dtype)

    def _local_values(self, x: Array, out: Array) -> None:
        kernels.unpack_signs(kernels.pack_signs(x), x.size, out=out, dtype=out.dtype)


@dataclass(frozen=True)
class SumCodec(VoteCodec):
    """Integers in ``[-levels, levels]`` in ``w_in``-bit fields biased by ``levels``; the
    result is their exact sum."""

    def _encode_values(self, x: Array, out: Array) -> None:
        # The range [-levels, levels] is checked in the packing pass (a value outside it
        # raises UsageError naming the element), not by a pass of its own.
        try:
            kernels.pack_fields(x, self.w_in, self.bias_in, out=out,
                                valid=(-self.levels, self.levels))
        except UsageError as exc:
            assert exc.index is not None
            raise UsageError(f"value {int(x[exc.index])} at index {exc.index} of q is "
                             f"outside [-{self.levels}, {self.levels}]", argument="q",
                             index=exc.index) from None


@dataclass(frozen=True)
class TernarySumCodec(SumCodec):
    """Float values as ternary signs ``sign(x)`` in {-1, 0, 1} (2-bit fields, ``levels`` 1);
    the result is the exact sum of the signs."""

    def _encode_values(self, x: Array, out: Array) -> None:
        kernels.pack_ternary(x, out=out)

    def _local_values(self, x: Array, out: Array) -> None:
        kernels.unpack_fields(kernels.pack_ternary(x), x.size, 2, 1, out=out, dtype=out.dtype)


SUM_SIGN_WIDE_MAX: Final = 1 << 22
"""Most elements a sum-sign codec aggregates in one pass when its contributions are wider
than 2 bits (:meth:`_SignOfSum.combine`). Alone on one core the one pass in 16-bit lanes
takes what the four passes take up to 4M elements and 1.14x at 6.6M (6-bit fields, 4 rows);
in a collective of 4 ranks on 2 cores it takes 15-25% less CPU (``results/sum_sign/``).
2-bit fields (8-bit lanes) take the one pass at any length: 4-10x faster."""


class _SignOfSum(VoteCodec):
    """The exact sum's sign in {-1, 0, 1} as the result: the owner sums exactly, then sends
    only ``sign(sum)`` back, in 2-bit fields biased by 1 (instead of the sum's
    ``ceil(log2(2 levels size + 1))`` bits). Mixed in before a sum codec."""

    @property
    def w_out(self) -> int:
        return 2

    @property
    def bias_out(self) -> int:
        return 1

    def combine(self, rows: Array, n: int, first: int, out: Array,
                work: Array | None = None) -> None:
        """As :meth:`VoteCodec.combine`, in one pass over the rows
        (:func:`bitcoll.kernels.sum_sign_fields`: no int32 sums) where that kernel works in
        64-bit words (``rows * (2**w_in - 1)`` below
        :data:`~bitcoll.kernels.SUM_SIGN_WORDS_LIMIT`; wider than 2 bits, for at most
        :data:`SUM_SIGN_WIDE_MAX` elements), ``rows`` is C-contiguous with exactly the packed
        bytes of ``n`` elements per row and ``out`` holds exactly ``n`` 2-bit fields; the
        same bytes as :meth:`totals` then :meth:`finish`."""
        if rows.ndim == 2 and (self.w_in == 2 or n <= SUM_SIGN_WIDE_MAX) and \
                rows.shape[0] * ((1 << self.w_in) - 1) < kernels.SUM_SIGN_WORDS_LIMIT and \
                rows.flags.c_contiguous and \
                rows.shape[1] == kernels.packed_nbytes(n, self.w_in) and out.ndim == 1 and \
                out.size == kernels.packed_nbytes(n, 2) and out.flags.c_contiguous:
            kernels.sum_sign_fields(rows, n, self.w_in, self.bias_in, out=out)
            return
        super().combine(rows, n, first, out, work)

    def finish(self, totals: Array, first: int, out: Array) -> None:
        # In place: the totals are the caller's work (no new array, no fresh pages).
        kernels.pack_fields(np.sign(totals, out=totals), 2, 1, out=out)


@dataclass(frozen=True)
class SumSignCodec(_SignOfSum, SumCodec):
    """Integers in ``[-levels, levels]`` (as :class:`SumCodec`); the result is the sign of
    their exact sum."""

    def _local_values(self, x: Array, out: Array) -> None:
        np.sign(x, out=out, casting="unsafe")


@dataclass(frozen=True)
class TernarySumSignCodec(_SignOfSum, TernarySumCodec):
    """Float values as ternary signs (as :class:`TernarySumCodec`); the result is the sign of
    the exact sum of the signs."""


#: The codec class of each (operation, source of the contributions): "majority" (the
#: majority bit of 1-bit votes), "sum" (the exact sum) and "sign" (the exact sum's sign).
CODECS: Final[dict[tuple[str, str], type[VoteCodec]]] = {
    ("majority", "sign"): MajorityCodec,
    ("sum", "sign"): TernarySumCodec,
    ("sum", "int"): SumCodec,
    ("sign", "sign"): TernarySumSignCodec,
    ("sign", "int"): SumSignCodec,
}


def make_codec(kind: str, source: str, levels: int, size: int, tie: int = kernels.TIE_ALTERNATE,
               tie_call: int = 0, packed_io: bool = False) -> VoteCodec:
    """The codec of a packed collective: ``kind`` "majority", "sum" or "sign" (of the sum) of
    contributions from ``source`` "sign" (float votes) or "int" (integers in
    ``[-levels, levels]``); ``packed_io``:
    input and output are packed streams. KeyError for a pair :data:`CODECS` lacks (the
    communicator validates ``kind`` first)."""
    return CODECS[kind, source](1 if source == "sign" else levels, size, tie, tie_call,
                                packed_io, packed_io)
