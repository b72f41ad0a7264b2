"""Algorithm choice: a registry of algorithms with an alpha-beta cost model.

Every collective whose algorithm is left at "auto" asks :func:`choose` which registered
algorithm is cheapest for the call. The choice is a pure function of three values, so it is
the same on every rank that passes the same arguments and can be tested without ranks:

* a :class:`Group`: how many ranks, on how many hosts, how many per host, how many cores each
  rank has, whether the two-level algorithms are allowed;
* a :class:`Call`: the collective's size (bytes of a dense vector, or elements and field
  widths of a packed one);
* a :class:`CostModel`: the machine's parameters (latency and bandwidth of a message inside a
  host and across hosts, per-message CPU cost, per-core rates of packing, counting, decoding
  and reducing).

Cost formulas (seconds; ``p`` ranks, ``h`` hosts of ``l`` ranks, ``n`` bytes or elements,
``a`` the latency and ``B`` the bandwidth of the slowest link the algorithm crosses, ``o``
the CPU cost of one message, ``R`` a per-core rate; see ``docs/cost-model.md`` for their
derivation and the measurements beside them):

=======================================  ==========================================================
dense ``recursive_doubling``             ``k (a + o + n/B + n/R_reduce)``, ``k = log2 p'`` (+2 for
                                         ``p`` not a power of two, ``p'`` the power below)
dense ``ring``                           ``2(p-1)(a+o) + 2(p-1)/p n/B + (p-1)/p n/R_reduce``
dense ``hierarchical``                   local reduce-scatter + ring between hosts on ``n/l`` +
                                         local all-gather (each on its own link's ``a``, ``B``)
dense all-gather ``bruck``               ``k (a + o) + (p-1)/p n/B``, ``k = ceil(log2 p)``; where
                                         the ring's passes go frame by frame (not ``streams``)
dense all-gather ``ring``                ``(p-1)(a + o) + (p-1)/p n/B`` (``n`` the output)
dense reduce-scatter ``ring``            the all-gather's ring ``+ (p-1)/p n/R_reduce``
packed ``allgather``                     ``pack(n) + k (a+2o) + (p-1) n w_in/8/B + count(p, m) +
                                         decode(m)``, ``k = ceil(log2 p)`` rounds (Bruck),
                                         not pipelined
packed ``direct``                        ``K`` segments pipelined: ``2(a+o) + fill + (K-1)
                                         max(cpu/K, wire/K)``, ``cpu = pack(n) + count(p, n/p) +
                                         decode(m) + 2(p-1)K o``, ``wire = (p-1)/p n (w_in +
                                         w_out)/8/B``
packed ``ring``                          ``2(p-1)(a+o)`` + counts growing ``ceil(log2(s+2))`` bits
                                         per hop + all-gather of the results
packed ``hierarchical``                  votes counted inside each host (shared memory), counts
                                         of ``ceil(log2(l+1))`` bits exchanged between hosts
=======================================  ==========================================================

Every transfer across hosts takes the longer of its link time and the CPU that moving its
bytes costs the rank (``remote_cpu`` per byte sent or received, on the rank's share of a core);
in a pipeline that CPU joins the stages' other work. A ring moves its bytes across hosts on one
rank per host, the host's other ranks through shared memory, all on the host's cores
(:func:`_ring_moving`).

(``pack(n) = n / R_pack(n)`` on the rank's share of a core, the rate of an input that fits
the cache or of one streamed from memory (:func:`pack_rate_of`), ``count(r, m) = r m / R_count``,
``decode(m) = m / R_decode``; ``m`` the output's elements: ``n`` for an all-reduce, ``n/p``
for a reduce-scatter.)

The parameters: :data:`DEFAULT_MODEL` holds figures measured on the project's reference
machine; ``python -m bitcoll.probe`` (:mod:`bitcoll.probe`; under a launcher, ``python -m
launch -n 2 -m bitcoll.probe``, also the links between ranks) measures this machine and
caches the model in ``$BITCOLL_COST_MODEL`` (default ``~/.cache/bitcoll/cost_model.json``);
``bitcoll.init`` loads that file on rank 0 and gives rank 0's model to every rank, so the
ranks always agree on the choice. Every field can be overridden in that file or by
``BITCOLL_COST_<FIELD>`` in the environment (e.g. ``BITCOLL_COST_REMOTE_BANDWIDTH=1.25e8``
for 1 Gbit links).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from .errors import UsageError

__all__ = ["Group", "Call", "CostModel", "Algorithm", "REGISTRY", "DEFAULT_MODEL", "choose",
           "predict", "segment_for", "candidates", "group_of", "load_model", "model_path",
           "ENV_COST_MODEL", "SEGMENT_CHOICES", "DEFAULT_SEGMENT", "pack_rate_of",
           "PACK_CACHED_BYTES", "PACK_STREAMED_BYTES"]

#: Environment variable naming the cost model's cache file.
ENV_COST_MODEL: Final = "BITCOLL_COST_MODEL"
#: Prefix of the environment variables that override one field of the model each.
ENV_FIELD_PREFIX: Final = "BITCOLL_COST_"


@dataclass(frozen=True)
class Group:
    """The shape of a communicator, as the cost model sees it.

    ``size``: ranks; ``hosts``: hosts (1 when every rank runs on one host); ``per_host``: the
    largest number of ranks on one host; ``cores_per_rank``: the share of a core each rank
    can use for packing and reducing (1.0: a core of its own; 0.5: two ranks per core);
    ``two_level``: whether the two-level ("hierarchical") algorithms may be chosen;
    ``streams``: whether the transport runs a ring pass as one native stream
    (:meth:`~bitcoll.transport.base.Transport.stream`; else frame by frame)."""

    size: int
    hosts: int = 1
    per_host: int = 0
    cores_per_rank: float = 1.0
    two_level: bool = True
    streams: bool = False

    def __post_init__(self) -> None:
        if self.per_host == 0:
            object.__setattr__(self, "per_host", -(-self.size // max(1, self.hosts)))

    @property
    def layered(self) -> bool:
        """Whether the two-level algorithms apply: several hosts, some with several ranks."""
        return self.two_level and 1 < self.hosts < self.size


@dataclass(frozen=True)
class Call:
    """One collective call: ``nbytes`` of a dense vector, or ``count`` elements of a packed
    one with ``w_in``-bit votes and ``w_out``-bit results (``gather``: all-reduce, else
    reduce-scatter; ``packed_io``: the input is already packed, nothing to pack or decode);
    ``segment_bytes``: the pipelines' segment size, 0 for the planner's choice
    (:func:`segment_for`)."""

    nbytes: int = 0
    count: int = 0
    w_in: int = 1
    w_out: int = 1
    gather: bool = True
    packed_io: bool = False
    segment_bytes: int = 0


@dataclass(frozen=True)
class CostModel:
    """The machine's parameters (seconds, bytes per second, elements per second).

    Latencies are one-way times of a small message; bandwidths the rate one rank can send
    at on that path; ``message_cpu`` the CPU cost of handing one message to the transport and
    taking one from it; the rates are one core's; ``host_cores`` the cores of a host that
    its ranks share (:func:`group_of` divides them among the host's ranks);
    ``switch_latency`` what a wait adds when a host runs more ranks than it has cores (the
    peer that sends must first be scheduled), per other rank that shares the waiting rank's
    core (:meth:`switch_wait`); ``segment_cpu`` what each message of a
    pipeline's further segments costs a rank on top of ``message_cpu`` (the hand-offs to the
    transport's threads and the waits of one more pipeline stage, on the rank's core);
    ``remote_cpu`` the CPU seconds a rank spends per byte it sends or receives across hosts
    (the kernel's copies and protocol work, the frame checksum), on its share of a core:
    where a link is faster than that, the CPU and not the link sets a transfer's pace
    (:func:`_transfer`); ``pack_rate`` the packing rate of an input streamed from memory
    (:data:`PACK_STREAMED_BYTES` of float32 and more) and ``pack_rate_cached`` of one that
    fits a core's cache (:data:`PACK_CACHED_BYTES` and less), interpolated between
    (:func:`pack_rate_of`)."""

    local_latency: float = 25e-6
    local_bandwidth: float = 8.0e9
    remote_latency: float = 60e-6
    remote_bandwidth: float = 1.2e9
    message_cpu: float = 8e-6
    call_cpu: float = 15e-6
    pack_rate: float = 7.5e9
    count_rate: float = 3.0e10
    decode_rate: float = 2.5e10
    reduce_rate: float = 4.0e9
    repack_rate: float = 2.5e8
    host_cores: float = 1.0
    switch_latency: float = 150e-6
    segment_cpu: float = 100e-6
    remote_cpu: float = 3.5e-10
    pack_rate_cached: float = 1.5e10

    def as_array(self) -> npt.NDArray[np.float64]:
        """The fields in declaration order (to send to other ranks)."""
        return np.array(dataclasses.astuple(self), np.float64)

    @classmethod
    def from_array(cls, values: npt.NDArray[np.float64]) -> CostModel:
        """The inverse of :meth:`as_array`."""
        return cls(*(float(v) for v in values))

    def replace(self, **fields: float) -> CostModel:
        """A copy with some fields replaced (each checked like :meth:`from_mapping`)."""
        return dataclasses.replace(self, **_checked(fields))

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], base: CostModel | None = None
                     ) -> CostModel:
        """``base`` (default: the defaults) with the fields named in ``values``; UsageError
        for an unknown field or a value that is not a positive finite number."""
        return dataclasses.replace(base or cls(), **_checked(values))

    def switch_wait(self, group: Group | None) -> float:
        """What one wait for a peer adds on ``group`` when its hosts run more ranks than they
        have cores (0 otherwise): the peer must first be scheduled, behind the other ranks
        that share its core, ``switch_latency`` for each of them and at least one (a third
        of a core per rank: 2; a quarter: 3). Validated on 2 emulated hosts of 4 ranks on
        the 2-core VM, a quarter of a core each: with one ``switch_latency`` per wait the
        two-level algorithm was picked at 256 KiB-1 MiB where the all-gather of its 3
        rounds took 0.45-0.8x its time."""
        if group is None or group.cores_per_rank >= 1:
            return 0.0
        return self.switch_latency * max(1.0, 1.0 / group.cores_per_rank - 1.0)

    def link(self, remote: bool, group: Group | None = None) -> tuple[float, float]:
        """(latency, bandwidth) of a message inside a host or across hosts; on a ``group``
        whose hosts run more ranks than they have cores, the latency includes
        :meth:`switch_wait`."""
        extra = self.switch_wait(group)
        if remote:
            return self.remote_latency + extra, self.remote_bandwidth
        return self.local_latency + extra, self.local_bandwidth


_FIELDS: Final = tuple(f.name for f in dataclasses.fields(CostModel))


def _checked(values: Mapping[str, object]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in values.items():
        if name not in _FIELDS:
            raise UsageError(f"unknown cost model field {name!r}; expected one of "
                             f"{', '.join(_FIELDS)}", argument=name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 < value < math.inf:
            raise UsageError(f"cost model field {name} must be a positive finite number, got "
                             f"{value!r}", argument=name)
        out[name] = float(value)
    return out


#: Inputs of up to this many bytes (float32) are packed at ``pack_rate_cached``.
PACK_CACHED_BYTES: Final = 1 << 20
#: Inputs of at least this many bytes are packed at ``pack_rate``.
PACK_STREAMED_BYTES: Final = 64 << 20


def pack_rate_of(m: CostModel, count: float) -> float:
    """One core's rate of packing ``count`` votes of a float32 input: ``pack_rate_cached`` up
    to :data:`PACK_CACHED_BYTES`, ``pack_rate`` from :data:`PACK_STREAMED_BYTES`, and in
    between geometric in the size (straight on log-log axes; the reference machine packed
    1 MiB at 15e9 elements/s, 16 MiB at 6.4e9 and 64 MiB at 3.2e9)."""
    nbytes = 4 * count
    if nbytes <= PACK_CACHED_BYTES:
        return m.pack_rate_cached
    if nbytes >= PACK_STREAMED_BYTES:
        return m.pack_rate
    t = math.log(nbytes / PACK_CACHED_BYTES) / math.log(PACK_STREAMED_BYTES / PACK_CACHED_BYTES)
    return float(m.pack_rate_cached ** (1 - t) * m.pack_rate ** t)


#: The reference machine's figures (2-core x86 VM; see docs/cost-model.md).
DEFAULT_MODEL: Final = CostModel()
#: The segment sizes (bytes of packed data per block and segment) the planner chooses the
#: pipelines' from (:func:`segment_for`).
SEGMENT_CHOICES: Final = tuple((128 << 10) << i for i in range(6))  # 128 KiB .. 4 MiB
#: The segment of an algorithm that is not pipelined (it does not use one).
DEFAULT_SEGMENT: Final = 1 << 20


# ---------------------------------------------------------------------------- the formulas
def _mesh_share(g: Group) -> float:
    """How many times one rank's traffic a host's link carries when every rank sends to every
    other (direct exchange, all-gather, recursive doubling): the host's ranks share the link,
    and only the share of their peers on other hosts crosses it. 1 on one host; a ring over
    hosts in rank order crosses each link once, so rings do not use this factor."""
    if g.hosts <= 1:
        return 1.0
    return g.per_host * (g.size - g.per_host) / max(1, g.size - 1)


def _remote_share(g: Group) -> float:
    """The share of a rank's peers on other hosts (0 on one host)."""
    if g.hosts <= 1:
        return 0.0
    return (g.size - g.per_host) / max(1, g.size - 1)


def _moving(m: CostModel, g: Group, moved: float) -> float:
    """The CPU time of sending and receiving ``moved`` bytes across hosts in all, on the
    rank's share of a core (``remote_cpu`` per byte)."""
    return moved * m.remote_cpu / g.cores_per_rank


def _transfer(m: CostModel, g: Group, wire: float, moved: float) -> float:
    """The time of a transfer whose link time is ``wire`` and which makes a rank send and
    receive ``moved`` bytes across hosts in all: the link's time, or the CPU's where moving
    the bytes takes longer (:func:`_moving`; a 10 Gbit link outruns half a core)."""
    return max(wire, _moving(m, g, moved))


def _rounds_rd(p: int) -> int:
    below = 1 << (p.bit_length() - 1)
    return (below.bit_length() - 1) + (0 if below == p else 2)


def _dense_rd(m: CostModel, g: Group, c: Call) -> float:
    a, b = m.link(g.hosts > 1, g)
    n = c.nbytes
    rate = m.reduce_rate * g.cores_per_rank
    moved = 2 * n * _remote_share(g)  # each round sends and receives n
    return m.call_cpu + _rounds_rd(g.size) * (
        a + m.message_cpu + _transfer(m, g, n * _mesh_share(g) / b, moved) + n / rate)


def _ring_moving(m: CostModel, g: Group, sent: float) -> float:
    """The CPU time of moving a ring's bytes on a host (``sent`` bytes sent per rank, as many
    received): the rank whose neighbour is on another host moves them across hosts
    (``remote_cpu`` per byte), the host's other ranks through shared memory (at
    ``local_bandwidth``), all on the host's cores. One rank per host: :func:`_moving`. On 2
    emulated hosts of 4 ranks, one core each, 10 Gbit, the all-gather's ring of 16 MiB per
    rank measured 227 ms, this 170 ms; charging every rank the remote CPU on its quarter of a
    core gave 328 ms."""
    per_host = g.per_host
    return 2 * sent * (m.remote_cpu + (per_host - 1) / m.local_bandwidth) \
        / (g.cores_per_rank * per_host)


def _ring_pass(m: CostModel, g: Group, c: Call) -> float:
    """One pass of a dense ring over ``n`` bytes (the whole vector): ``p - 1`` steps between
    neighbours, each sending one block of ``n / p`` bytes. The ring's pace is its slowest
    step's: a rank whose neighbour is on another host sends and receives every step's block
    across hosts (:func:`_ring_moving`)."""
    p = g.size
    a, b = m.link(g.hosts > 1, g)
    sent = (p - 1) / p * c.nbytes
    wire = max(sent / b, _ring_moving(m, g, sent)) if g.hosts > 1 else sent / b
    return (p - 1) * (a + m.message_cpu) + wire


def _ring_reduce(m: CostModel, g: Group, c: Call) -> float:
    """A reducing pass's reductions: each rank adds ``p - 1`` received blocks."""
    return (g.size - 1) / g.size * c.nbytes / (m.reduce_rate * g.cores_per_rank)


def _dense_ring(m: CostModel, g: Group, c: Call) -> float:
    """The all-reduce's ring: a reducing pass, then an all-gather pass."""
    return m.call_cpu + 2 * _ring_pass(m, g, c) + _ring_reduce(m, g, c)


def _dense_hier(m: CostModel, g: Group, c: Call) -> float:
    n, loc, h = c.nbytes, g.per_host, g.hosts
    al, bl = m.link(False, g)
    cores = g.cores_per_rank
    inside = 2 * ((loc - 1) * (al + m.message_cpu) + (loc - 1) / loc * n / bl) \
        + (loc - 1) / loc * n / (m.reduce_rate * cores)
    # every local rank runs a ring between hosts on its slice: the host's link carries all
    ar, br = m.link(True, g)
    between = 2 * (h - 1) * (ar + m.message_cpu) \
        + _transfer(m, g, 2 * (h - 1) / h * n / br, 4 * (h - 1) / h * n / loc) \
        + (h - 1) / h * n / loc / (m.reduce_rate * cores)
    return m.call_cpu + inside + between


def _pack(m: CostModel, g: Group, c: Call) -> float:
    return 0.0 if c.packed_io else c.count / (pack_rate_of(m, c.count) * g.cores_per_rank)


def _out_count(g: Group, c: Call) -> float:
    return c.count if c.gather else c.count / g.size


def _decode(m: CostModel, g: Group, c: Call) -> float:
    return 0.0 if c.packed_io else _out_count(g, c) / (m.decode_rate * g.cores_per_rank)


def _count(m: CostModel, g: Group, rows: float, elements: float) -> float:
    return rows * elements / (m.count_rate * g.cores_per_rank)


def _packed_allgather(m: CostModel, g: Group, c: Call) -> float:
    p = g.size
    a, b = m.link(g.hosts > 1, g)
    row = c.count * c.w_in / 8
    wire = (p - 1) * row / b * _mesh_share(g)
    # Bruck's all-gather: ceil(log2 p) rounds of one send and one receive
    rounds = max(1, (p - 1).bit_length())
    return (m.call_cpu + _pack(m, g, c) + rounds * (a + 2 * m.message_cpu)
            + _transfer(m, g, wire, 2 * (p - 1) * row * _remote_share(g))
            + _count(m, g, p, _out_count(g, c)) + _decode(m, g, c))


def _segments(c: Call, p: int, width: int) -> int:
    seg = max(64, (c.segment_bytes or DEFAULT_SEGMENT) * 8 // max(1, width))
    return max(1, -(-c.count // p // seg))


def _stages(m: CostModel, g: Group, messages: int, segments: int) -> float:
    """The CPU that a pipeline's segments after the first add: each of their ``messages``
    (sent and received) costs ``segment_cpu`` on the rank's share of a core. What makes
    smaller segments dearer where the CPU is the bottleneck; where the link is, a smaller
    segment shortens the pipeline's fill and drain instead."""
    return 2 * messages * (segments - 1) / segments * m.segment_cpu / g.cores_per_rank


def _pipeline(stages_cpu: float, wire: float, segments: int, latency: float) -> float:
    """``segments`` pipelined segments whose CPU work and wire time (totals) overlap."""
    per_cpu, per_wire = stages_cpu / segments, wire / segments
    return latency + per_cpu + per_wire + (segments - 1) * max(per_cpu, per_wire)


def _waits(m: CostModel, g: Group, messages: int) -> float:
    """What a round that receives ``messages`` messages from different peers adds beyond the
    one wait its latency holds (:meth:`CostModel.link`) when a host's ranks outnumber its
    cores: each further sender must be scheduled too (measured on the testbed with half a
    core per host: the direct exchange's time grows with its p - 1 messages per phase, not
    with its two phases), each wait :meth:`CostModel.switch_wait`."""
    if messages <= 1:
        return 0.0
    return (messages - 1) * m.switch_wait(g)


def _packed_direct(m: CostModel, g: Group, c: Call) -> float:
    p = g.size
    a, b = m.link(g.hosts > 1, g)
    k = _segments(c, p, c.w_in)
    sent = (p - 1) / p * c.count * (c.w_in + (c.w_out if c.gather else 0)) / 8
    wire = sent / b * _mesh_share(g)
    phases = 2 if c.gather else 1
    msgs = phases * (p - 1) * k
    cpu = (_pack(m, g, c) + _count(m, g, p, c.count / p) + _decode(m, g, c)
           + 2 * msgs * m.message_cpu + _stages(m, g, msgs, k)
           + _moving(m, g, 2 * sent * _remote_share(g)))
    return m.call_cpu + _pipeline(cpu, wire, k, phases * (a + _waits(m, g, p - 1)))


def _packed_ring(m: CostModel, g: Group, c: Call) -> float:
    p = g.size
    a, b = m.link(g.hosts > 1, g)
    block = c.count / p
    bits = sum(max(c.w_in, math.ceil(math.log2(s + 2))) for s in range(p - 1))
    sent = block * bits / 8 + ((p - 1) * block * c.w_out / 8 if c.gather else 0.0)
    wire = sent / b
    steps = 2 * (p - 1) if c.gather else p - 1
    # each of the p - 1 reducing steps unpacks, adds and packs again a block of counts
    repack = (p - 1) * block / (m.repack_rate * g.cores_per_rank)
    cpu = _pack(m, g, c) + _count(m, g, 2 * (p - 1), block) + _decode(m, g, c) + repack
    if g.hosts > 1:  # as the dense ring: its slowest step crosses hosts
        wire = _transfer(m, g, wire, 2 * sent)
    return m.call_cpu + steps * (a + 2 * m.message_cpu) + wire + cpu


def _packed_hier(m: CostModel, g: Group, c: Call) -> float:
    loc, h = g.per_host, g.hosts
    al, bl = m.link(False, g)
    ar, br = m.link(True, g)
    w_c = max(1, math.ceil(math.log2(loc + 1))) if c.w_out == 1 else c.w_out
    k = _segments(c, loc, c.w_in)
    inside = (loc - 1) / loc * c.count * (c.w_in + (c.w_out if c.gather else 0)) / 8 / bl
    # each local rank sends its slice's counts: the host's link carries all the slices
    crossing = (h - 1) / h * c.count * (w_c + c.w_out) / 8
    between = crossing / br
    msgs = k * (2 * (loc - 1) + 2 * (h - 1))
    cpu = (_pack(m, g, c) + _count(m, g, loc + h, c.count / loc) + _decode(m, g, c)
           + 2 * msgs * m.message_cpu + _stages(m, g, msgs, k)
           + _moving(m, g, 2 * crossing / loc))
    return m.call_cpu + _pipeline(cpu, inside + between, k,
                                  2 * (al + _waits(m, g, loc - 1) + ar + _waits(m, g, h - 1)))


def _gather_ring(m: CostModel, g: Group, c: Call) -> float:
    """The dense all-gather's ring: one pass over the output (``n``)."""
    return m.call_cpu + _ring_pass(m, g, c)


def _dense_reduce_scatter(m: CostModel, g: Group, c: Call) -> float:
    """The dense reduce-scatter's ring: one reducing pass."""
    return m.call_cpu + _ring_pass(m, g, c) + _ring_reduce(m, g, c)


def _dense_bruck(m: CostModel, g: Group, c: Call) -> float:
    """The dense all-gather's Bruck rounds: ``ceil(log2 p)`` exchanges sending ``(p - 1)``
    blocks of ``n / p`` bytes in all (``n`` the output), straight from and into the output,
    not pipelined."""
    p = g.size
    a, b = m.link(g.hosts > 1, g)
    sent = (p - 1) / p * c.nbytes
    rounds = (p - 1).bit_length()
    return (m.call_cpu + rounds * (a + m.message_cpu)
            + _transfer(m, g, sent * _mesh_share(g) / b, 2 * sent * _remote_share(g)))


def _one_round(m: CostModel, g: Group, c: Call) -> float:
    a, b = m.link(g.hosts > 1, g)
    return m.call_cpu + math.ceil(math.log2(max(2, g.size))) * (a + m.message_cpu) \
        + c.nbytes / b


# ---------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Algorithm:
    """One registered algorithm of a collective: its name (the ``algorithm=`` value), when
    it applies, and its predicted time."""

    collective: str
    name: str
    cost: Callable[[CostModel, Group, Call], float]
    eligible: Callable[[Group, Call], bool] = lambda g, c: True
    pipelined: bool = False


def group_of(size: int, hosts: tuple[int, ...] | None, model: CostModel,
             two_level: bool = True, streams: bool = False) -> Group:
    """The :class:`Group` of a communicator of ``size`` ranks whose rank ``r`` runs on host
    ``hosts[r]`` (None: unknown, taken as one host), each host's ``model.host_cores`` shared
    by its ranks; ``two_level`` and ``streams`` as in :class:`Group`."""
    if not hosts:
        n_hosts, per_host = 1, size
    else:
        counts: dict[int, int] = {}
        for h in hosts:
            counts[h] = counts.get(h, 0) + 1
        n_hosts, per_host = len(counts), max(counts.values())
    return Group(size, n_hosts, per_host, min(1.0, model.host_cores / max(1, per_host)),
                 two_level, streams)


def _layered(g: Group, c: Call) -> bool:
    return g.layered


def _several(g: Group, c: Call) -> bool:
    return g.size > 1


def _framed_ring(g: Group, c: Call) -> bool:
    """Whether the ring's passes go frame by frame, as Bruck's rounds do. Where they stream
    instead (:attr:`Group.streams`), the ring measured faster than Bruck's frames: over
    loopback TCP 1.4-2.1x on 3 ranks at every size and on 2 from 256 KiB
    (``results/allgather_bruck/``). One rank has nothing to exchange either way."""
    return not g.streams or g.size == 1


#: Every algorithm "auto" can choose, in order of preference on equal cost.
REGISTRY: Final[tuple[Algorithm, ...]] = (
    Algorithm("allreduce", "recursive_doubling", _dense_rd),
    Algorithm("allreduce", "ring", _dense_ring, _several),
    Algorithm("allreduce", "hierarchical", _dense_hier, _layered),
    Algorithm("packed", "allgather", _packed_allgather),
    Algorithm("packed", "direct", _packed_direct, pipelined=True),
    Algorithm("packed", "ring", _packed_ring, _several),
    Algorithm("packed", "hierarchical", _packed_hier, _layered, pipelined=True),
    Algorithm("reduce_scatter", "ring", _dense_reduce_scatter),
    Algorithm("allgather", "bruck", _dense_bruck, _framed_ring),
    Algorithm("allgather", "ring", _gather_ring, _several),
    Algorithm("broadcast", "tree", _one_round),
    Algorithm("alltoall", "direct", _one_round),
    Algorithm("barrier", "dissemination", _one_round),
)

_BY_KEY: Final = {(a.collective, a.name): a for a in REGISTRY}


def candidates(collective: str, group: Group, call: Call) -> list[Algorithm]:
    """The registered algorithms of ``collective`` that apply to ``call`` on ``group``."""
    return [a for a in REGISTRY if a.collective == collective and a.eligible(group, call)]


def _registered(collective: str, name: str) -> Algorithm:
    algo = _BY_KEY.get((collective, name))
    if algo is None:
        raise UsageError(f"no cost formula for {collective} algorithm {name!r}",
                         argument="name")
    return algo


def _best_segment(algo: Algorithm, model: CostModel, group: Group, call: Call
                  ) -> tuple[int, float]:
    """(segment bytes, predicted seconds) of ``algo`` on ``call``: the call's own segment
    when it names one, else the cheapest of :data:`SEGMENT_CHOICES` (the larger on a near
    tie); :data:`DEFAULT_SEGMENT` for an algorithm that is not pipelined."""
    if call.segment_bytes > 0:
        return call.segment_bytes, algo.cost(model, group, call)
    if not algo.pipelined:
        return DEFAULT_SEGMENT, algo.cost(model, group, call)
    best, best_cost = 0, math.inf
    for seg in reversed(SEGMENT_CHOICES):
        cost = algo.cost(model, group, dataclasses.replace(call, segment_bytes=seg))
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = seg, cost
    return best, best_cost


def predict(collective: str, name: str, model: CostModel, group: Group, call: Call) -> float:
    """The model's time in seconds of algorithm ``name`` of ``collective`` (a pipeline at the
    call's segment size, or at :func:`segment_for`'s when the call leaves it at 0);
    UsageError for an algorithm the registry does not know."""
    return _best_segment(_registered(collective, name), model, group, call)[1]


def segment_for(collective: str, name: str, model: CostModel, group: Group, call: Call
                ) -> int:
    """The segment size in bytes that algorithm ``name`` of ``collective`` runs ``call`` with:
    ``call.segment_bytes`` when it is set, else the one of :data:`SEGMENT_CHOICES` the model
    predicts fastest. Where the link is the bottleneck a small segment wins (the pipeline
    fills and drains sooner: a 64M-element majority on two 1 Gbit hosts took 1.05x the wire
    bound with 1 MiB segments and 1.003x with 128 KiB); where the CPU is, a large one (fewer
    stages: 1 MiB was 1.22x faster than 128 KiB on two 10 Gbit hosts of one core each). Pure,
    like :func:`choose`. UsageError for an algorithm the registry does not know."""
    return _best_segment(_registered(collective, name), model, group, call)[0]


def choose(collective: str, model: CostModel, group: Group, call: Call) -> str:
    """The cheapest applicable algorithm of ``collective`` (the first registered on a tie).
    Pure: the same answer on every rank given the same model, group and call."""
    best, best_cost = "", math.inf
    for algo in candidates(collective, group, call):
        cost = _best_segment(algo, model, group, call)[1]
        if cost < best_cost * (1 - 1e-9):  # a near tie goes to the first registered
            best, best_cost = algo.name, cost
    if not best:
        raise UsageError(f"no algorithm of {collective} applies to {group} and {call}")
    return best


# ---------------------------------------------------------------------------- configuration
def model_path(environ: Mapping[str, str] | None = None) -> Path:
    """The cost model's cache file: ``$BITCOLL_COST_MODEL``, else
    ``~/.cache/bitcoll/cost_model.json``."""
    env = os.environ if environ is None else environ
    if env.get(ENV_COST_MODEL):
        return Path(env[ENV_COST_MODEL])
    return Path.home() / ".cache" / "bitcoll" / "cost_model.json"


def load_model(environ: Mapping[str, str] | None = None) -> CostModel:
    """This machine's model: :data:`DEFAULT_MODEL`, updated by the cache file when it exists
    (see :func:`model_path`), then by ``BITCOLL_COST_<FIELD>`` variables. UsageError for a
    file that is not a JSON object of known fields, or a bad value."""
    env = os.environ if environ is None else environ
    model = DEFAULT_MODEL
    path = model_path(env)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read the cost model {path}: {exc}",
                             argument=ENV_COST_MODEL) from exc
        if not isinstance(data, dict):
            raise UsageError(f"the cost model {path} must hold a JSON object",
                             argument=ENV_COST_MODEL)
        model = CostModel.from_mapping({k: v for k, v in data.items() if k != "_about"}, model)
    overrides: dict[str, object] = {}
    for name in _FIELDS:
        text = env.get(ENV_FIELD_PREFIX + name.upper())
        if text:
            try:
                overrides[name] = float(text)
            except ValueError:
                raise UsageError(f"{ENV_FIELD_PREFIX}{name.upper()} must be a number, got "
                                 f"{text!r}", argument=ENV_FIELD_PREFIX + name.upper()) from None
    return CostModel.from_mapping(overrides, model) if overrides else model
