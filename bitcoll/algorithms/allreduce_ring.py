"""Ring all-reduce: a reducing ring pass (reduce-scatter) then an all-gather ring pass.

1. ``work`` is the output buffer; this rank's input is read from ``src`` (``work`` itself for
   an in-place call: no copy of the input is made either way).
2. Reduce-scatter pass (``b0 = r - 1``, ``p - 1`` steps): rank ``r`` ends up owning the fully
   reduced block ``r`` of :func:`bitcoll.partition`.
3. For ``avg`` the owner divides its block by ``p`` once, so every rank receives the same bits.
4. All-gather pass (``b0 = r``, ``p - 1`` steps): every block travels from its owner round the
   ring.

Bandwidth-optimal: each rank sends ``2 (p - 1) / p`` of the vector plus one header per segment.
Every rank's result is bitwise identical (each block is reduced once, at its owner).

Where the context streams (:func:`~bitcoll.algorithms.ring.stream_passes`: the TCP transport,
an op and dtype its native fold computes exactly), each pass, or both back to back, goes to
the transport as one schedule of the same frames.

:func:`allreduce_ring_narrowed` reduces in a wider type and rounds once: the reduce-scatter
pass runs on the widened vector, each owner narrows its finished block, and the all-gather pass
moves the narrow type (bfloat16 reduced in float32: 1.5x the bfloat16 bytes instead of 2x).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..ops import ReduceOp, reduce_into
from ..partition import block_bounds
from .context import OpContext
from .ring import ring_pass, stream_passes, stream_reduce_scatter

__all__ = ["allreduce_ring", "allreduce_ring_narrowed", "reduce_scatter_ring"]


def _reducer(op: ReduceOp) -> Any:
    def reduce(out: npt.NDArray[Any], local: npt.NDArray[Any],
               incoming: npt.NDArray[Any]) -> None:
        reduce_into(out, local, incoming, op)
    return reduce


def reduce_scatter_ring(ctx: OpContext, work: npt.NDArray[Any], op: ReduceOp,
                        src: npt.NDArray[Any] | None = None) -> None:
    """Reduce every rank's ``src`` (default ``work``, i.e. in place) into ``work`` (same size
    and dtype): afterwards block ``r`` of ``work`` holds the reduction over ranks (divided by
    ``p`` for avg); other blocks hold partial values (block ``r - 1`` is not written when
    ``src`` is separate)."""
    p, r = ctx.size, ctx.rank
    bounds = block_bounds(work.size, p)
    if p == 1:
        if src is not None and src is not work:
            np.copyto(work, src)
        return
    if stream_reduce_scatter(ctx, work, bounds, op, src):
        return  # avg divided at the owner by the stream
    ring_pass(ctx, work, bounds, b0=r - 1, steps=p - 1, reduce=_reducer(op), src=src)
    if op is ReduceOp.AVG:
        own = work[bounds[r]:bounds[r + 1]]
        np.divide(own, np.asarray(p, dtype=work.dtype), out=own)


def allreduce_ring(ctx: OpContext, work: npt.NDArray[Any], op: ReduceOp,
                   src: npt.NDArray[Any] | None = None) -> None:
    """The reduction over ranks of every rank's ``src`` (default ``work``: in place) lands in
    ``work`` (1-D, C-contiguous, same size and dtype; must not overlap a separate ``src``)."""
    p, r = ctx.size, ctx.rank
    bounds = block_bounds(work.size, p)
    if stream_passes(ctx, work, bounds, op, src):
        return
    reduce_scatter_ring(ctx, work, op, src)
    if not stream_passes(ctx, work, bounds, None):
        ring_pass(ctx, work, bounds, b0=r, steps=p - 1, reduce=None)


def allreduce_ring_narrowed(ctx: OpContext, wide: npt.NDArray[Any], op: ReduceOp,
                            out: npt.NDArray[Any],
                            narrow: Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]
                            ) -> None:
    """All-reduce in a wide type, all-gather in a narrow one. ``wide`` (1-D, C-contiguous)
    holds this rank's contribution converted to the wide type and is used as work space;
    afterwards ``out`` (1-D, C-contiguous, as many elements, the narrow type) holds
    ``narrow(reduction)`` on every rank, bitwise identical: ``narrow(src, dst)`` converts
    once, at each block's owner."""
    p, r = ctx.size, ctx.rank
    reduce_scatter_ring(ctx, wide, op)
    bounds = block_bounds(wide.size, p)
    lo, hi = int(bounds[r]), int(bounds[r + 1])
    narrow(wide[lo:hi], out[lo:hi])
    if not stream_passes(ctx, out, bounds, None):
        ring_pass(ctx, out, bounds, b0=r, steps=p - 1, reduce=None)
