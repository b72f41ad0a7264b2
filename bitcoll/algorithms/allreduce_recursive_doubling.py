"""Recursive-doubling all-reduce: the latency-oriented algorithm for small vectors.

With ``q`` the largest power of two ``<= p`` and ``e = p - q`` extra ranks:

1. Fold: among the first ``2 e`` ranks, each even rank sends its vector to the odd rank above
   it and waits; the odd rank reduces. ``q`` active ranks remain.
2. ``log2 q`` exchange rounds: in round ``k`` active rank ``i`` swaps its partial result with
   active rank ``i xor 2^k`` and reduces (``op(a, b) == op(b, a)`` bit for bit for every op, so
   both partners hold identical bits).
3. Unfold: each odd rank of the fold sends the result back to its even partner.

Sends ``(log2 q + 2)`` whole vectors at most per rank: cheap for small vectors only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..ops import ReduceOp, reduce_into
from .context import OpContext

__all__ = ["allreduce_recursive_doubling"]


def allreduce_recursive_doubling(ctx: OpContext, work: npt.NDArray[Any], op: ReduceOp) -> None:
    """In place on ``work`` (this rank's input on entry, the reduction on exit)."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return  # the sum, max, min and average of one vector are the vector itself
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    tmp = np.empty_like(work)
    # 1. fold
    if r < 2 * extra:
        if r % 2 == 0:
            ctx.wait(ctx.isend(r + 1, work))
            ctx.wait(ctx.irecv(r + 1, work))
            return
        ctx.wait(ctx.irecv(r - 1, tmp))
        reduce_into(work, work, tmp, op)
        vrank = r // 2
    else:
        vrank = r - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    # 2. exchange rounds
    mask = 1
    while mask < q:
        peer = real(vrank ^ mask)
        recv = ctx.irecv(peer, tmp)
        send = ctx.isend(peer, work)
        ctx.wait(recv, send)
        reduce_into(work, work, tmp, op)
        mask <<= 1
    if op is ReduceOp.AVG:
        np.divide(work, np.asarray(p, dtype=work.dtype), out=work)
    # 3. unfold
    if r < 2 * extra:
        ctx.wait(ctx.isend(r - 1, work))
