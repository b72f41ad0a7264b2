"""Dissemination barrier: ``ceil(log2 p)`` rounds; in round ``k`` rank ``r`` sends an empty
frame to ``r + 2^k`` and waits for one from ``r - 2^k``. No rank leaves before every rank has
entered."""

from __future__ import annotations

import numpy as np

from .context import OpContext

__all__ = ["barrier_dissemination"]

_EMPTY = np.empty(0, dtype=np.uint8)


def barrier_dissemination(ctx: OpContext) -> None:
    """Block until every rank has entered the barrier."""
    p, r = ctx.size, ctx.rank
    dist = 1
    while dist < p:
        recv = ctx.irecv((r - dist) % p, np.empty(0, dtype=np.uint8))
        send = ctx.isend((r + dist) % p, _EMPTY)
        ctx.wait(recv, send)
        dist <<= 1
