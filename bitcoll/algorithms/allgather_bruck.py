"""Bruck all-gather: the latency-oriented all-gather of equal blocks, ``ceil(log2 p)`` rounds.

Round ``k`` (``d = 2^k``): every rank sends the ``min(d, p - d)`` blocks it holds to the rank
``d`` below it and receives as many from the rank ``d`` above it, so after the round it holds
the blocks of ranks ``r, r+1, ..., r+2d-1`` (mod ``p``). Each rank sends ``(p - 1)`` blocks in
all, as in the ring, but in ``ceil(log2 p)`` rounds instead of ``p - 1`` steps: the cheaper
choice while the per-message cost outweighs the wire (small blocks).

The blocks go straight from and into the output, with no work buffer and no final rotation:
a round's blocks are ranks ``[s, s + c)`` mod ``p``, which is one range of the output, or
two where it wraps past rank ``p - 1``; sender and receiver name the same ranks, so they cut
the same frames. When ``p`` is a power of two the rounds run in recursive-doubling order
instead (partner ``r xor d``; the same rounds and bytes): a rank's blocks are then one
aligned range, one frame per round, and only the last round crosses between the two halves
of the ranks (on hosts of consecutive ranks, fewer bytes across hosts).
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from .context import OpContext

__all__ = ["allgather_bruck"]


def _ranges(first: int, count: int, p: int) -> list[tuple[int, int]]:
    """The ranks ``first, first+1, ..., first+count-1`` (mod ``p``) as one or two ranges of
    rank numbers, in that order."""
    stop = first + count
    if stop <= p:
        return [(first, stop)]
    return [(first, p), (0, stop - p)]


def allgather_bruck(ctx: OpContext, out: npt.NDArray[Any], block: int) -> None:
    """``out`` (1-D, C-contiguous, ``size * block`` elements) holds this rank's block at
    ``[rank * block, (rank + 1) * block)`` on entry and every rank's block, in rank order, on
    exit. Every rank sends one or two frames per round (empty blocks included)."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    d = 1
    if p & (p - 1) == 0:
        while d < p:
            peer = r ^ d
            mine = (r & ~(d - 1)) * block  # the aligned range of d blocks this rank holds
            theirs = (peer & ~(d - 1)) * block
            send = ctx.isend(peer, out[mine:mine + d * block])
            ctx.wait(ctx.irecv(peer, out[theirs:theirs + d * block]), send)
            d <<= 1
        return
    while d < p:
        count = min(d, p - d)
        src, dst = (r + d) % p, (r - d) % p
        sends = [ctx.isend(dst, out[a * block:z * block]) for a, z in _ranges(r, count, p)]
        ctx.wait(*[ctx.irecv(src, out[a * block:z * block]) for a, z in _ranges(src, count, p)])
        ctx.wait(*sends)
        d <<= 1
