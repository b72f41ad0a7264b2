"""The all-gather algorithm (what Distributed Lion does): every rank gathers every rank's
packed contribution and aggregates all ``p`` contributions locally.

1. **Pack** this rank's contribution (``w_in`` bits per element) into row 0 of its rows.
2. **Gather** the rows by Bruck's all-gather: in round ``k`` (``d = 2**k``) rank ``r``
   sends its first ``c = min(d, p - d)`` rows, one contiguous frame, to rank ``r - d`` and
   receives rows ``d .. d + c`` from rank ``r + d`` (mod ``p``). After ``ceil(log2 p)``
   rounds row ``i`` holds rank ``(r + i) mod p``'s contribution: a rotation, which neither a
   vote count nor an exact sum can tell from rank order, so the rows are never reordered.
3. **Aggregate** the ``p`` rows of the elements this rank returns (all of them for an
   all-reduce, block ``rank`` for a reduce-scatter) and decode the result.

Each rank sends ``(p - 1) * ceil(n * w_in / 8)`` bytes in ``ceil(log2 p)`` messages: the bytes
grow with ``p`` and nothing is pipelined, so large vectors take the direct exchange
(:mod:`~bitcoll.algorithms.sign_allreduce_direct`). What it buys is latency: the rounds of a
dense recursive-doubling all-reduce (fewer where ``p`` is not a power of two) and one pass of
each kernel, the cheapest packed collective for small vectors (the cost model's choice there,
:mod:`bitcoll.plan`). Kept also as the benchmark baseline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .. import kernels
from ..partition import block
from ..transport.base import Request
from .context import OpContext, Slot
from .votes import VoteCodec

__all__ = ["PreparedMajority", "packed_allgather"]

Array = npt.NDArray[Any]


def packed_allgather(ctx: OpContext, codec: VoteCodec, x: Array, out: Array,
                     gather: bool, n: int | None = None) -> None:
    """Same contract as :func:`~bitcoll.algorithms.sign_allreduce_direct.packed_direct`."""
    p, r = ctx.size, ctx.rank
    n = x.size if n is None else n
    w_in, w_out = codec.w_in, codec.w_out
    nb = (n * w_in + 7) // 8
    lo, hi = (0, n) if gather else block(n, p, r)
    start = lo - lo % 8  # aggregate from a byte boundary, then drop the leading elements
    m = hi - start
    mb = (m * w_out + 7) // 8
    work = ctx.scratch(Slot.GATHER_WORK, p * nb + mb, np.dtype(np.uint8))
    rows = work[:p * nb].reshape(p, nb)
    res = work[p * nb:]
    codec.encode(x, 0, n, rows[0])
    sends = _gather_rows(ctx, rows)
    if start == 0 and hi == n:
        sub = rows
    else:
        sub = np.ascontiguousarray(rows[:, start * w_in // 8:(hi * w_in + 7) // 8])
    codec.combine(sub, m, start, res)
    if lo > start:  # drop the leading elements: move the rest to bit 0
        res = kernels.extract_bits(res, (lo - start) * w_out, (hi - lo) * w_out)
    codec.decode(res, out, 0, hi - lo)
    ctx.wait(*sends)


def _gather_rows(ctx: OpContext, rows: Array) -> list[Request]:
    """Bruck's all-gather of row 0 of ``rows`` (``uint8[p, nbytes]``): afterwards ``rows[i]``
    holds rank ``(r + i) mod p``'s row. Returns the sends, still to be waited for."""
    p, r = ctx.size, ctx.rank
    sends = []
    d = 1
    while d < p:
        cnt = min(d, p - d)
        req = ctx.irecv((r + d) % p, rows[d:d + cnt])
        sends.append(ctx.isend((r - d) % p, rows[:cnt]))
        ctx.wait(req)
        d *= 2
    return sends


class PreparedMajority:
    """:func:`packed_allgather` for the majority all-reduce of one shape (``n`` float votes
    of ``in_dtype`` on ``p`` ranks, ``+1``/``-1`` of ``out_dtype`` on every rank,
    ``n < kernels.PARALLEL_MIN_ELEMENTS``), its kernels prepared once
    (:class:`bitcoll.kernels.SignVotes`): the same frames and results, minus the per-call
    argument checks of the codec's kernels (the communicator's cached plan of small sign
    all-reduces; it has checked the arrays it passes). Same call as :func:`packed_allgather`
    with a :class:`~bitcoll.algorithms.votes.MajorityCodec` of values and ``gather`` true;
    raises like it (UsageError naming the first NaN)."""

    __slots__ = ("_votes",)

    def __init__(self, p: int, n: int, in_dtype: np.dtype[Any], out_dtype: np.dtype[Any]
                 ) -> None:
        self._votes = kernels.SignVotes(n, in_dtype, p, out_dtype)

    def __call__(self, ctx: OpContext, codec: VoteCodec, x: Array, out: Array, gather: bool,
                 n: int | None = None) -> None:
        votes = self._votes
        p, nb = votes.p, votes.nbytes
        work = ctx.scratch(Slot.GATHER_WORK, (p + 1) * nb, _U8)
        rows = work[:p * nb].reshape(p, nb)
        votes.pack(x, rows[0])
        sends = _gather_rows(ctx, rows)
        votes.decide(rows, codec.tie, codec.tie_call, work[p * nb:], out)
        ctx.wait(*sends)


_U8 = np.dtype(np.uint8)
