"""Packed-bit all-reduce / reduce-scatter on a ring that forwards partial counts.

1. Reduce-scatter ring, ``p - 1`` steps: at step ``s`` rank ``r`` sends the partial
   aggregate of block ``(r - s - 1) mod p`` (``s + 1`` contributions) to ``r + 1`` and
   receives block ``(r - s - 2) mod p`` from ``r - 1``, to which it adds its own contribution.
   Partial aggregates are packed with the minimal width for their range, so the words grow
   each hop: ``ceil(log2(s + 2))`` bits for vote counts, ``ceil(log2(2 L (s + 1) + 1))`` for
   sums. Step 0 sends the contribution itself (the codec's input width).
2. The owner of block ``r`` adds its own contribution last and packs the final result
   (majority bit or exact sum, the codec's output width).
3. All-reduce only: a ring all-gather of the packed results (byte blocks).

Fewer messages in flight than the direct exchange (one per step), so it suits small,
latency-bound vectors; for large ones the growing words cost more bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import kernels
from ..partition import block_bounds
from .context import OpContext
from .ring import ring_pass
from .votes import VoteCodec

__all__ = ["packed_ring"]

Array = npt.NDArray[Any]


def _encoded(codec: VoteCodec, x: Array, bounds: Sequence[int]) -> list[Array]:
    """This rank's contribution to every block, packed at the codec's input width. All of
    it is encoded before the first send: a NaN raises while no peer can have completed (a
    reduce-scatter's right neighbour is done with this rank's second-last message)."""
    out = []
    for j in range(len(bounds) - 1):
        packed = np.empty(kernels.packed_nbytes(bounds[j + 1] - bounds[j], codec.w_in),
                          np.uint8)
        codec.encode(x, bounds[j], bounds[j + 1], packed)
        out.append(packed)
    return out


def _own(codec: VoteCodec, packed: Array, m: int) -> Array:
    """The ``m`` elements of a block's packed contribution as integers: vote bit (majority)
    or field value (sums)."""
    return kernels.unpack_fields(packed, m, codec.w_in, codec.bias_in, dtype=np.int32)


def packed_ring(ctx: OpContext, codec: VoteCodec, x: Array, out: Array, gather: bool,
                n: int | None = None) -> None:
    """Same contract as :func:`~bitcoll.algorithms.sign_allreduce_direct.packed_direct`."""
    p, r = ctx.size, ctx.rank
    n = x.size if n is None else n
    bounds = block_bounds(n, p)
    right, left = (r + 1) % p, (r - 1) % p
    acc: Array | None = None
    mine = _encoded(codec, x, bounds)
    if p > 1:
        pending = ctx.isend(right, mine[(r - 1) % p])
        for s in range(p - 1):
            rb = (r - s - 2) % p
            m = bounds[rb + 1] - bounds[rb]
            w, bs = codec.count_field(s + 1)
            incoming = np.empty(kernels.packed_nbytes(m, w), np.uint8)
            ctx.wait(ctx.irecv(left, incoming))
            acc = kernels.unpack_fields(incoming, m, w, bs, dtype=np.int32)
            acc += _own(codec, mine[rb], m)
            if s + 1 < p - 1:
                nxt = kernels.pack_fields(acc, *codec.count_field(s + 2))
                ctx.wait(pending)
                pending = ctx.isend(right, nxt)
        ctx.wait(pending)
    else:
        acc = _own(codec, mine[0], n)
    assert acc is not None
    m = bounds[r + 1] - bounds[r]
    result = np.empty(kernels.packed_nbytes(m, codec.w_out), np.uint8)
    codec.finish(acc, int(bounds[r]), result)
    if not gather:
        codec.decode(result, out, 0, m)
        return
    nbytes = [kernels.packed_nbytes(bounds[j + 1] - bounds[j], codec.w_out) for j in range(p)]
    offs = [0]
    for b in nbytes:
        offs.append(offs[-1] + b)
    allres = np.empty(offs[-1], np.uint8)
    allres[offs[r]:offs[r + 1]] = result
    ring_pass(ctx, allres, offs, b0=r, steps=p - 1, reduce=None)
    for j in range(p):
        codec.decode(allres[offs[j]:offs[j + 1]], out, bounds[j], bounds[j + 1])
