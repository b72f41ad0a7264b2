"""Two-level collectives for hosts with several ranks: shared memory inside a host, the
network between hosts, every local rank on the network at once.

Slicing (:class:`HostPlan`): with ``G`` the largest number of ranks on one host, the vector
is cut into ``G`` *slices* whose bounds are multiples of 8 elements. On a host with ``g``
ranks, local rank ``j`` owns the slices ``s`` with ``s mod g == j`` (one slice each when every
host has ``G`` ranks; hosts with fewer ranks give some ranks several slices), so on every host
every slice has exactly one owner and the owners of slice ``s`` (one per host) form its
*cross group*, ordered by host.

Packed collectives (:func:`packed_hierarchical`), per segment of every slice:

1. **Reduce-scatter inside the host.** Every rank packs the segment with the codec's input
   width and sends it to the slice's owner on its host (shared memory); the owner counts its
   host's ``g`` votes per element (majority: the number of +1 votes, ``0..g``, as
   ``ceil(log2(g + 1))`` bit planes, plane ``j`` holding bit ``j`` of every element's count,
   counted bit-sliced 64 elements at a time; sums: the sum of the ``g`` values,
   ``[-g L, g L]``).
2. **Reduce-scatter between hosts.** The segment is cut into one *sub-block* per host (bounds
   multiples of 8 elements). The owner sends its host's counts of sub-block ``t`` at the
   minimal width (``ceil(log2(g + 1))`` bit planes for majority counts, fields of
   ``ceil(log2(2 g L + 1))`` bits for sums) to the slice's owner on host ``t`` (a direct
   exchange, bandwidth optimal); the owner on host ``t`` adds every host's counts: the exact
   count (or sum) over all ``p`` ranks (majority: the planes go straight into the bit-sliced
   majority kernel, :func:`bitcoll.kernels.majority_of_counts`, a plane of bit ``j`` counting
   ``2**j`` votes).
3. **Result and all-gather between hosts.** From the exact count the owner of a sub-block
   decides the majority bit with the flat algorithms' tie rule at the global element index
   (or packs the exact sum at the output width) and sends the packed sub-block to the other
   owners of the slice.
4. **All-gather inside the host.** The owner sends the packed slice segment (for a
   reduce-scatter only the part in the receiver's block) to the other ranks of its host;
   every rank decodes.

The result is the exact majority (or sum) over all ``p`` ranks' inputs, never a majority of
majorities: bit for bit the result of the flat direct exchange. Bytes each rank sends between
hosts per owned slice segment with sub-blocks ``m_t``: ``sum_{t != h} w_c ceil(m_t / 8)``
for majority planes or ``sum_{t != h} ceil(m_t w_c / 8)`` for sum fields (counts at its
host's width ``w_c``; the two differ only in the last sub-block's padding) plus
``(H - 1) ceil(m_h w_out / 8)`` (results), one 32-byte header per message: about
``(H - 1) / H * n / G * (w_c + w_out) / 8`` in all.

Pipelining: segments go through the four steps staggered (step 1 of segment ``k`` runs with
step 2 of segment ``k - 1``, ...), so packing, counting and the transfers of successive
segments overlap. Every wait is for frames sent in an earlier round of the schedule, and every
rank runs the same schedule, so frames pair up per peer in posting order.

Dense all-reduce (:func:`allreduce_hierarchical`): direct reduce-scatter of the slices inside
the host (the owner reduces its host's rows in local-rank order), ring all-reduce of each
slice in its cross group (:func:`~bitcoll.algorithms.allreduce_ring.allreduce_ring`), then
all-gather of the slices inside the host. Every slice is reduced once by the same ranks and
copied from there, so every rank gets the same bits; they differ from the flat ring's only by
the order of the floating-point additions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import kernels
from ..ops import ReduceOp, reduce_into
from ..partition import block_bounds
from ..transport.base import Request
from .allreduce_ring import allreduce_ring
from .context import GroupContext, OpContext, Slot
from .sign_allreduce_direct import segment_elements
from .votes import VoteCodec

__all__ = ["HostPlan", "allreduce_hierarchical", "packed_hierarchical"]

Array = npt.NDArray[Any]


def _aligned_bounds(lo: int, hi: int, parts: int) -> list[int]:
    """``[lo, hi)`` cut into ``parts`` consecutive pieces whose inner bounds are ``lo`` plus
    multiples of 8 (:func:`bitcoll.partition` of the 8-element groups)."""
    groups = block_bounds(-(-(hi - lo) // 8), parts)
    return [min(hi, lo + 8 * int(b)) for b in groups]


@dataclass(frozen=True)
class HostPlan:
    """The slices of an ``n``-element vector over the hosts ``hosts`` (``hosts[r]``: rank
    ``r``'s host, numbered from 0) and who owns them; the same on every rank."""

    hosts: tuple[int, ...]
    n: int

    @property
    def num_hosts(self) -> int:
        return max(self.hosts) + 1

    @property
    def members(self) -> list[list[int]]:
        """The ranks of every host, in rank order."""
        out: list[list[int]] = [[] for _ in range(self.num_hosts)]
        for r, h in enumerate(self.hosts):
            out[h].append(r)
        return out

    @property
    def slices(self) -> int:
        """``G``: the number of slices (the largest host's number of ranks)."""
        return max(len(m) for m in self.members)

    def slice_bounds(self) -> list[int]:
        return _aligned_bounds(0, self.n, self.slices)

    def owner(self, host: int, s: int) -> int:
        """The rank of ``host`` that owns slice ``s``."""
        m = self.members[host]
        return m[s % len(m)]

    def cross_group(self, s: int) -> list[int]:
        """The owners of slice ``s``, one per host, in host order."""
        return [self.owner(h, s) for h in range(self.num_hosts)]


def _same_host_peers(plan: HostPlan, rank: int) -> list[int]:
    return [q for q in plan.members[plan.hosts[rank]] if q != rank]


def packed_hierarchical(ctx: OpContext, codec: VoteCodec, x: Array, out: Array,
                        gather: bool, n: int | None = None, *,
                        hosts: Sequence[int]) -> None:
    """Same contract as :func:`~bitcoll.algorithms.sign_allreduce_direct.packed_direct`;
    ``hosts[r]`` is rank ``r``'s host (numbered from 0 in order of their lowest rank, the
    same list on every rank)."""
    p, r = ctx.size, ctx.rank
    n = x.size if n is None else n
    plan = HostPlan(tuple(int(h) for h in hosts), n)
    if len(plan.hosts) != p:
        raise ValueError(f"hosts has {len(plan.hosts)} entries for {p} ranks")
    members = plan.members
    H, G = plan.num_hosts, plan.slices
    me = plan.hosts[r]
    local = members[me]
    g = len(local)
    sb = plan.slice_bounds()
    mine = [s for s in range(G) if plan.owner(me, s) == r]
    w_in, w_out = codec.w_in, codec.w_out
    cw = [codec.count_field(len(members[t])) for t in range(H)]
    wc, bc = cw[me]
    seg = segment_elements(ctx.segment_bytes, max(w_in, w_out, max(w for w, _ in cw)))
    longest = max(sb[s + 1] - sb[s] for s in range(G))
    nseg = max(1, -(-longest // seg))
    # The sums of this rank's slices, for two segments in flight (reused across calls).
    counts_buf = None if codec.majority else ctx.scratch(
        Slot.HIER_COUNTS, 2 * len(mine) * min(seg, longest),
        np.dtype(np.int32)).reshape(2, len(mine), min(seg, longest))
    bounds = block_bounds(n, p)
    out_base = 0 if gather else int(bounds[r])

    def wanted(q: int) -> tuple[int, int]:
        """The elements rank ``q`` receives."""
        return (0, n) if gather else (int(bounds[q]), int(bounds[q + 1]))

    def span(s: int, k: int) -> tuple[int, int]:
        return min(sb[s] + k * seg, sb[s + 1]), min(sb[s] + (k + 1) * seg, sb[s + 1])

    def nbytes(m: int, w: int) -> int:
        return -(-m * w // 8)

    majority = codec.majority  # counts as bit planes, else sums as fields

    sends: list[Request] = []
    # Per (segment, owned slice): the state that travels from one step to the next.
    rows: dict[tuple[int, int], tuple[Array, list[Request]]] = {}
    counts: dict[tuple[int, int], tuple[Array, list[tuple[int, Array, Request]]]] = {}
    results: dict[tuple[int, int], tuple[Array, list[Request]]] = {}
    gathered: dict[int, list[tuple[int, int, Array, Request]]] = {}

    def step1(k: int) -> None:
        """Reduce-scatter inside the host: contributions to each slice's owner."""
        for s in range(G):
            a, b = span(s, k)
            o = plan.owner(me, s)
            if o == r:
                buf = np.empty((g, nbytes(b - a, w_in)), np.uint8)
                reqs = [ctx.irecv(q, buf[i]) for i, q in enumerate(local) if q != r]
                codec.encode(x, a, b, buf[local.index(r)])
                rows[k, s] = (buf, reqs)
            else:
                row = np.empty(nbytes(b - a, w_in), np.uint8)
                codec.encode(x, a, b, row)
                sends.append(ctx.isend(o, row))

    def step2(k: int) -> None:
        """Count the host's inputs; reduce-scatter of the counts between hosts."""
        for s in mine:
            buf, reqs = rows.pop((k, s))
            ctx.wait(*reqs)
            a, b = span(s, k)
            sub = _aligned_bounds(a, b, H)
            x0, x1 = sub[me], sub[me + 1]
            posted = []
            if majority:
                # Bit planes (plane j = bit j of every element's count), counted per
                # sub-block. One array holds every host's planes of this rank's sub-block:
                # its own rows first, then each other host's rows, where they land.
                stack = np.empty((sum(cw[t][0] for t in range(H)), nbytes(x1 - x0, 1)),
                                 np.uint8)
                first = wc  # host t's first row in stack
                for t in range(H):
                    if t != me:
                        land = stack[first:first + cw[t][0]]
                        first += cw[t][0]
                        posted.append((t, land, ctx.irecv(plan.owner(t, s), land)))
                # (Sub-block bounds are a + 8k, except that an empty one may start at b.)
                for t in range(H):
                    if t != me:
                        sends.append(ctx.isend(plan.owner(t, s), kernels.count_planes(
                            buf, sub[t + 1] - sub[t], wc, start=(sub[t] - a) // 8 * 8)))
                kernels.count_planes(buf, x1 - x0, wc, out=stack[:wc],
                                     start=(x0 - a) // 8 * 8)
                counts[k, s] = (stack, posted)
                continue
            for t in range(H):
                if t != me:
                    land = np.empty(nbytes(x1 - x0, cw[t][0]), np.uint8)  # w-bit fields
                    posted.append((t, land, ctx.irecv(plan.owner(t, s), land)))
            assert counts_buf is not None
            acc = codec.totals(buf, b - a, counts_buf[k % 2, mine.index(s), :b - a])
            packed = kernels.pack_fields(acc, wc, bc)
            for t in range(H):
                if t != me:
                    y0, y1 = sub[t], sub[t + 1]
                    sends.append(ctx.isend(plan.owner(t, s),
                                           packed[nbytes(y0 - a, wc):nbytes(y1 - a, wc)]))
            counts[k, s] = (acc[x0 - a:x1 - a], posted)

    def step3(k: int) -> None:
        """The exact totals of this rank's sub-block; all-gather of the results between
        hosts."""
        for s in mine:
            total, posted = counts.pop((k, s))
            a, b = span(s, k)
            sub = _aligned_bounds(a, b, H)
            m = sub[me + 1] - sub[me]
            res = np.empty(nbytes(b - a, w_out), np.uint8)
            pieces = [res[nbytes(sub[t] - a, w_out):nbytes(sub[t + 1] - a, w_out)]
                      for t in range(H)]
            reqs = [ctx.irecv(plan.owner(t, s), pieces[t]) for t in range(H) if t != me]
            own = pieces[me]
            if majority:
                # ``total``: this host's planes, then the other hosts' in the order posted.
                shifts = list(range(wc))
                for t, _, req in posted:
                    ctx.wait(req)
                    shifts.extend(range(cw[t][0]))
                kernels.majority_of_counts(total, shifts, p, m, codec.tie,
                                           sub[me] + codec.tie_call, out=own)
            else:
                for t, land, req in posted:
                    ctx.wait(req)
                    kernels.add_fields(land, total.size, cw[t][0], cw[t][1], total)
                codec.finish(total, sub[me], own)
            sends.extend(ctx.isend(plan.owner(t, s), own) for t in range(H) if t != me)
            results[k, s] = (res, reqs)

    def step4(k: int) -> None:
        """All-gather inside the host; decode this rank's own slices."""
        posted = []
        for s in range(G):
            a, b = span(s, k)
            o = plan.owner(me, s)
            if o == r:
                continue
            lo, hi = wanted(r)
            c0, c1 = max(a, lo), min(b, hi)
            if c0 < c1:
                land = np.empty(nbytes(c1 - c0, w_out), np.uint8)
                posted.append((c0, c1, land, ctx.irecv(o, land)))
        for s in mine:
            res, reqs = results.pop((k, s))
            ctx.wait(*reqs)
            a, b = span(s, k)
            for q in [*local[local.index(r):], *local[:local.index(r)]]:
                lo, hi = wanted(q)
                c0, c1 = max(a, lo), min(b, hi)
                if c0 >= c1:
                    continue
                part = res if (c0, c1) == (a, b) else \
                    kernels.extract_bits(res, (c0 - a) * w_out, (c1 - c0) * w_out)
                if q == r:
                    codec.decode(part, out, c0 - out_base, c1 - out_base)
                else:
                    sends.append(ctx.isend(q, part))
        gathered[k] = posted

    def step5(k: int) -> None:
        for c0, c1, land, req in gathered.pop(k):
            ctx.wait(req)
            codec.decode(land, out, c0 - out_base, c1 - out_base)

    stages: list[Callable[[int], None]] = [step1, step2, step3, step4, step5]
    for i in range(nseg + len(stages) - 1):
        for lag, stage in enumerate(stages):
            if 0 <= i - lag < nseg:
                stage(i - lag)
    ctx.wait(*sends)


def allreduce_hierarchical(ctx: OpContext, work: Array, op: ReduceOp, hosts: Sequence[int],
                           src: Array | None = None) -> None:
    """The reduction over ranks of every rank's ``src`` (default ``work``: in place) lands in
    ``work`` (1-D, C-contiguous, same size and dtype; not overlapping a separate ``src``),
    bitwise identical on every rank. ``hosts`` as in :func:`packed_hierarchical`. For avg
    the sum is divided by ``p`` on every rank (the same bits in, the same bits out)."""
    p, r = ctx.size, ctx.rank
    if src is None:
        src = work
    plan = HostPlan(tuple(int(h) for h in hosts), work.size)
    if len(plan.hosts) != p:
        raise ValueError(f"hosts has {len(plan.hosts)} entries for {p} ranks")
    me = plan.hosts[r]
    local = plan.members[me]
    G = plan.slices
    sb = plan.slice_bounds()
    mine = [s for s in range(G) if plan.owner(me, s) == r]
    cross_op = ReduceOp.SUM if op is ReduceOp.AVG else op
    peers = _same_host_peers(plan, r)
    itemsize = work.itemsize

    # 1. Reduce-scatter inside the host, segment by segment: rows land in one work buffer.
    sends = [ctx.isend(plan.owner(me, s), src[a:z])
             for s in range(G) if plan.owner(me, s) != r
             for a, z in ctx.segments(sb[s], sb[s + 1], itemsize)]
    for s in mine:
        for a, z in ctx.segments(sb[s], sb[s + 1], itemsize):
            land = ctx.scratch(Slot.HIER_LAND, max(1, len(peers)) * (z - a),
                               work.dtype).reshape(max(1, len(peers)), z - a)
            reqs = [ctx.irecv(q, land[i]) for i, q in enumerate(peers)]
            ctx.wait(*reqs)
            # The host's rows reduced in local-rank order: the same sum on any host layout.
            acc = ctx.scratch(Slot.HIER_WORK, z - a, work.dtype)
            for i, q in enumerate(local):
                row = src[a:z] if q == r else land[peers.index(q)]
                if i == 0:
                    np.copyto(acc, row)
                else:
                    reduce_into(acc, acc, row, cross_op)
            np.copyto(work[a:z], acc)
    ctx.wait(*sends)
    # 2. Ring all-reduce of each owned slice among its owners on every host.
    for s in mine:
        group = GroupContext(ctx, plan.cross_group(s))
        allreduce_ring(group, work[sb[s]:sb[s + 1]], cross_op)
    # 3. All-gather inside the host.
    gathers = [ctx.irecv(plan.owner(me, s), work[a:z])
               for s in range(G) if plan.owner(me, s) != r
               for a, z in ctx.segments(sb[s], sb[s + 1], itemsize)]
    for s in mine:
        for q in peers:
            gathers.extend(ctx.isend(q, work[a:z])
                           for a, z in ctx.segments(sb[s], sb[s + 1], itemsize))
    ctx.wait(*gathers)
    if op is ReduceOp.AVG:
        np.divide(work, np.asarray(p, dtype=work.dtype), out=work)
