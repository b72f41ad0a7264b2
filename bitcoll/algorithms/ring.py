"""Segmented ring passes: the building block of the bandwidth-optimal dense collectives.

Vocabulary (as in gloo): the vector is cut into ``p`` *blocks* by :func:`bitcoll.partition`
(rank ``r`` owns block ``r``); a block is cut into *segments* of about ``segment_bytes``, the
unit on the wire. In a ring pass every rank sends to its right neighbour ``r + 1`` and
receives from its left neighbour ``r - 1``:

1. At step ``s`` rank ``r`` sends block ``(b0 - s) mod p`` and receives block
   ``(b0 - s - 1) mod p``, for ``s = 0 .. steps - 1``.
2. A received segment is reduced into the local block (reduce-scatter pass) or lands in it
   directly (all-gather pass); as soon as it is final it is forwarded, so segments stream
   through the ring and reduction overlaps the transfer of the following segments.
3. Receives are posted one step ahead (two scratch buffers alternate in a reducing pass), so
   the transport always has somewhere to put the next segment. Where the transport can hand
   a payload over piece by piece as it arrives (``consumes_on_receive``, TCP), a reducing pass
   combines each piece straight into the block instead: no landing buffer, and the received
   bytes are read while they are still in the CPU cache.

With ``b0 = r - 1`` and ``p - 1`` steps, a reducing pass leaves the fully reduced block ``r``
on rank ``r`` (a reduce-scatter in ``bitcoll.partition`` order); with ``b0 = r`` a non-reducing
pass completes an all-gather of blocks owned by their ranks. Bytes sent per rank:
``(p - 1) / p`` of the vector per pass, plus one header per segment.

Streamed (:func:`stream_passes`): where the context can run a whole schedule of frames in one
call (:meth:`OpContext.streams`, the TCP transport), a reduce-scatter pass, an all-gather pass
or the two back to back go to the transport as one schedule with exactly the frames of the
passes above, which it runs in native code on the calling thread. With both passes, the last
reduce-scatter step's segments, final at their owner, go out as the all-gather's first step as
soon as each is folded (there is no barrier between the passes).

Out of place without a copy: a reducing pass may read this rank's contribution from a separate
``src`` array. Step 0 sends block ``b0`` straight from ``src`` and every received segment is
combined as ``work = src op incoming``; with ``p - 1`` steps every block but ``b0`` is received
exactly once, so ``work`` never has to be initialised (block ``b0`` of ``work`` is left
unwritten; the all-gather pass of an all-reduce fills it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..kernels.stream import MODE_FOLD, MODE_FOLD_DIVIDE, MODE_LAND
from ..ops import ReduceOp
from ..transport.base import Consumer, Request
from .context import OpContext, Slot

__all__ = ["ring_pass", "stream_passes", "stream_reduce_scatter"]

Reducer = Callable[[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]], None]


def ring_pass(ctx: OpContext, work: npt.NDArray[Any],
              bounds: Sequence[int] | npt.NDArray[np.int64], b0: int,
              steps: int, reduce: Reducer | None, src: npt.NDArray[Any] | None = None) -> None:
    """Run one ring pass over ``work`` (1-D, C-contiguous) cut at ``bounds`` (p + 1 offsets).

    ``reduce(out, local, incoming)`` stores ``local op incoming`` into ``out`` (which may be
    ``local`` itself); None means received segments overwrite the local block (all-gather).
    ``src`` (reducing passes only; same shape and dtype as ``work``, not overlapping it unless
    it is ``work``): where this rank's own values are read; default ``work``. A separate
    ``src`` needs ``steps == p - 1`` (see the module docstring).
    """
    p, r = ctx.size, ctx.rank
    if p == 1 or steps == 0:
        return
    if src is None:
        src = work
    elif src is not work and (reduce is None or steps != p - 1):
        raise ValueError("a separate src needs a reducing pass of p - 1 steps")
    right, left = (r + 1) % p, (r - 1) % p
    itemsize = work.itemsize

    def segs(b: int) -> list[tuple[int, int]]:
        return ctx.segments(int(bounds[b]), int(bounds[b + 1]), itemsize)

    scratch: list[npt.NDArray[Any]] = []
    on_arrival = reduce is not None and ctx.consumes_on_receive
    if reduce is not None and not on_arrival:
        longest = max(int(bounds[i + 1] - bounds[i]) for i in range(p))
        scratch = [ctx.scratch(slot, longest, work.dtype)
                   for slot in (Slot.RING_LAND_0, Slot.RING_LAND_1)]

    def consumer(a: int) -> Consumer:
        """Fold received bytes ``[offset, offset + len(chunk))`` of the segment at ``a``."""
        assert reduce is not None

        def consume(offset: int, chunk: memoryview) -> None:
            incoming = np.frombuffer(chunk, dtype=work.dtype)
            i = a + offset // itemsize
            j = i + incoming.size
            reduce(work[i:j], src[i:j], incoming)
        return consume

    def post(s: int) -> list[tuple[Request, int, int, npt.NDArray[Any] | None]]:
        """Post the receives of step ``s``; return (request, start, stop, landing buffer or
        None when the segment is reduced on arrival)."""
        rb = (b0 - s - 1) % p
        base = int(bounds[rb])
        out: list[tuple[Request, int, int, npt.NDArray[Any] | None]] = []
        for a, z in segs(rb):
            if on_arrival:
                out.append((ctx.irecv_consume(left, (z - a) * itemsize, consumer(a)), a, z,
                            None))
                continue
            land = scratch[s % 2][a - base:z - base] if reduce is not None else work[a:z]
            out.append((ctx.irecv(left, land), a, z, land))
        return out

    sends: list[Request] = [ctx.isend(right, src[a:z]) for a, z in segs(b0 % p)]
    posted = post(0)
    for s in range(steps):
        nxt = post(s + 1) if s + 1 < steps else []
        for req, a, z, land in posted:
            ctx.wait(req)
            if reduce is not None and land is not None:
                reduce(work[a:z], src[a:z], land)
            if s + 1 < steps:
                sends.append(ctx.isend(right, work[a:z]))
        posted = nxt
    ctx.wait(*sends)


def stream_passes(ctx: OpContext, work: npt.NDArray[Any],
                  bounds: Sequence[int] | npt.NDArray[np.int64], op: ReduceOp | None,
                  src: npt.NDArray[Any] | None = None) -> bool:
    """Run ring passes over ``work`` (1-D, C-contiguous, cut at ``bounds``) as one stream
    when the context can; False (nothing done) otherwise, and the caller runs
    :func:`ring_pass` instead.

    ``op`` given: the reduce-scatter pass (``b0 = r - 1``, folding with ``op``, avg divided
    at the owner) then the all-gather pass (``b0 = r``), a whole ring all-reduce; None: the
    all-gather pass alone (moved as bytes, so any dtype). ``src`` as in :func:`ring_pass`.
    """
    return _stream(ctx, work, bounds, op, src, gather=True)


def stream_reduce_scatter(ctx: OpContext, work: npt.NDArray[Any],
                          bounds: Sequence[int] | npt.NDArray[np.int64], op: ReduceOp,
                          src: npt.NDArray[Any] | None = None) -> bool:
    """The reduce-scatter pass alone (avg divided at the owner), as one stream; False when the
    context cannot stream it (nothing done)."""
    return _stream(ctx, work, bounds, op, src, gather=False)


def _stream(ctx: OpContext, work: npt.NDArray[Any],
            bounds: Sequence[int] | npt.NDArray[np.int64], op: ReduceOp | None,
            src: npt.NDArray[Any] | None, gather: bool) -> bool:
    p, r = ctx.size, ctx.rank
    if p == 1:
        return False
    itemsize = work.itemsize
    scale = 1
    if op is None:  # all-gather only: move bytes (same frames: segments cut in elements)
        work = work.reshape(-1).view(np.uint8)
        scale = itemsize
    if not ctx.streams(work.dtype, ReduceOp.SUM if op is None else op):
        return False

    def segs(b: int) -> list[tuple[int, int]]:
        return [(a * scale, z * scale)
                for a, z in ctx.segments(int(bounds[b]), int(bounds[b + 1]), itemsize)]

    sends: list[tuple[int, int, bool, int]] = []
    recvs: list[tuple[int, int, int]] = []
    if op is not None:
        sends += [(a, z, True, -1) for a, z in segs((r - 1) % p)]
        last = MODE_FOLD_DIVIDE if op is ReduceOp.AVG else MODE_FOLD
        for s in range(p - 1):  # reduce-scatter step s: block r - 2 - s arrives
            for a, z in segs((r - 2 - s) % p):
                if s < p - 2 or gather:  # forwarded: the next step's, or the all-gather's
                    sends.append((a, z, False, len(recvs)))
                recvs.append((a, z, MODE_FOLD if s < p - 2 else last))
    else:
        sends += [(a, z, False, -1) for a, z in segs(r)]
    if gather:
        for t in range(p - 1):  # all-gather step t: block r - 1 - t arrives
            for a, z in segs((r - 1 - t) % p):
                if t < p - 2:
                    sends.append((a, z, False, len(recvs)))
                recvs.append((a, z, MODE_LAND))
    source = work if src is None or op is None else src
    return ctx.stream((r + 1) % p, (r - 1) % p, work, source,
                      ReduceOp.SUM if op is None else op, sends, recvs)
