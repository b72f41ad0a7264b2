"""Binomial-tree broadcast, segmented so that large vectors stream down the tree.

Relative rank ``v = (r - root) mod p``. Rank ``v`` receives from ``v - 2^k`` (``2^k`` the highest
set bit of ``v``) and forwards to ``v + 2^j`` for every ``2^j`` above its highest bit, each
segment as soon as it arrives. Depth ``ceil(log2 p)``.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from ..transport.base import Request
from .context import OpContext

__all__ = ["broadcast_tree"]


def broadcast_tree(ctx: OpContext, buf: npt.NDArray[Any], root: int) -> None:
    """In place: ``buf`` holds the root's data on exit on every rank."""
    p = ctx.size
    if p == 1:
        return
    v = (ctx.rank - root) % p
    high = 1 << (v.bit_length() - 1) if v else 0
    parent = (v - high + root) % p if v else None
    children = []
    mask = high << 1 if v else 1
    while v + mask < p:
        children.append((v + mask + root) % p)
        mask <<= 1
    segs = ctx.segments(0, buf.size, buf.itemsize)
    recvs = [ctx.irecv(parent, buf[a:z]) for a, z in segs] if parent is not None else []
    sends: list[Request] = []
    for i, (a, z) in enumerate(segs):
        if recvs:
            ctx.wait(recvs[i])
        sends.extend(ctx.isend(c, buf[a:z]) for c in children)
    ctx.wait(*sends)
