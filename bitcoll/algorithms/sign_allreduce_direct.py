"""Bandwidth-optimal packed-bit all-reduce / reduce-scatter by direct exchange, pipelined.

The vector is cut into ``p`` blocks by :func:`bitcoll.partition` (rank ``r`` owns block ``r``)
and every block into ``K`` segments of ``seg`` elements (a multiple of 8, so packed segments
are byte-aligned; short blocks have empty trailing segments, which still move a header so that
every rank sees every frame). For each segment ``k``:

1. **Reduce-scatter by direct exchange.** Each rank packs segment ``k`` of every block ``j``
   with the codec's input width and sends it straight to ``j`` (``p - 1`` messages in flight).
2. **Aggregation at the owner.** Rank ``r`` now holds ``p`` packed rows for its segment and
   combines them: majority bit or exact sum, packed with the output width. The aggregation
   happens inside the collective, at the owner; nothing else is gathered anywhere.
3. **All-gather of the result** (all-reduce only): the owner sends its packed result to every
   peer; each rank decodes the results into the output.

Pipelining: step 1 of segment ``k + 1`` is packed and sent before segment ``k`` is combined
(two segments' rows are alive at a time, in two reused scratch buffers),
so packing, counting and decoding (numba kernels that release the GIL) overlap the transport
threads moving the previous segment's frames. Every rank issues sends and posts receives in
the same order (P1(0), P1(1), P2(0), P1(2), P2(1), ...), which pairs frames per peer.

Bytes sent per rank for majority: ``sum_{j != r} ceil(len_j / 8)`` in step 1 and
``(p - 1) ceil(len_r / 8)`` in step 3, about ``2 (p - 1) / p * n / 8``, plus one header per
segment and peer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..partition import block_bounds
from ..transport.base import Request
from .context import OpContext, Slot
from .votes import VoteCodec

__all__ = ["packed_direct", "segment_elements"]

Array = npt.NDArray[Any]


def segment_elements(segment_bytes: int, width: int) -> int:
    """Elements per segment for a packed width: about ``segment_bytes`` on the wire, a
    multiple of 64 elements."""
    return max(64, (segment_bytes * 8 // max(1, width)) // 64 * 64)


def _split(buf: Array, sizes: list[int]) -> list[Array]:
    """Consecutive slices of ``buf`` with the given sizes."""
    offs = np.cumsum([0, *sizes])
    return [buf[int(offs[j]):int(offs[j + 1])] for j in range(len(sizes))]


def _bytes(lo: int, hi: int, width: int) -> tuple[int, int]:
    return -(-lo * width // 8), -(-hi * width // 8)


def packed_direct(ctx: OpContext, codec: VoteCodec, x: Array, out: Array,
                  gather: bool, n: int | None = None) -> None:
    """Run the packed collective on ``x`` (this rank's full input, 1-D) of ``n`` elements
    (default ``x.size``; a packed input holds them as a bit stream).

    ``gather=True``: all-reduce, ``out`` has the ``n`` elements. ``gather=False``:
    reduce-scatter, ``out`` has the elements of block ``rank``. Inputs and outputs are
    addressed by element range through ``codec`` (values or packed streams).
    """
    p, r = ctx.size, ctx.rank
    n = x.size if n is None else n
    bounds = block_bounds(n, p)
    lens = [bounds[j + 1] - bounds[j] for j in range(p)]
    w_in, w_out = codec.w_in, codec.w_out
    seg = segment_elements(ctx.segment_bytes, max(w_in, w_out))
    nseg = max(1, -(-max(lens) // seg))
    out_base = 0 if gather else bounds[r]

    def local(j: int, k: int) -> tuple[int, int]:
        return min(k * seg, lens[j]), min((k + 1) * seg, lens[j])

    # Work buffers are the communicator's (reused across calls: no page faults per call).
    inlens = [-(-m * w_in // 8) for m in lens]
    contrib = _split(ctx.scratch(Slot.PACKED_CONTRIB, sum(inlens), np.dtype(np.uint8)),
                     inlens)
    outlens = [-(-lens[j] * w_out // 8) if gather or j == r else 0 for j in range(p)]
    result: list[Array | None] = [
        buf if gather or j == r else None
        for j, buf in enumerate(_split(ctx.scratch(Slot.PACKED_RESULT, sum(outlens),
                                                   np.dtype(np.uint8)),
                                       outlens))]
    peers = [(r + i) % p for i in range(1, p)]
    sends: list[Request] = []
    rows: dict[int, tuple[Array, list[Request]]] = {}
    gathering: dict[int, list[tuple[int, Request]]] = {}

    def phase1(k: int) -> None:
        lo, hi = local(r, k)
        b0, b1 = _bytes(lo, hi, w_in)
        rows_slot = (Slot.PACKED_ROWS_0, Slot.PACKED_ROWS_1)[k % 2]
        mine = ctx.scratch(rows_slot, p * (b1 - b0), np.dtype(np.uint8)).reshape(p, b1 - b0)
        rows[k] = (mine, [ctx.irecv(j, mine[j]) for j in peers])
        # A reduce-scatter's peer is done once it has its block's last segment: that
        # segment is sent only when this rank's whole input is encoded (a NaN raises
        # before any peer can complete). Elsewhere packing overlaps the sends.
        last = not gather and k == nseg - 1
        if last:
            codec.encode(x, bounds[r] + lo, bounds[r] + hi, mine[r])
        held: list[tuple[int, Array]] = []
        for j in peers:
            jlo, jhi = local(j, k)
            c0, c1 = _bytes(jlo, jhi, w_in)
            buf = contrib[j][c0:c1]
            codec.encode(x, bounds[j] + jlo, bounds[j] + jhi, buf)
            if last:
                held.append((j, buf))
            else:
                sends.append(ctx.isend(j, buf))
        sends.extend(ctx.isend(j, buf) for j, buf in held)
        if not last:
            codec.encode(x, bounds[r] + lo, bounds[r] + hi, mine[r])

    def phase2(k: int) -> None:
        mine, reqs = rows.pop(k)
        ctx.wait(*reqs)
        lo, hi = local(r, k)
        o0, o1 = _bytes(lo, hi, w_out)
        own = result[r]
        assert own is not None
        buf = own[o0:o1]
        work = None if codec.majority else \
            ctx.scratch(Slot.PACKED_TOTALS, hi - lo, np.dtype(np.int32))
        codec.combine(mine, hi - lo, bounds[r] + lo, buf, work)
        if gather:
            sends.extend(ctx.isend(j, buf) for j in peers)
            posted = []
            for j in peers:
                jres = result[j]
                assert jres is not None
                j0, j1 = _bytes(*local(j, k), w_out)
                posted.append((j, ctx.irecv(j, jres[j0:j1])))
            gathering[k] = posted
        start = bounds[r] + lo - out_base
        codec.decode(buf, out, start, start + hi - lo)

    def finish(k: int) -> None:
        for j, req in gathering.pop(k):
            ctx.wait(req)
            jlo, jhi = local(j, k)
            j0, j1 = _bytes(jlo, jhi, w_out)
            jres = result[j]
            assert jres is not None
            codec.decode(jres[j0:j1], out, bounds[j] + jlo, bounds[j] + jhi)

    phase1(0)
    for k in range(nseg):
        if k + 1 < nseg:
            phase1(k + 1)
        phase2(k)
        if gather and k >= 1:
            finish(k - 1)
    if gather:
        finish(nseg - 1)
    ctx.wait(*sends)
