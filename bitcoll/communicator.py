"""The public ``Communicator``: validation, algorithm choice, ordering, failure handling.

Every collective is called by every rank of the world in the same order with matching
arguments (same op, dtype, length, algorithm, root). Mismatches are detected from the frame
headers and raise :class:`~bitcoll.errors.ProtocolError` on the rank that sees them and
:class:`~bitcoll.errors.PeerLostError` on the others (the communicator is then aborted).

Arrays: numpy arrays, CPU arrays that export DLPack (torch CPU tensors, JAX CPU arrays) and
objects that export the buffer protocol, in and out, without copies (see
:mod:`bitcoll.arrays`). An input of any shape is read as its flattened (C order) view; a
non-contiguous input is copied first. An ``out`` array must have the documented dtype and
number of elements, be C-contiguous and writeable, else :class:`~bitcoll.errors.UsageError`;
it is written in place and returned as it was passed. Without ``out`` a collective returns a
new numpy array (a torch.bfloat16 tensor for bfloat16 input). bfloat16 (torch tensors) is
supported by the dense collectives: reductions run in float32 and are rounded once to
bfloat16 (to nearest, ties to even). Inputs must not be modified, and outputs not read, until
the collective has completed (for ``async_op=True``: until ``Work.wait`` returned).

Every collective takes ``timeout`` (seconds, default: the communicator's) and
``async_op=True`` (returns a :class:`~bitcoll.work.Work`). Collectives run one at a time in
call order; a synchronous call first waits for pending asynchronous ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Literal, NamedTuple, NoReturn, TypeVar, overload

import numpy as np
import numpy.typing as npt

from . import argcheck
from .algorithms.allgather_bruck import allgather_bruck
from .algorithms.allgather_ring import allgather_ring
from .algorithms.allreduce_gathered import GatheredReduce
from .algorithms.allreduce_recursive_doubling import allreduce_recursive_doubling
from .algorithms.allreduce_ring import (
    allreduce_ring,
    allreduce_ring_narrowed,
    reduce_scatter_ring,
)
from .algorithms.alltoall_direct import alltoall_direct
from .algorithms.barrier_dissemination import barrier_dissemination
from .algorithms.broadcast_tree import broadcast_tree
from .algorithms.context import OpContext, Slot
from .algorithms.hierarchical import allreduce_hierarchical, packed_hierarchical
from .algorithms.sign_allreduce_allgather import PreparedMajority, packed_allgather
from .algorithms.sign_allreduce_direct import packed_direct
from .algorithms.sign_allreduce_ring import packed_ring
from .algorithms.votes import CODECS, TIES, VoteCodec, field_width, make_codec
from .argcheck import AGREED
from .arguments import call_signature, mismatch_text
from .arrays import BFLOAT16, HostArray, bf16_tensor, to_numpy, type_name
from .config import DEFAULT_TIMEOUT, MAX_SUM_RANGE
from .errors import BitcollError, CommError, PeerLostError, ProtocolError, UsageError
from .kernels import PARALLEL_MIN_ELEMENTS
from .layout import packed_stream
from .ops import FLOAT_DTYPES, SUPPORTED_DTYPES, ReduceOp, check_dtype, parse_op
from .partition import block, block_bounds
from .plan import (
    DEFAULT_MODEL,
    DEFAULT_SEGMENT,
    Call,
    CostModel,
    Group,
    choose,
    group_of,
    segment_for,
)
from .topology import Topology, digest, host_key
from .transport.base import NativeCollectives, TrafficStats, Transport
from .work import Work

__all__ = ["Communicator", "DEFAULT_TIMEOUT", "DEFAULT_SEGMENT_BYTES", "REMOTE_SEGMENT_BYTES",
           "DEFAULT_PACKED_SEGMENT_BYTES", "NATIVE_ALLREDUCE_MAX_BYTES"]

T = TypeVar("T")
Array = npt.NDArray[Any]

DEFAULT_SEGMENT_BYTES = 32 << 20
"""Wire segment of the dense ring algorithms among the ranks of one host. Per-segment costs (a
frame, thread hand-offs, a reduction call, cache misses) dominate there: in interleaved runs
(best of 3) of 64-256 MiB all-reduces, 32 MiB segments were 0-20% faster than 8 MiB ones on
loopback with 2 and 4 ranks and faster over MPI; 4 ranks of one host, 256 MiB, 78-102 ms with
shared memory and 238-259 ms over loopback TCP against 102-112 and 290-302 ms with 4 MiB.
Blocks of at most 32 MiB (all-reduces up to 64 MiB on 2 ranks, 128 MiB on 4) move as one
segment per ring step."""
REMOTE_SEGMENT_BYTES = 4 << 20
"""The dense segment ``bitcoll.init`` takes by default when the ranks span several hosts:
across a link the ring streams better in smaller pieces (the next step forwards a segment as
soon as it is reduced). 4 hosts on the 10 Gbit testbed, 3 interleaved rounds, 64 MiB:
156-167 ms against 170-185 ms with 32 MiB; 256 MiB: 618-652 against 648-756 ms; 16 MiB
(one segment per block either way): 37-39 ms both. (An earlier series on a busier machine had
found 32 MiB 12-15% faster there.)"""
DEFAULT_PACKED_SEGMENT_BYTES = DEFAULT_SEGMENT
"""Wire segment of the packed-bit pipelines for :meth:`Communicator.run` with
``packed=True`` where ``packed_segment_bytes`` is None: the planner's segment of a packed
algorithm that does not pipeline (:data:`bitcoll.plan.DEFAULT_SEGMENT`, 1 MiB). The packed
collectives themselves take the planner's segment per call
(:func:`bitcoll.plan.segment_for`)."""
#: Over MPI, at or below this many bytes the dense all-reduce's default is MPI's own
#: all-reduce (after the one fixed-size argument check every all-reduce over MPI starts with),
#: above it bitcoll's ring, streamed (:meth:`~bitcoll.transport.mpi.MPITransport.stream`): see
#: :meth:`Communicator.allreduce` and the README for the measured crossover (2 ranks: MPICH's
#: all-reduce faster up to 512 KiB, the ring from 1 MiB; ``results/mpi_crossover_streams``).
NATIVE_ALLREDUCE_MAX_BYTES = 512 << 10

_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "ring", "recursive_doubling", "hierarchical", "native"),
    "reduce_scatter": ("auto", "ring", "native"),
    "allgather": ("auto", "ring", "bruck", "native"),
    "broadcast": ("auto", "tree", "native"),
    "alltoall": ("auto", "direct", "native"),
    "barrier": ("auto", "dissemination", "native"),
    "packed": ("auto", "direct", "ring", "allgather", "hierarchical"),
}
TIE_RULES = tuple(TIES)  # "positive", "negative", "alternate": see bitcoll.algorithms.votes
SIGN_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
INT_DTYPES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))


class Vector(NamedTuple):
    """A collective's input as the algorithms see it (see :func:`intake`)."""

    flat: Array
    """1-D and C-contiguous: a view of the input, or a copy of a non-contiguous one; for
    bfloat16 the raw bits (uint16)."""
    shape: tuple[int, ...]
    """The input's shape."""
    bf16: bool
    """Whether the elements are bfloat16."""

    @property
    def label(self) -> str:
        """The element type in frame signatures: the dtype string, or "bfloat16"."""
        return BFLOAT16 if self.bf16 else self.flat.dtype.str


def intake(x: object, name: str = "x") -> Vector:
    """Read the input array ``x`` (numpy, DLPack or buffer protocol: :mod:`bitcoll.arrays`)
    as a 1-D C-contiguous numpy vector, a view (a copy only when ``x`` is not C-contiguous);
    UsageError unless its dtype is supported (bfloat16 is)."""
    arr, bf16 = to_numpy(x, name)
    if not bf16:
        check_dtype(arr.dtype, name=name)
    return Vector(np.ascontiguousarray(arr).reshape(-1), arr.shape, bf16)


def as_vector(x: object, name: str = "x") -> Array:
    """The 1-D C-contiguous view (or copy) of the array ``x``, dtype checked: ``intake``'s
    ``flat``."""
    return intake(x, name).flat


def in_place(flat: Array, vec: Array) -> bool:
    """True when the output ``flat`` is the input ``vec`` itself; UsageError when they overlap
    otherwise (the result would depend on the algorithm's order of reads and writes)."""
    # Both are 1-D and C-contiguous, so overlapping bounds are overlapping memory: the bounds
    # test suffices (np.shares_memory solves the exact problem, tens of microseconds).
    if not np.may_share_memory(flat, vec):
        return False
    if flat.size == vec.size and flat.strides == vec.strides and \
            flat.__array_interface__["data"][0] == vec.__array_interface__["data"][0]:
        return True
    raise UsageError("out overlaps x without being x; pass out=x to reduce in place or a "
                     "separate array", argument="out")


def output(out: object, size: int, dtype: np.dtype[Any], shape: tuple[int, ...] | None = None,
           name: str = "out", *, bf16: bool = False,
           accept: Collection[np.dtype[Any]] = ()) -> tuple[Any, Array]:
    """The one validator of the collectives' outputs: allocate an output, or check ``out``.

    Returns (what the collective returns, its 1-D numpy view). Without ``out``: a new numpy
    array of ``shape`` (default ``(size,)``) and ``dtype``, or for bfloat16 (``bf16``, with
    ``dtype`` uint16) a torch.bfloat16 tensor over new memory. With ``out`` (numpy, DLPack or
    buffer protocol, see :mod:`bitcoll.arrays`): ``out`` itself, once checked to have
    ``dtype`` (or one of ``accept``; bfloat16 exactly when ``bf16``) and ``size`` elements and
    to be C-contiguous and writeable; else UsageError.
    """
    if out is None:
        arr = np.empty(shape if shape is not None else (size,), dtype=dtype)
        return (bf16_tensor(arr) if bf16 else arr), arr.reshape(-1)
    view, out_bf16 = to_numpy(out, name)
    if out_bf16 != bf16 or (not bf16 and view.dtype != dtype and view.dtype not in accept):
        want = BFLOAT16 if bf16 else str(dtype)
        if accept:
            want = "one of " + ", ".join(sorted({str(d) for d in accept} | {want}))
        raise UsageError(f"{name} has dtype {type_name(view, out_bf16)}, expected {want}",
                         argument=name)
    if view.size != size:
        raise UsageError(f"{name} has {view.size} elements, expected {size}", argument=name)
    if not view.flags.c_contiguous:
        raise UsageError(f"{name} must be C-contiguous so that it can be written in place",
                         argument=name)
    if not view.flags.writeable:
        raise UsageError(f"{name} is read-only", argument=name)
    return out, view.reshape(-1)


def _widened(ctx: OpContext, bits: Array) -> Array:
    """bfloat16 bits widened to float32 (exact) in the work buffer ``Slot.BF16_WIDE``."""
    from . import kernels

    return kernels.bf16_to_float32(bits, out=ctx.scratch(Slot.BF16_WIDE, bits.size,
                                                        np.dtype(np.float32)))


def _narrow(src: Array, dst: Array) -> None:
    """float32 ``src`` rounded once to bfloat16 bits in ``dst`` (to nearest, ties to even)."""
    from . import kernels

    kernels.float32_to_bf16(src, out=dst)


def _count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise UsageError(f"count must be an integer >= 0, got {count!r}", argument="count")
    return int(count)


def signature(*fields: object) -> int:
    """A collective's name and arguments as the ranks compare them: its 32-bit signature and
    its argument map (:func:`bitcoll.arguments.call_signature`), carried in every frame
    header."""
    return call_signature(str(fields[0]), fields[1:])


class _Validating:
    """The context manager of :meth:`Communicator._validating` (a class: cheaper per call
    than a generator-based one)."""

    __slots__ = ("_comm", "_name")

    def __init__(self, comm: Communicator, name: str) -> None:
        self._comm = comm
        self._name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if isinstance(exc, UsageError):
            comm = self._comm
            transport = comm._transport
            if comm.size > 1 and transport.failure is None:
                transport.abort(f"UsageError in {self._name} on rank {comm.rank}: {exc}")


class Communicator:
    """A group of ``size`` ranks that run collectives together.

    Create one with :func:`bitcoll.init`. Attributes: ``rank`` (0-based), ``size``,
    ``backend`` ("local", "tcp" or "mpi"), ``stats`` (:class:`TrafficStats`: bytes and
    messages this rank handed to / took from its transport, headers included; ``reset()``
    zeroes them), ``timeout`` (default deadline in seconds), ``segment_bytes`` (wire segment
    size of the dense ring algorithms) and ``packed_segment_bytes`` (wire segment size of the
    packed-bit pipelines; None, the default: the planner's per call,
    :func:`bitcoll.plan.segment_for`). Every rank must use the same segment sizes (frames of
    different lengths fail the collective with ProtocolError).

    ``topology``: which ranks share a host (:class:`~bitcoll.topology.Topology` of this rank,
    the same ``hosts`` on every rank) when the caller knows it; default None: exchanged on
    first use of :attr:`topology`. UsageError unless it has ``size`` entries and this rank.
    ``two_level``: see :attr:`two_level` (the same on every rank). ``shm``: whether the
    job's ranks that share a host exchange frames through shared memory (the same on every
    rank: ``bitcoll.init`` agrees on it), which tells the planner that the ring's passes
    between them go frame by frame (:attr:`plan_group`). ``cost_model``: the
    parameters the automatic algorithm choice uses (:mod:`bitcoll.plan`; the same on every
    rank: ``bitcoll.init`` gives every rank rank 0's).
    """

    def __init__(self, transport: Transport, timeout: float = DEFAULT_TIMEOUT,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 packed_segment_bytes: int | None = None,
                 topology: Topology | None = None, two_level: bool = True,
                 cost_model: CostModel = DEFAULT_MODEL, shm: bool = False) -> None:
        if not isinstance(two_level, bool):
            raise UsageError(f"two_level must be True or False, got {two_level!r}")
        if not isinstance(shm, bool):
            raise UsageError(f"shm must be True or False, got {shm!r}", argument="shm")
        if topology is not None and (len(topology.hosts) != transport.size or
                                     topology.rank != transport.rank):
            raise UsageError(f"topology covers {len(topology.hosts)} ranks as rank "
                             f"{topology.rank}; this communicator is rank {transport.rank} of "
                             f"{transport.size}", argument="topology")
        self._transport = transport
        self.timeout = _check_timeout(timeout)
        self.segment_bytes = segment_bytes
        self.packed_segment_bytes = packed_segment_bytes
        self._seq = 0
        self._lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._last: cf.Future[Any] | None = None
        self._closed = False
        self._majority_calls = 0
        self._scratch: dict[int, npt.NDArray[np.uint8]] = {}
        self._call_lock = threading.Lock()  # held by the thread inside a collective call
        self._call_owner: threading.Thread | None = None  # the thread inside a collective
        self._splits = 0  # split() calls so far: names the sub-groups' namespaces
        self._agreed_failure: CommError | None = None  # see AGREED
        self._topology: Topology | None = topology
        self._two_level_on = two_level
        self._shm = shm
        self._model = DEFAULT_MODEL
        self._group: Group | None = None  # the planner's view of this group, see plan_group
        self._host_comms: dict[str, Communicator] = {}  # host_comm() / cross_host_comm()
        self._no_local_stats: TrafficStats | None = None  # stats_local without shared memory
        # MPI's own collectives (algorithm="native", the argument check), when there are any.
        self._nt: NativeCollectives | None = \
            transport if isinstance(transport, NativeCollectives) else None
        # The synchronous all-reduce's plans (several ranks): over MPI, MPI's own collectives
        # or the argument check's records (_mpi_plan); else bitcoll's recursive doubling or
        # ring. See _fast_allreduce. Two caches: the fast path's by (dtype, count, op as
        # passed), MPI's by (dtype, count, ReduceOp); one key may have a plan in each.
        self._plans_on = transport.size > 1
        self._plans: dict[tuple[object, ...], _Plan | None] = {}
        self._mpi_plans: dict[tuple[object, ...], _Plan | None] = {}
        # _packed_choice's answers: (algorithm, segment bytes)
        self._packed_plans: dict[tuple[object, ...], tuple[str, int]] = {}
        self._allgather_algos: dict[int, str] = {}  # _auto_allgather's answers by bytes
        # The synchronous sign collectives' plans, see _fast_packed.
        self._fast_packed_plans: dict[tuple[object, ...], _PackedPlan | None] = {}
        self.cost_model = cost_model

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < size``."""
        return self._transport.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._transport.size

    @property
    def backend(self) -> str:
        """"local" (one rank), "tcp" or "mpi"."""
        return self._transport.name

    @property
    def stats(self) -> TrafficStats:
        """Bytes and messages sent and received by this rank since init (or ``reset()``):
        :attr:`stats_local` plus :attr:`stats_remote`."""
        return self._transport.stats

    @property
    def stats_local(self) -> TrafficStats:
        """The part of :attr:`stats` that stayed within the host: frames through shared memory
        (TCP backend with several ranks on a host); counters that stay zero otherwise.
        ``stats.reset()`` resets it too."""
        local = getattr(self._transport, "stats_local", None)
        if isinstance(local, TrafficStats):
            return local
        if self._no_local_stats is None:
            self._no_local_stats = TrafficStats()
        return self._no_local_stats

    @property
    def stats_remote(self) -> TrafficStats:
        """The part of :attr:`stats` that went through the network transport (TCP sockets or
        MPI): between hosts, and between ranks of one host that do not share memory."""
        remote = getattr(self._transport, "stats_remote", None)
        return remote if isinstance(remote, TrafficStats) else self._transport.stats

    # ------------------------------------------------------------------ topology
    @property
    def topology(self) -> Topology:
        """Which ranks share a host (:mod:`bitcoll.topology`). ``bitcoll.init`` exchanges the
        host keys once (one small all-gather) and ``split`` passes them on; on a communicator
        built by hand the first access is that all-gather, so every rank must make it."""
        if self._topology is None:
            keys = self.allgather(np.array([digest(host_key())], dtype=np.int64))
            self._topology = Topology.from_digests([int(k) for k in keys], self.rank)
            self._forget_plans()  # the planner now knows the hosts
        return self._topology

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host (rank order)."""
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        """How many ranks run on this rank's host (hosts may differ)."""
        return self.topology.local_size

    @property
    def host_index(self) -> int:
        """This rank's host, numbered ``0..num_hosts-1`` in the order of their lowest rank."""
        return self.topology.host_index

    @property
    def num_hosts(self) -> int:
        """How many hosts the ranks run on."""
        return self.topology.num_hosts

    def host_comm(self) -> Communicator:
        """The sub-communicator of the ranks on this rank's host (ordered by local rank).
        Collective over this communicator on the first call (a :meth:`split`), cached after;
        closed with this communicator."""
        return self._cached_split("host", self.host_index, self.local_rank)

    def cross_host_comm(self) -> Communicator:
        """The sub-communicator of the ranks with this rank's local rank, one per host
        (ordered by host). Hosts with fewer ranks have no rank for the higher local ranks.
        Collective on the first call, cached after; closed with this communicator."""
        return self._cached_split("cross", self.local_rank, self.host_index)

    def _cached_split(self, name: str, color: int, key: int) -> Communicator:
        sub = self._host_comms.get(name)
        if sub is None:
            made = self.split(color, key)
            assert made is not None
            sub = self._host_comms[name] = made
        return sub

    @property
    def majority_calls(self) -> int:
        """Majority collectives started so far on this communicator: the ``k`` of the
        "alternate" tie rule for the next one."""
        return self._majority_calls

    @property
    def collectives_started(self) -> int:
        """Collectives started so far on this communicator (counted from the end of
        :func:`bitcoll.init`'s set-up): the number the next one gets, which its errors carry
        as :attr:`CommError.sequence <bitcoll.errors.CommError>`."""
        return self._seq

    @property
    def transport(self) -> Transport:
        """The transport under this communicator (for algorithms and benchmarks)."""
        return self._transport

    def __repr__(self) -> str:
        return f"<Communicator rank={self.rank} size={self.size} backend={self.backend}>"

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for pending collectives (within their deadlines), then release the transport.
        Idempotent."""
        if self._closed:
            return
        for sub in self._host_comms.values():
            sub.close()
        try:
            self._drain()
        except BitcollError:
            pass
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._transport.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        """Close; when an exception leaves the ``with`` block, first abort (on more than one
        rank) so that the peers fail at once and pending work is not waited for."""
        if exc is not None and self.size > 1 and not self._closed and \
                self._transport.failure is None:
            self._transport.abort(f"{type(exc).__name__} on rank {self.rank}: {exc}")
        self.close()

    # ------------------------------------------------------------------ machinery
    def _check_usable(self) -> None:
        if self._closed:
            raise UsageError("the communicator is closed")
        failure = self._transport.failure or self._agreed_failure
        if failure is not None:
            cls = PeerLostError if isinstance(failure, PeerLostError) else CommError
            raise cls(f"the communicator was aborted: {failure}") from failure

    def _validating(self, name: str) -> _Validating:
        """Argument checks of a collective (``with self._validating(name): ...``): checks
        that the communicator is usable; a UsageError on one rank aborts the communicator so
        that its peers fail at once instead of waiting for their deadline."""
        self._check_usable()
        return _Validating(self, name)

    def _drain(self) -> None:
        last = self._last
        if last is not None:
            cf.wait([last])

    @property
    def two_level(self) -> bool:
        """Whether the two-level algorithms (``algorithm="hierarchical"``) may be the default
        where the ranks run on several hosts and some host runs several (``bitcoll.init``'s
        ``two_level``, default on; ``BITCOLL_TWO_LEVEL=0`` turns it off): the cost model
        chooses them where they are cheapest. Off, those collectives default to the flat
        algorithms, as on one host. Sub-communicators from
        :meth:`split` inherit it."""
        return self._two_level_on

    @property
    def cost_model(self) -> CostModel:
        """The cost model's parameters behind every "auto" algorithm (:mod:`bitcoll.plan`).
        Setting it is local: give every rank the same model (``bitcoll.init`` does), or the
        ranks may choose different algorithms and fail their collectives with
        ProtocolError."""
        return self._model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        if not isinstance(model, CostModel):
            raise UsageError(f"cost_model must be a bitcoll.plan.CostModel, got {model!r}",
                             argument="cost_model")
        self._model = model
        self._forget_plans()

    def _forget_plans(self) -> None:
        """Empty every cached choice (after the model or the topology changed)."""
        self._group = None
        self._plans.clear()
        self._mpi_plans.clear()
        self._packed_plans.clear()
        self._allgather_algos.clear()
        self._fast_packed_plans.clear()

    @property
    def plan_group(self) -> Group:
        """This communicator as the planner sees it (:class:`bitcoll.plan.Group`): ranks,
        hosts (when the topology is known; else one host), ranks per host, each rank's share
        of a core, whether the two-level algorithms may be chosen, whether the ring's passes
        stream (the transport runs them in native code, :meth:`~bitcoll.transport.base.
        Transport.stream`: the TCP and MPI backends without frame integrity, unless ranks of
        one host share memory, which goes frame by frame). The same on every rank: it
        depends on the topology and on settings every rank shares, not on whether this
        rank's transport can stream (a rank that cannot makes the same frames one by one)."""
        if self._group is None:
            topo = self._topology
            hosts = None if topo is None else topo.hosts
            t = self._transport
            streams = t.name in ("tcp", "mpi") and not getattr(t, "integrity", False)
            if streams and self._shm:
                streams = len(set(hosts)) == self.size if hosts else self.size == 1
            self._group = group_of(self.size, hosts, self._model, self._two_level_on,
                                   streams)
        return self._group

    def _hosts(self) -> tuple[int, ...]:
        """Every rank's host index, for ``algorithm="hierarchical"`` (on a communicator
        built without a topology, the first call exchanges the host keys: collective)."""
        return self.topology.hosts

    def _algorithm(self, collective: str, algorithm: str | None, auto: str) -> str:
        choices = _ALGORITHMS[collective]
        name = "auto" if algorithm is None else algorithm
        if name not in choices:
            raise UsageError(f"unknown algorithm {algorithm!r} for {collective}; "
                             f"expected one of {', '.join(choices)}", argument="algorithm")
        if name == "native" and self._nt is None:
            raise UsageError(f"algorithm 'native' needs the MPI backend (this is {self.backend})",
                             argument="algorithm")
        return auto if name == "auto" else name

    @property
    def segment_bytes(self) -> int:
        """Wire segment size in bytes of the dense ring algorithms (>= 1)."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        self._segment_bytes = _check_segment("segment_bytes", value)

    @property
    def packed_segment_bytes(self) -> int | None:
        """Wire segment size in bytes of the packed-bit pipelines (>= 1), or None (the
        default): the planner chooses it per call from the cost model
        (:func:`bitcoll.plan.segment_for`: small segments where the link is the bottleneck,
        large ones where the CPU is)."""
        return self._packed_segment_bytes

    @packed_segment_bytes.setter
    def packed_segment_bytes(self, value: int | None) -> None:
        self._packed_segment_bytes = None if value is None else \
            _check_segment("packed_segment_bytes", value)

    def run(self, name: str, fields: tuple[object, ...], body: Callable[[OpContext], T],
            async_op: bool, timeout: float | None, packed: bool | int = False, *,
            checks_itself: bool = False) -> T | Work[T]:
        """Run one collective: assign its sequence number, then execute ``body`` now or on the
        worker thread. Any error aborts the communicator (every peer fails fast) unless the
        world has one rank, a UsageError for ``timeout`` (not a positive number of seconds)
        too: it is an argument check like those of :meth:`_validating`. Public for the
        packed-bit collectives and extensions.
        ``packed``: the context's segment size is ``packed_segment_bytes`` (or
        :data:`DEFAULT_PACKED_SEGMENT_BYTES` where that is None) instead of ``segment_bytes``;
        a positive int: that segment size. ``checks_itself``: over MPI, ``body`` makes the
        argument check itself (:meth:`_exchange`, with its data as the payload) instead of
        before it."""
        if timeout is None:
            self._check_usable()
            limit = self.timeout
        else:
            # The peers are in (or on their way into) this collective: tell them.
            with self._validating(name):
                limit = _check_timeout(timeout)
        if packed is False:
            seg = self._segment_bytes
        elif packed is True:
            seg = self._packed_segment_bytes or DEFAULT_PACKED_SEGMENT_BYTES
        else:
            seg = _check_segment("packed", packed)
        if not self._call_lock.acquire(blocking=False):
            self._concurrent_call(name)
        try:
            return self._run_locked(name, fields, body, async_op, limit, seg, checks_itself)
        finally:
            self._call_lock.release()

    def _concurrent_call(self, name: str) -> None:
        """A second thread called a collective while one is inside another: refuse it (and
        abort, so that no rank pairs frames of two different calls)."""
        owner = self._call_owner.name if self._call_owner is not None else "?"
        msg = (f"{name} called from thread {threading.current_thread().name!r} while thread "
               f"{owner!r} is inside a collective on this communicator; collectives of one "
               "communicator must be called by one thread at a time, in the same order on "
               "every rank (give each thread its own communicator: comm.split(0))")
        if self.size > 1 and self._transport.failure is None:
            self._transport.abort(f"UsageError on rank {self.rank}: {msg}")
        raise UsageError(msg)

    def _run_locked(self, name: str, fields: tuple[object, ...],
                    body: Callable[[OpContext], T], async_op: bool, limit: float,
                    seg: int, checks_itself: bool = False) -> T | Work[T]:
        seq = self._turn()
        sig = signature(name, *fields)
        checked = self._nt is not None and self.size > 1 and not checks_itself
        if async_op:
            def execute() -> T:
                self._check_usable()  # queued: the communicator may have failed since
                return self._execute(name, fields, seq, sig, body, limit, seg, checked)

            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="bitcoll")
            fut = self._executor.submit(execute)
            self._last = fut
            return Work(fut, f"{name} #{seq}")
        self._drain()
        return self._execute(name, fields, seq, sig, body, limit, seg, checked)

    def _number_from_here(self) -> None:
        """Set-up is over (:func:`bitcoll.init`): the next collective is #0, so that a
        program's first call has the same number on every backend (init's own collectives,
        which differ between backends, are not counted). Every rank calls it at the same
        point, with no collective in flight; frames of earlier calls are all consumed by then
        (a call completes only after every frame to this rank arrived)."""
        self._seq = 0

    def _turn(self) -> int:
        """The calling thread, holding the call lock, takes the next collective: it becomes
        the owner, and the call its sequence number (returned). Every collective, the fast
        all-reduce included, starts here."""
        self._call_owner = threading.current_thread()
        seq = self._seq  # the call lock guards the sequence number
        self._seq = seq + 1
        return seq

    def _execute(self, name: str, fields: tuple[object, ...], seq: int, sig: int,
                 body: Callable[[OpContext], T], limit: float, seg: int,
                 checked: bool) -> T:
        """Run collective ``name`` #``seq`` (signature ``sig``) on this thread within ``limit``
        seconds, its context's segment ``seg`` bytes: over MPI the argument check first when
        ``checked``, then ``body``; any error goes through :meth:`_failed`. The one execution
        path of every collective."""
        self._transport.collective = name
        ctx = OpContext(self._transport, seq, sig, time.monotonic() + limit, seg,
                        self._scratch)
        try:
            if checked:
                self._exchange(ctx.seq, ctx.signature, None, ctx.deadline, name, fields)
            return body(ctx)
        except BaseException as exc:
            self._failed(exc, name, seq)

    def _failed(self, exc: BaseException, name: str, seq: int) -> NoReturn:
        """Re-raise ``exc``, which ended collective ``name`` #``seq``, after the bookkeeping
        every failed collective gets: context filled in, and the communicator aborted (every
        peer fails fast) unless every rank found the same problem (see ``AGREED``)."""
        if isinstance(exc, CommError):
            exc.add_context(rank=self.rank, collective=name, sequence=seq)
        if isinstance(exc, CommError) and exc in AGREED:
            # Every rank found the same problem from the same data and raises it itself: no
            # abort notice (it could overtake a peer's last frame).
            self._agreed_failure = exc
            raise exc
        if self.size > 1 and self._transport.failure is None:
            self._transport.abort(f"{type(exc).__name__} in {name} #{seq} on rank "
                                  f"{self.rank}: {exc}")
        raise exc

    def _exchange(self, seq: int, sig: int, payload: memoryview | None, deadline: float,
                  name: str, fields: tuple[object, ...]) -> Array:
        """Over MPI: the argument check of collective ``name`` #``seq`` (:mod:`bitcoll.argcheck`),
        carrying ``payload``; returns the records' payloads."""
        return argcheck.check(self._native_t(), self.rank, seq, sig, payload, deadline, name,
                              fields)

    def _mismatch(self, seq: int, deadline: float, name: str,
                  fields: tuple[object, ...]) -> NoReturn:
        """Over MPI, after records that disagree: the agreed ProtocolError
        (:func:`bitcoll.argcheck.mismatch`)."""
        argcheck.mismatch(self._native_t(), self.rank, seq, deadline, name, fields)

    # ------------------------------------------------------------------ dense collectives
    @overload
    def allreduce(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                  out: HostArray | None = None, *, async_op: Literal[False] = False,
                  timeout: float | None = None,
                  algorithm: str | None = None) -> HostArray: ...
    @overload
    def allreduce(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                  out: HostArray | None = None, *, async_op: Literal[True],
                  timeout: float | None = None,
                  algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def allreduce(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                  out: HostArray | None = None, *, async_op: bool,
                  timeout: float | None = None,
                  algorithm: str | None = None) -> Any: ...
    def allreduce(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                  out: HostArray | None = None, *, async_op: bool = False,
                  timeout: float | None = None,
                  algorithm: str | None = None) -> Any:
        """Element-wise reduction of ``x`` over all ranks; every rank gets the same bits.

        ``x``: any supported dtype and shape (read flattened). ``op``: "sum", "avg" (floating
        dtypes only), "max", "min". Returns ``out`` (same dtype and shape as ``x``; ``out=x``
        reduces in place), or a Work with ``async_op=True``. ``algorithm``: "auto" (recursive
        doubling up to 128 KiB, above it "hierarchical" when the ranks run on several hosts and
        some host runs several, else ring), "ring", "recursive_doubling", "hierarchical"
        (reduce-scatter inside each host, a ring per local rank between hosts, all-gather
        inside each host: :mod:`bitcoll.algorithms.hierarchical`; every rank gets the same
        bits, which differ from the ring's only by the order of the additions; avg divides
        the sum by ``size`` on every rank; bfloat16 moves as float32 and is rounded once at
        the end), "native" (MPI's own,
        MPI backend only; not float16: UsageError; MPI's collectives carry no bitcoll frame
        headers, so a mismatch across ranks is caught only where MPI itself checks).
        bfloat16 (torch tensors) is reduced in float32 and rounded once to bfloat16 (to
        nearest, ties to even) at each block's owner; the ring's reduce-scatter moves float32,
        its all-gather bfloat16.

        Over MPI, an all-reduce of at most ``record_bytes - 16`` bytes (496 bytes up to 16
        ranks, fewer above: :func:`bitcoll.transport.mpi.record_bytes`; not bfloat16) travels
        inside the argument check every collective over MPI starts with, and each rank reduces
        the gathered vectors itself in rank order (:mod:`bitcoll.algorithms.allreduce_gathered`):
        one MPI collective in all, every rank the same bits, float16 included. This is the
        default (``algorithm`` left at "auto"); forcing an algorithm turns it off. Larger ones,
        up to :data:`NATIVE_ALLREDUCE_MAX_BYTES`, are the check then MPI's own all-reduce: a
        persistent MPI collective once the same ``x`` and ``out`` come again on every rank,
        which then keeps references to those two arrays (at most 64 such pairs per
        communicator, and until :meth:`close`; numpy refuses to resize them in place).

        Example, 2 ranks: rank 0 ``x=[1, 2]``, rank 1 ``x=[3, 4]`` → both get ``[4, 6]``.
        """
        if self._plans_on and not async_op and algorithm is None and type(x) is np.ndarray:
            done = self._fast_allreduce(x, op, out, timeout)
            if done is not None:
                return done
        with self._validating("allreduce"):
            rop = parse_op(op)
            v = intake(x)
            vec = v.flat
            if not v.bf16:
                check_dtype(vec.dtype, rop)
            res, flat = output(out, vec.size, vec.dtype, v.shape, bf16=v.bf16)
            algo = self._algorithm("allreduce", algorithm, "")
            if not algo:
                algo = self._auto_allreduce(vec.dtype, vec.size, v.bf16, rop)
            hosts = self._hosts() if algo == "hierarchical" else ()
            if algo == "native" and vec.dtype == np.float16:
                raise UsageError("algorithm='native' cannot reduce float16 (MPI has no float16 "
                                 "reduction); leave algorithm at its default",
                                 argument="algorithm")
            inplace = in_place(flat, vec)

        def body(ctx: OpContext) -> Any:
            if v.bf16:
                wide = _widened(ctx, vec)  # read before anything is written (out may be x)
                if algo == "ring":
                    allreduce_ring_narrowed(ctx, wide, rop, flat, _narrow)
                    return res
                if algo == "hierarchical":
                    allreduce_hierarchical(ctx, wide, rop, hosts)
                elif algo == "native":
                    self._native_allreduce(ctx, wide, wide, rop)
                else:
                    allreduce_recursive_doubling(ctx, wide, rop)
                _narrow(wide, flat)
                return res
            if algo == "ring":
                # Out of place, the ring reads x directly: no copy of the input.
                allreduce_ring(ctx, flat, rop, src=None if inplace else vec)
                return res
            if algo == "hierarchical":
                allreduce_hierarchical(ctx, flat, rop, hosts, src=None if inplace else vec)
                return res
            if algo == "native":
                self._native_allreduce(ctx, vec, flat, rop)
                return res
            if algo == "inline":
                plan = self._mpi_plan(vec.dtype, vec.size, rop)
                assert plan is not None and plan.mpi is not None  # "auto" chose inline
                self._planned(plan, vec, flat, inplace, ctx)
                return res
            if not inplace:
                np.copyto(flat, vec)
            allreduce_recursive_doubling(ctx, flat, rop)
            return res

        return self.run("allreduce", (rop.value, v.label, vec.size, algo), body,
                        async_op, timeout, checks_itself=algo == "inline")

    def _mpi_plan(self, dtype: np.dtype[Any], size: int, op: ReduceOp) -> _Plan | None:
        """Over MPI with several ranks, the default all-reduce of ``size`` elements of
        ``dtype`` (a supported dtype, valid with ``op``; not bfloat16) when it is one of MPI's
        own: "inline" while the vector fits the argument check's records, "native" up to
        :data:`NATIVE_ALLREDUCE_MAX_BYTES` when MPI reduces the dtype. None otherwise (a
        bitcoll algorithm, or not MPI). Cached per arguments."""
        if self._nt is None or not self._plans_on:
            return None
        key = (dtype, size, op)
        plans = self._mpi_plans
        if key in plans:
            return plans[key]
        nt = self._native_t()
        nbytes = dtype.itemsize * size
        mpi_op = "sum" if op is ReduceOp.AVG else op.value
        plan = None
        if nbytes <= nt.record_bytes - 16:
            fields = (op.value, dtype.str, size, "inline")
            rows = nt.record_payloads[:, :nbytes].view(dtype)
            sig = signature("allreduce", *fields)
            plan = _Plan(fields, sig, op, _inline_allreduce(
                nt.prepared_records(nbytes), sig, GatheredReduce(rows, op)))
        elif nbytes <= NATIVE_ALLREDUCE_MAX_BYTES and nt.reducible(dtype, mpi_op):
            fields = (op.value, dtype.str, size, "native")
            sig = signature("allreduce", *fields)
            divisor = np.asarray(self.size, dtype=dtype) if op is ReduceOp.AVG else None
            plan = _Plan(fields, sig, op, _checked_native(
                nt.prepared_checked_allreduce(dtype, size, mpi_op), sig, divisor))
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = plan
        return plan

    def _fast_allreduce(self, x: Array, op: object, out: object, timeout: float | None) -> Any:
        """:meth:`allreduce`'s fast path: a synchronous call on a C-contiguous numpy ``x``
        whose default algorithm is one of MPI's own (:meth:`_mpi_plan`), recursive doubling
        or the ring (not the two-level algorithm), with a numpy ``out`` of the right kind or
        none. Same semantics, frames and signature as the general path without its validation
        closures: over MPI the argument check (carrying ``x`` when inline), then the local
        reduction, MPI's all-reduce or bitcoll's algorithm; elsewhere bitcoll's algorithm.
        Returns the result, or None without side effects when the call does not qualify
        (anything unusual: the general path then validates it and reports any error)."""
        # Every line here is paid by every small call: checks are ordered cheapest first.
        dtype = x.dtype
        key = (dtype, x.size, op)
        try:
            plan = self._plans.get(key, _UNPLANNED)
        except TypeError:  # an unhashable op
            return None
        if plan is _UNPLANNED:
            plan = self._fast_plan(key)
        if plan is None or not x.flags.c_contiguous:
            return None
        if out is None:
            res = np.empty_like(x)
        elif type(out) is np.ndarray and out.dtype == dtype and out.size == x.size and \
                (flags := out.flags).c_contiguous and flags.writeable and \
                (out is x or (out.base is None and x.base is None) or
                 not np.may_share_memory(out, x)):
            res = out
        else:
            return None
        if timeout is None:
            limit = self.timeout
        elif type(timeout) in (int, float) and 0 < timeout < math.inf:
            limit = float(timeout)
        else:
            return None
        lock = self._call_lock
        if self._closed or self._agreed_failure is not None or not lock.acquire(False):
            return None
        try:
            last = self._last
            if last is not None:
                if not last.done():
                    return None  # the general path waits for it
                self._last = None
            seq = self._turn()
            mpi = plan.mpi
            if mpi is not None:
                # Over MPI no frames move, so no OpContext; errors as in _execute. The plan's
                # closure is called here directly, on the caller's own arrays (a persistent
                # MPI all-reduce is kept for them): one call level less on the smallest
                # all-reduces, where every call level shows.
                deadline = time.monotonic() + limit
                try:
                    if not mpi(seq, x, res, deadline):
                        self._mismatch(seq, deadline, "allreduce", plan.fields)
                except BaseException as exc:
                    self._failed(exc, "allreduce", seq)
                return res
            xf = x if x.ndim == 1 else x.reshape(-1)
            flat = res if res.ndim == 1 else res.reshape(-1)
            self._execute("allreduce", plan.fields, seq, plan.signature,
                          functools.partial(self._planned, plan, xf, flat, res is x), limit,
                          self._segment_bytes, self._nt is not None)
        finally:
            lock.release()
        return res

    def _planned(self, plan: _Plan, x: Array, flat: Array, inplace: bool,
                 ctx: OpContext) -> None:
        """The body of a planned all-reduce: ``x`` (1-D) reduced into ``flat`` (1-D; the same
        array when ``inplace``) as ``plan`` says: bitcoll's algorithm, or (the general path's
        "inline") the plan's whole all-reduce over MPI; the agreed ProtocolError when its
        argument check finds a mismatch."""
        if plan.mpi is not None:
            if not plan.mpi(ctx.seq, flat if inplace else x, flat, ctx.deadline):
                self._mismatch(ctx.seq, ctx.deadline, "allreduce", plan.fields)
        elif plan.fields[3] == "ring":  # out of place: no copy (see the ring)
            allreduce_ring(ctx, flat, plan.op, src=None if inplace else x)
        else:
            if not inplace:
                np.copyto(flat, x)
            allreduce_recursive_doubling(ctx, flat, plan.op)

    def _fast_plan(self, key: tuple[np.dtype[Any], int, object]) -> _Plan | None:
        """The fast path's plan for its key ``(dtype, count, op as passed)``, cached under that
        key: :meth:`_mpi_plan` over MPI, else the default algorithm when it is recursive
        doubling or the ring (:meth:`_auto_allreduce`). None unless the op is a ReduceOp or
        its name and the dtype is supported and valid with it (the general path reports those
        errors)."""
        dtype, size, op = key
        rop = _FAST_OPS.get(op)
        plan = None
        if rop is not None and dtype in SUPPORTED_DTYPES and \
                (rop is not ReduceOp.AVG or dtype in FLOAT_DTYPES):
            plan = self._mpi_plan(dtype, size, rop)
            algo = self._auto_allreduce(dtype, size, False, rop) if plan is None else ""
            if algo in ("recursive_doubling", "ring"):
                fields = (rop.value, dtype.str, size, algo)
                plan = _Plan(fields, signature("allreduce", *fields), rop)
        if len(self._plans) >= _PLANS_MAX:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _auto_allreduce(self, dtype: np.dtype[Any], size: int, bf16: bool, op: ReduceOp
                        ) -> str:
        """The default all-reduce algorithm for ``size`` elements of ``dtype`` (bfloat16: the
        uint16 bits and ``bf16``; identical on every rank that passes the same arguments):
        over MPI, "inline" while the vector fits the argument check's records (not bfloat16),
        then MPI's own up to :data:`NATIVE_ALLREDUCE_MAX_BYTES` when MPI reduces the dtype (not
        bfloat16, not float16), else the cheapest of recursive doubling, the ring and (ranks on
        several hosts, some with several) "hierarchical" by the cost model
        (:func:`bitcoll.plan.choose`)."""
        plan = None if bf16 else self._mpi_plan(dtype, size, op)
        if plan is not None:
            return str(plan.fields[3])
        return choose("allreduce", self._model, self.plan_group,
                      Call(nbytes=(4 if bf16 else dtype.itemsize) * size,
                           segment_bytes=self._segment_bytes))

    def _native_t(self) -> NativeCollectives:
        """The transport's own collectives (``_algorithm`` allowed "native" only with them)."""
        assert self._nt is not None
        return self._nt

    def _native_allreduce(self, ctx: OpContext, src: Array, dst: Array, op: ReduceOp) -> None:
        """MPI's all-reduce of ``src`` into ``dst`` (may be ``src``: in place); avg divides
        the sum by ``size``."""
        native = self._native_t().native_allreduce
        mpi_op = "sum" if op is ReduceOp.AVG else op.value
        native(src, dst, mpi_op, ctx.deadline)
        if op is ReduceOp.AVG:
            np.divide(dst, np.asarray(self.size, dtype=dst.dtype), out=dst)

    @overload
    def reduce_scatter(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                       out: HostArray | None = None, *, async_op: Literal[False] = False,
                       timeout: float | None = None, algorithm: str | None = None) -> HostArray: ...
    @overload
    def reduce_scatter(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                       out: HostArray | None = None, *, async_op: Literal[True],
                       timeout: float | None = None, algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def reduce_scatter(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                       out: HostArray | None = None, *, async_op: bool,
                       timeout: float | None = None, algorithm: str | None = None) -> Any: ...
    def reduce_scatter(self, x: HostArray, op: ReduceOp | str = ReduceOp.SUM,
                       out: HostArray | None = None, *, async_op: bool = False,
                       timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Reduce ``x`` over ranks and give rank ``r`` only block ``r`` of
        ``bitcoll.partition(x.size, size)`` (the first ``n mod p`` ranks get one element more).

        Returns ``out`` (1-D, ``stop_r - start_r`` elements, dtype of ``x``) or a Work.
        ``algorithm``: "auto"/"ring", or "native" (MPI backend). bfloat16 is reduced in
        float32 and rounded once, as in :meth:`allreduce`.
        """
        with self._validating("reduce_scatter"):
            rop = parse_op(op)
            v = intake(x)
            vec = v.flat
            if not v.bf16:
                check_dtype(vec.dtype, rop)
            start, stop = block(vec.size, self.size, self.rank)
            res, flat = output(out, stop - start, vec.dtype, bf16=v.bf16)
            algo = self._algorithm("reduce_scatter", algorithm, "ring")

        def body(ctx: OpContext) -> Any:
            src = _widened(ctx, vec) if v.bf16 else vec
            if algo == "native":
                bounds = block_bounds(vec.size, self.size)
                counts = [b - a for a, b in itertools.pairwise(bounds)]
                native = self._native_t().native_reduce_scatter
                dst = np.empty(stop - start, src.dtype) if v.bf16 else flat
                native(src, dst, counts, "sum" if rop is ReduceOp.AVG else rop.value,
                       ctx.deadline)
                if rop is ReduceOp.AVG:
                    np.divide(dst, np.asarray(self.size, dtype=dst.dtype), out=dst)
                if v.bf16:
                    _narrow(dst, flat)
                return res
            if v.bf16:
                # The widened copy is this rank's own: reduce it in place.
                reduce_scatter_ring(ctx, src, rop)
                _narrow(src[start:stop], flat)
                return res
            # The input is read where it is; partial sums go to a reused work buffer.
            work = ctx.scratch(Slot.RS_PARTIAL, vec.size, vec.dtype)
            reduce_scatter_ring(ctx, work, rop, src=vec)
            np.copyto(flat, work[start:stop])
            return res

        return self.run("reduce_scatter", (rop.value, v.label, vec.size, algo), body,
                        async_op, timeout)

    @overload
    def allgather(self, x: HostArray, out: HostArray | None = None, *,
                  async_op: Literal[False] = False,
                  timeout: float | None = None, algorithm: str | None = None) -> HostArray: ...
    @overload
    def allgather(self, x: HostArray, out: HostArray | None = None, *, async_op: Literal[True],
                  timeout: float | None = None, algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def allgather(self, x: HostArray, out: HostArray | None = None, *, async_op: bool,
                  timeout: float | None = None, algorithm: str | None = None) -> Any: ...
    def allgather(self, x: HostArray, out: HostArray | None = None, *, async_op: bool = False,
                  timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Concatenate every rank's ``x`` (same length and dtype on every rank) in rank order.

        Returns ``out`` (1-D, ``size * x.size`` elements) or a Work. Rank ``j``'s data is
        ``out[j * x.size:(j + 1) * x.size]`` on every rank. ``algorithm``: "auto" (over MPI,
        an ``x`` that fits the argument check's records travels inside it, as in
        :meth:`allreduce`: one MPI collective; else the cost model's choice,
        :func:`bitcoll.plan.choose`: where the ring's passes go frame by frame, as between
        ranks of a host that share memory, "bruck" (``ceil(log2 size)`` rounds) on one host
        at every size and across hosts for small outputs, else "ring"; where the transport
        streams the ring's passes, "ring"), "ring", "bruck"
        (:mod:`bitcoll.algorithms.allgather_bruck`), "native" (MPI backend).
        """
        with self._validating("allgather"):
            v = intake(x)
            vec = v.flat
            m, p = vec.size, self.size
            res, flat = output(out, m * p, vec.dtype, bf16=v.bf16)
            algo = self._algorithm("allgather", algorithm, "")
            if not algo:
                algo = "inline" if vec.nbytes <= self._record_room() else \
                    self._auto_allgather(vec.nbytes * p)
        fields = (v.label, m, algo)

        def body(ctx: OpContext) -> Any:
            if algo == "native":
                native = self._native_t().native_allgather
                native(vec, flat, ctx.deadline)
                return res
            if algo == "inline":
                rows = self._exchange(ctx.seq, ctx.signature, vec.data.cast("B"), ctx.deadline,
                                      "allgather", fields)
                np.copyto(flat.reshape(p, m), rows[:, :vec.nbytes].view(vec.dtype))
                return res
            np.copyto(flat[self.rank * m:(self.rank + 1) * m], vec)
            if algo == "bruck":
                allgather_bruck(ctx, flat, m)
            else:
                allgather_ring(ctx, flat, [j * m for j in range(p + 1)])
            return res

        return self.run("allgather", fields, body, async_op, timeout,
                        checks_itself=algo == "inline")

    def _auto_allgather(self, nbytes: int) -> str:
        """The default all-gather algorithm for an output of ``nbytes`` (the same on every rank
        that passes the same arguments): the cost model's cheaper of "bruck" and "ring",
        cached per size."""
        algo = self._allgather_algos.get(nbytes)
        if algo is None:
            algo = choose("allgather", self._model, self.plan_group,
                          Call(nbytes=nbytes, segment_bytes=self._segment_bytes))
            if len(self._allgather_algos) >= _PLANS_MAX:
                self._allgather_algos.clear()
            self._allgather_algos[nbytes] = algo
        return algo

    def _record_room(self) -> int:
        """Payload bytes of the argument check's records (MPI, several ranks), else -1: a
        collective whose data fits travels inside the check (algorithm "inline")."""
        nt = self._nt
        return nt.record_bytes - 16 if nt is not None and self.size > 1 else -1

    @overload
    def broadcast(self, x: HostArray, root: int = 0, *, async_op: Literal[False] = False,
                  timeout: float | None = None, algorithm: str | None = None) -> HostArray: ...
    @overload
    def broadcast(self, x: HostArray, root: int = 0, *, async_op: Literal[True],
                  timeout: float | None = None, algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def broadcast(self, x: HostArray, root: int = 0, *, async_op: bool,
                  timeout: float | None = None, algorithm: str | None = None) -> Any: ...
    def broadcast(self, x: HostArray, root: int = 0, *, async_op: bool = False,
                  timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Copy the root's ``x`` into ``x`` on every rank, in place (``x`` must be C-contiguous
        and writeable everywhere). Returns ``x`` or a Work.

        Every rank must pass the same ``root``: the roots are compared first (over TCP one small
        all-reduce; over MPI the argument check), and a mismatch is a ProtocolError on every
        rank. ``algorithm``: "auto" (over MPI, an ``x`` that fits the argument check's records
        travels inside the root's record: one MPI collective; else "tree"), "tree", "native"
        (MPI backend)."""
        with self._validating("broadcast"):
            arr, bf16 = to_numpy(x, "x")
            _, flat = output(x, arr.size, arr.dtype, name="x", bf16=bf16)
            if not bf16:
                check_dtype(flat.dtype)
            if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or \
                    not 0 <= root < self.size:
                raise UsageError(f"root must be a rank in [0, {self.size}), got {root!r}",
                                 argument="root")
            algo = self._algorithm("broadcast", algorithm,
                                   "inline" if flat.nbytes <= self._record_room() else "tree")
        checked = self._nt is not None and self.size > 1
        fields: tuple[object, ...] = (BFLOAT16 if bf16 else flat.dtype.str, flat.size, algo)
        if checked:  # over MPI the argument check compares the roots
            fields += (int(root),)

        def body(ctx: OpContext) -> Any:
            if not checked:
                # Over TCP the root is not in the signature: compared across ranks first.
                _check_same_root(ctx, int(root))
            if algo == "native":
                native = self._native_t().native_bcast
                native(flat, int(root), ctx.deadline)
            elif algo == "inline":
                mine = flat.data.cast("B") if self.rank == root else None
                rows = self._exchange(ctx.seq, ctx.signature, mine, ctx.deadline, "broadcast",
                                      fields)
                if self.rank != root:
                    np.copyto(flat, rows[int(root), :flat.nbytes].view(flat.dtype))
            else:
                broadcast_tree(ctx, flat, int(root))
            return x

        return self.run("broadcast", fields, body, async_op, timeout,
                        checks_itself=algo == "inline")

    @overload
    def alltoall(self, x: HostArray, out: HostArray | None = None, *,
                 async_op: Literal[False] = False,
                 timeout: float | None = None, algorithm: str | None = None) -> HostArray: ...
    @overload
    def alltoall(self, x: HostArray, out: HostArray | None = None, *, async_op: Literal[True],
                 timeout: float | None = None, algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def alltoall(self, x: HostArray, out: HostArray | None = None, *, async_op: bool,
                 timeout: float | None = None, algorithm: str | None = None) -> Any: ...
    def alltoall(self, x: HostArray, out: HostArray | None = None, *, async_op: bool = False,
                 timeout: float | None = None, algorithm: str | None = None) -> Any:
        """All-to-all exchange: ``x`` holds ``size`` equal blocks; block ``j`` goes to rank
        ``j`` and lands there as block ``rank``. ``x.size`` must be a multiple of ``size``.
        Returns ``out`` (1-D, ``x.size`` elements) or a Work. ``out=x`` exchanges in place
        (through a copy of ``x``); an ``out`` overlapping ``x`` otherwise is a UsageError."""
        with self._validating("alltoall"):
            v = intake(x)
            vec = v.flat
            if vec.size % self.size:
                raise UsageError(f"alltoall needs a length divisible by the world size "
                                 f"{self.size}, got {vec.size}", argument="x")
            res, flat = output(out, vec.size, vec.dtype, bf16=v.bf16)
            algo = self._algorithm("alltoall", algorithm, "direct")
            inplace = in_place(flat, vec)

        def body(ctx: OpContext) -> Any:
            # In place, the blocks are read from a copy: the exchange overwrites them.
            src = vec.copy() if inplace else vec
            if algo == "native":
                native = self._native_t().native_alltoall
                native(src, flat, ctx.deadline)
            else:
                alltoall_direct(ctx, src, flat)
            return res

        return self.run("alltoall", (v.label, vec.size, algo), body, async_op, timeout)

    @overload
    def barrier(self, *, async_op: Literal[False] = False, timeout: float | None = None,
                algorithm: str | None = None) -> None: ...
    @overload
    def barrier(self, *, async_op: Literal[True], timeout: float | None = None,
                algorithm: str | None = None) -> Work[None]: ...
    @overload
    def barrier(self, *, async_op: bool, timeout: float | None = None,
                algorithm: str | None = None) -> Any: ...
    def barrier(self, *, async_op: bool = False, timeout: float | None = None,
                algorithm: str | None = None) -> Any:
        """Return once every rank has entered the barrier (or a Work).

        ``algorithm``: "auto" ("native" over MPI, else "dissemination"), "dissemination"
        (bitcoll frames, log2(size) rounds), "native" (MPI backend: the argument check every
        collective over MPI starts with is itself an all-gather that no rank leaves before
        every rank entered it, so the barrier is that one MPI collective)."""
        with self._validating("barrier"):
            algo = self._algorithm("barrier", algorithm,
                                   "native" if self._nt is not None else "dissemination")

        def body(ctx: OpContext) -> None:
            if algo == "native":
                if ctx.size == 1:
                    self._native_t().native_barrier(ctx.deadline)
                # else the argument check before this body was the barrier
            else:
                barrier_dissemination(ctx)

        return self.run("barrier", (algo,), body, async_op, timeout)

    def split(self, color: int | None, key: int | None = None, *,
              timeout: float | None = None) -> Communicator | None:
        """A new communicator over the ranks that pass the same ``color`` (torch's
        ``new_group`` / MPI's ``Comm_split``).

        Collective: every rank of this communicator calls it. ``color``: an integer >= 0, or
        None to stay out (this rank gets None). ``key`` (an integer, default this rank)
        orders the ranks of the new communicator, ties broken by rank here. The new
        communicator has its own connections (TCP) or MPI communicator, sequence numbers,
        ``stats``, ``majority_calls`` and ``close()``; it inherits ``timeout`` and the segment
        sizes. Collectives on sibling sub-communicators may run at the same time from
        different threads, and interleave with this communicator's, without mixing frames.
        Closing this communicator does not close its sub-communicators.

        Raises UsageError for a color that is not a non-negative integer (or None) or a key
        that is not an integer (its peers get PeerLostError); CommError like any collective.

        Example, 4 ranks: ``sub = comm.split(comm.rank % 2)``: ranks 0 and 2 form one
        2-rank communicator (ranks 0 and 1 in it), ranks 1 and 3 another.
        """
        with self._validating("split"):
            if color is not None and (isinstance(color, bool) or
                                      not isinstance(color, (int, np.integer)) or color < 0):
                raise UsageError(f"split color must be an integer >= 0 or None, got "
                                 f"{color!r}", argument="color")
            if key is None:
                key = self.rank
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
                raise UsageError(f"split key must be an integer, got {key!r}", argument="key")
            limit = self.timeout if timeout is None else _check_timeout(timeout)
        mine = np.array([-1 if color is None else int(color), int(key), self.rank], np.int64)
        table = self.allgather(mine, timeout=limit).reshape(self.size, 3)
        with self._lock:
            k = self._splits
            self._splits += 1
        if color is None:
            return None
        members = sorted((r for r in range(self.size) if table[r, 0] == color),
                         key=lambda r: (int(table[r, 1]), r))
        try:
            transport = self._transport.subgroup(members, f"{k}/{int(color)}", limit)
        except BitcollError as exc:
            if self.size > 1 and self._transport.failure is None:
                self._transport.abort(f"split failed on rank {self.rank}: {exc}")
            raise
        topo = None if self._topology is None else \
            self._topology.subset(members, members.index(self.rank))
        return Communicator(transport, timeout=self.timeout, segment_bytes=self.segment_bytes,
                            packed_segment_bytes=self.packed_segment_bytes, topology=topo,
                            two_level=self._two_level_on, cost_model=self._model,
                            shm=self._shm)

    # ------------------------------------------------------------------ packed-bit collectives
    def _packed(self, name: str, x: Any, codec_args: tuple[str, str, int], out: Any,
                out_dtype: np.dtype[Any], gather: bool, tie: str, async_op: bool,
                timeout: float | None, algorithm: str | None) -> Any:
        """Shared front of the four packed collectives on values (see :meth:`sign_allreduce`)."""
        kind, source, levels = codec_args
        with self._validating(name):
            ops = tuple(op for op, src in CODECS if src == source)
            if kind not in ops:
                raise UsageError(f"{name} op must be {' or '.join(map(repr, ops))}, got "
                                 f"{kind!r}", argument="op")
            arr, bf16 = to_numpy(x, "x")
            allowed = SIGN_DTYPES if source == "sign" else INT_DTYPES
            if bf16 or arr.dtype not in allowed:
                names = ", ".join(sorted(d.name for d in allowed))
                raise UsageError(f"{name} takes {names} input, got {type_name(arr, bf16)}",
                                 argument="x" if source == "sign" else "q")
            vec = np.ascontiguousarray(arr).reshape(-1)
            n = vec.size
            lo, hi = (0, n) if gather else block(n, self.size, self.rank)
            shape = arr.shape if gather else (hi - lo,)
            res, flat = output(out, hi - lo, out_dtype, shape,
                               accept=INT_DTYPES if kind != "majority" else ())
            bound = levels * self.size
            if kind == "sum" and bound > np.iinfo(flat.dtype).max:
                raise UsageError(f"out dtype {flat.dtype} cannot hold sums up to {bound} "
                                 f"(levels {levels} x {self.size} ranks)", argument="out")
            codec, algo, seg = self._packed_codec(kind, source, levels, tie, algorithm, False,
                                                  n, gather)

        def check() -> None:
            # Over several ranks the codec's packing pass checks [-levels, levels] (every
            # algorithm encodes every element before a peer can complete); one rank copies.
            if source == "int" and n and self.size == 1 and \
                    (vec.min() < -levels or vec.max() > levels):
                bad = int(np.argmax((vec < -levels) | (vec > levels)))
                raise UsageError(f"{name}: value {int(vec[bad])} at index {bad} is "
                                 f"outside [-{levels}, {levels}]", argument="q", index=bad)

        fields = (kind, source, levels, tie, vec.dtype.str, n, algo, gather, seg)
        return self._run_packed(name, fields, codec, algo, seg, vec, flat, res, n, gather,
                                check, async_op, timeout)

    def _packed_codec(self, kind: str, source: str, levels: int, tie: str,
                      algorithm: str | None, packed_io: bool, count: int, gather: bool
                      ) -> tuple[VoteCodec, str, int]:
        """The tie rule and algorithm checked, the majority call counted: the call's codec,
        algorithm and segment bytes (the last step of a packed collective's validation)."""
        if tie not in TIE_RULES:
            raise UsageError(f"unknown tie rule {tie!r}; expected one of "
                             f"{', '.join(TIE_RULES)}", argument="tie")
        widths = make_codec(kind, source, levels, self.size, packed_io=packed_io)
        forced = self._algorithm("packed", algorithm, "")
        algo, seg = self._packed_choice(count, widths.w_in, widths.w_out, gather, packed_io,
                                        forced)
        tie_call = 0
        if kind == "majority":
            with self._lock:
                tie_call = self._majority_calls
                self._majority_calls += 1
        codec = make_codec(kind, source, levels, self.size, TIES[tie], tie_call, packed_io)
        return codec, algo, seg

    def _packed_choice(self, count: int, w_in: int, w_out: int, gather: bool,
                       packed_io: bool, forced: str = "") -> tuple[str, int]:
        """The planner's algorithm (:func:`bitcoll.plan.choose`; ``forced``: that one) and
        its segment bytes (``packed_segment_bytes``, or :func:`bitcoll.plan.segment_for`'s
        where that is None) for a packed collective, cached per arguments (the cache is
        emptied when the model or the topology changes)."""
        key = (count, w_in, w_out, gather, packed_io, self._packed_segment_bytes, forced)
        hit = self._packed_plans.get(key)
        if hit is None:
            call = Call(count=count, w_in=w_in, w_out=w_out, gather=gather,
                        packed_io=packed_io, segment_bytes=self._packed_segment_bytes or 0)
            algo = forced or choose("packed", self._model, self.plan_group, call)
            hit = algo, segment_for("packed", algo, self._model, self.plan_group, call)
            if len(self._packed_plans) >= _PLANS_MAX:
                self._packed_plans.clear()
            self._packed_plans[key] = hit
        return hit

    def _run_packed(self, name: str, fields: tuple[object, ...], codec: VoteCodec, algo: str,
                    seg: int, vec: Array, flat: Array, res: Any, n: int, gather: bool,
                    check: Callable[[], None], async_op: bool, timeout: float | None) -> Any:
        """Run a validated packed collective: ``check()`` (the input's range, a UsageError
        on this rank), then the algorithm, which reads ``vec`` and writes ``flat`` through
        ``codec`` (values or packed streams alike)."""
        run_algo: Callable[..., None]
        if algo == "hierarchical":
            run_algo = functools.partial(packed_hierarchical, hosts=self._hosts())
        else:
            run_algo = {"direct": packed_direct, "ring": packed_ring,
                        "allgather": packed_allgather}[algo]

        def body(ctx: OpContext) -> Any:
            check()
            if codec.packed_out and flat.size:
                flat[-1] = 0  # the padding bits: decoding writes only the results' bits
            if ctx.size == 1:
                codec.local(vec, flat, n)
            else:
                run_algo(ctx, codec, vec, flat, gather, n)
            return res

        return self.run(name, fields, body, async_op, timeout, packed=seg)

    def _fast_packed(self, name: str, x: Array, op: object, tie: object, out: object,
                     timeout: float | None, gather: bool) -> Any:
        """The sign collectives' fast path (:meth:`sign_allreduce`,
        :meth:`sign_reduce_scatter`; modelled on :meth:`_fast_allreduce`): a synchronous call
        on a C-contiguous numpy ``x`` of several ranks whose default algorithm is a flat one,
        with a numpy ``out`` of the default dtype or none. What the general path works out
        from the arguments (codec class, algorithm, frame signature, output size) is cached
        per (collective, op, tie, dtype, count); the call itself counts the majority call and
        runs the algorithm through :meth:`_execute`, so frames, signature, the tie counter
        and failure handling are the general path's. Returns the result, or None without
        side effects when the call does not qualify (the general path then validates it and
        reports any error)."""
        key = (name, op, tie, x.dtype, x.size, gather, self._packed_segment_bytes)
        try:
            plan = self._fast_packed_plans.get(key, _UNPLANNED)
        except TypeError:  # an unhashable op or tie
            return None
        if plan is _UNPLANNED:
            plan = self._fast_packed_plan(key)
        if plan is None or not x.flags.c_contiguous:
            return None
        if out is None:
            res = np.empty(x.shape if gather else plan.out_size, plan.out_dtype)
        elif type(out) is np.ndarray and out.dtype == plan.out_dtype and \
                out.size == plan.out_size and (flags := out.flags).c_contiguous and \
                flags.writeable:
            res = out
        else:
            return None
        if timeout is None:
            limit = self.timeout
        elif type(timeout) in (int, float) and 0 < timeout < math.inf:
            limit = float(timeout)
        else:
            return None
        if self._closed or self._agreed_failure is not None or \
                not self._call_lock.acquire(blocking=False):
            return None
        try:
            last = self._last
            if last is not None:
                if not last.done():
                    return None  # the general path waits for it
                self._last = None
            tie_call = 0
            if plan.majority:
                with self._lock:
                    tie_call = self._majority_calls
                    self._majority_calls += 1
            seq = self._turn()
            codec = plan.codecs[tie_call & 1]
            xf = x if x.ndim == 1 else x.reshape(-1)
            flat = res if res.ndim == 1 else res.reshape(-1)
            self._execute(name, plan.fields, seq, plan.signature,
                          functools.partial(plan.run, codec=codec, x=xf, out=flat,
                                            gather=gather, n=xf.size),
                          limit, plan.segment, self._nt is not None)
        finally:
            self._call_lock.release()
        return res

    def _fast_packed_plan(self, key: tuple[object, ...]) -> _PackedPlan | None:
        """The plan of :meth:`_fast_packed` for its key ``(name, op, tie, dtype, count,
        gather, packed segment bytes)``, cached under that key: None unless op, tie and
        dtype are valid and the default algorithm is a flat one (the two-level algorithm
        needs the hosts: the general path)."""
        name, op, tie, dtype, n, gather = key[:6]
        plan = None
        if isinstance(op, str) and isinstance(tie, str) and isinstance(dtype, np.dtype) and \
                isinstance(n, int) and (op, "sign") in CODECS and tie in TIE_RULES and \
                dtype in SIGN_DTYPES:
            codec_cls = CODECS[op, "sign"]
            widths = codec_cls(1, self.size)
            algo, seg = self._packed_choice(n, widths.w_in, widths.w_out, bool(gather), False)
            run = _FLAT_PACKED.get(algo)
            if algo == "allgather" and codec_cls.majority and gather and \
                    n < PARALLEL_MIN_ELEMENTS:
                # Its kernels prepared for this shape: no argument checks per call.
                run = PreparedMajority(self.size, n, dtype, np.dtype(np.int8))
            if run is not None:
                lo, hi = (0, n) if gather else block(n, self.size, self.rank)
                fields = (op, "sign", 1, tie, dtype.str, n, algo, bool(gather), seg)
                # The tie rule reads only the parity of the call counter: one codec per parity.
                codecs = (codec_cls(1, self.size, TIES[tie], 0),
                          codec_cls(1, self.size, TIES[tie], 1))
                plan = _PackedPlan(fields, signature(str(name), *fields), codecs, run,
                                   np.dtype(np.int32 if op == "sum" else np.int8), hi - lo,
                                   codec_cls.majority, seg)
        if len(self._fast_packed_plans) >= _PLANS_MAX:
            self._fast_packed_plans.clear()
        self._fast_packed_plans[key] = plan
        return plan

    def _packed_io(self, name: str, data: Any, arg: str, count: int, kind: str, levels: int,
                   tie: str, out: Any, gather: bool, async_op: bool, timeout: float | None,
                   algorithm: str | None) -> Any:
        """Shared front of the four collectives on packed streams (see
        :meth:`packed_sign_allreduce`)."""
        with self._validating(name):
            n = _count(count)
            vec = packed_stream(data, arg)
            w_in = 1 if kind == "majority" else field_width(levels)
            w_out = 1 if kind == "majority" else field_width(levels * self.size)
            need = (n * w_in + 7) // 8
            if vec.size != need:
                raise UsageError(f"{arg} must hold exactly ceil({n} * {w_in} / 8) = {need} "
                                 f"bytes for count {n}, got {vec.size}", argument=arg)
            lo, hi = (0, n) if gather else block(n, self.size, self.rank)
            res, flat = output(out, ((hi - lo) * w_out + 7) // 8, np.dtype(np.uint8))
            if flat.size and vec.size and np.shares_memory(flat, vec):
                raise UsageError(f"out overlaps {arg}; pass a separate array", argument="out")
            codec, algo, seg = self._packed_codec(kind, "int" if kind == "sum" else "sign",
                                                  levels, tie, algorithm, True, n, gather)

        def check() -> None:
            if kind != "sum" or not n:
                return
            from . import kernels

            bad = kernels.first_field_above(vec, n, w_in, 2 * levels)
            if bad >= 0:
                field = int.from_bytes(kernels.extract_bits(vec, bad * w_in, w_in).tobytes(),
                                       "little")
                raise UsageError(f"{name}: field {bad} of {arg} is {field}, outside [0, "
                                 f"{2 * levels}] (fields hold value + {levels}, values lie "
                                 f"in [-{levels}, {levels}])", argument=arg, index=bad)

        fields = (kind, levels, tie, "packed", n, algo, gather, seg)
        return self._run_packed(name, fields, codec, algo, seg, vec, flat, res, n, gather,
                                check, async_op, timeout)

    @overload
    def sign_allreduce(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                       out: HostArray | None = None, *, async_op: Literal[False] = False,
                       timeout: float | None = None, algorithm: str | None = None) -> HostArray: ...
    @overload
    def sign_allreduce(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                       out: HostArray | None = None, *, async_op: Literal[True],
                       timeout: float | None = None, algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def sign_allreduce(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                       out: HostArray | None = None, *, async_op: bool,
                       timeout: float | None = None, algorithm: str | None = None) -> Any: ...
    def sign_allreduce(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                       out: HostArray | None = None, *, async_op: bool = False,
                       timeout: float | None = None, algorithm: str | None = None) -> Any:
        """All-reduce of the signs of ``x`` (float16/32/64, any shape, read flattened).

        * ``op="majority"``: returns int8 +-1 (shape of ``x``), identical on every rank: the
          majority of the ranks' votes, where ``x > 0`` votes +1, ``x < 0`` votes -1 and
          ``x == 0`` (either zero) votes +1 (a 1-bit code cannot carry 0). Ties (even world
          size) follow ``tie``: "positive" (+1), "negative" (-1) or "alternate" (a tie at
          element ``i`` on the ``k``-th majority call of this communicator, counting from 0,
          gives +1 if ``i + k`` is even, else -1).
        * ``op="sum"``: returns the exact sum over ranks of ``sign(x)`` with ``sign(0) = 0``,
          int32 by default (``out`` may be int8/16/32/64 if it holds ``+-size``).
        * ``op="sign"``: returns the sign of that exact sum, int8 in {-1, 0, 1} (``out``: any
          integer dtype); the owners send back 2-bit signs instead of the sums' bits.

        NaN in ``x`` raises UsageError naming its index (found while packing, which overlaps
        the sends: the peers get PeerLostError, and no rank returns a result).
        ``algorithm``: "auto" (default: the cheapest by the cost model, :mod:`bitcoll.plan`:
        typically "allgather" for small vectors, where its ``ceil(log2 size)`` rounds of one
        message beat two pipelined phases,
        "direct" for large ones, "hierarchical" when the ranks run on several hosts and some
        host runs several), "direct"
        (bandwidth-optimal direct-exchange reduce-scatter of packed bits, aggregation at each
        block's owner, all-gather of the packed result, pipelined in segments), "ring"
        (partial counts forwarded round a ring), "allgather" (every rank gathers every rank's
        bits, by Bruck's all-gather, and votes locally; the Distributed Lion baseline),
        "hierarchical" (two levels:
        the votes are counted inside each host through shared memory, the local ranks of all
        hosts exchange their slice's counts at ``ceil(log2(g + 1))`` bits (``g``: ranks on
        the host; sums: ``ceil(log2(2 g L + 1))``) by direct exchange and all-gather the
        result, which each host then all-gathers inside: the exact majority or sum over all
        ranks, bit for bit the result of "direct"; see
        :mod:`bitcoll.algorithms.hierarchical`). Bytes sent per rank by "direct" for
        majority: about ``2 (p - 1) / p * n / 8`` plus headers.

        Example, 3 ranks with ``x = [1., -2.]``, ``[-1., -1.]``, ``[3., 0.]``: majority gives
        ``[1, -1]`` and sum gives ``[1, -2]`` on every rank.
        """
        if self._plans_on and not async_op and algorithm is None and type(x) is np.ndarray:
            done = self._fast_packed("sign_allreduce", x, op, tie, out, timeout, True)
            if done is not None:
                return done
        return self._packed("sign_allreduce", x, (op, "sign", 1), out,
                            np.dtype(np.int32 if op == "sum" else np.int8), True, tie,
                            async_op, timeout, algorithm)

    @overload
    def sign_reduce_scatter(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                            out: HostArray | None = None, *, async_op: Literal[False] = False,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> HostArray: ...
    @overload
    def sign_reduce_scatter(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                            out: HostArray | None = None, *, async_op: Literal[True],
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def sign_reduce_scatter(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                            out: HostArray | None = None, *, async_op: bool,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Any: ...
    def sign_reduce_scatter(self, x: HostArray, op: str = "majority", tie: str = "alternate",
                            out: HostArray | None = None, *, async_op: bool = False,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Any:
        """:meth:`sign_allreduce`, but rank ``r`` receives only block ``r`` of
        ``bitcoll.partition(x.size, size)`` (1-D). Tie indices are global element indices."""
        if self._plans_on and not async_op and algorithm is None and type(x) is np.ndarray:
            done = self._fast_packed("sign_reduce_scatter", x, op, tie, out, timeout, False)
            if done is not None:
                return done
        return self._packed("sign_reduce_scatter", x, (op, "sign", 1), out,
                            np.dtype(np.int32 if op == "sum" else np.int8), False, tie,
                            async_op, timeout, algorithm)

    def _levels(self, levels: object) -> int:
        if not isinstance(levels, (int, np.integer)) or isinstance(levels, bool) or levels < 1:
            raise UsageError(f"levels must be an integer >= 1, got {levels!r}", argument="levels")
        if int(levels) * self.size > MAX_SUM_RANGE:
            raise UsageError(f"levels * size = {int(levels) * self.size} exceeds "
                             f"{MAX_SUM_RANGE} (16-bit result fields)", argument="levels")
        return int(levels)

    @overload
    def quantized_allreduce(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                            op: str = "sum", async_op: Literal[False] = False,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> HostArray: ...
    @overload
    def quantized_allreduce(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                            op: str = "sum", async_op: Literal[True],
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def quantized_allreduce(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                            op: str = "sum", async_op: bool,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Any: ...
    def quantized_allreduce(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                            op: str = "sum", async_op: bool = False,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Any:
        """Exact sum over ranks of integers ``q`` (int8/16/32/64) in ``[-levels, levels]``,
        or its sign.

        Each element travels as a ``ceil(log2(2 levels + 1))``-bit field to its block's
        owner, which sums exactly. ``op="sum"``: the owner all-gathers the sums as
        ``ceil(log2(2 levels size + 1))``-bit fields; returns int32 (shape of ``q``; ``out``
        may be any integer dtype that holds ``+-levels * size``). ``op="sign"``: the owner
        all-gathers only ``sign(sum)`` in {-1, 0, 1}, as 2-bit fields (the all-gather moves
        ``2 / ceil(log2(2 levels size + 1))`` of the bytes); returns int8 (``out``: any
        integer dtype). A value outside the range raises UsageError naming one such element
        (found in the packing pass; its peers get PeerLostError). ``algorithm`` as in
        :meth:`sign_allreduce`. Requires ``levels * size <= 32767``.
        """
        with self._validating("quantized_allreduce"):
            lv = self._levels(levels)
        return self._packed("quantized_allreduce", q, (op, "int", lv), out,
                            np.dtype(np.int8 if op == "sign" else np.int32), True, "alternate",
                            async_op, timeout, algorithm)

    @overload
    def quantized_reduce_scatter(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                                 op: str = "sum", async_op: Literal[False] = False,
                                 timeout: float | None = None,
                                 algorithm: str | None = None) -> HostArray: ...
    @overload
    def quantized_reduce_scatter(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                                 op: str = "sum", async_op: Literal[True],
                                 timeout: float | None = None,
                                 algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def quantized_reduce_scatter(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                                 op: str = "sum", async_op: bool,
                                 timeout: float | None = None,
                                 algorithm: str | None = None) -> Any: ...
    def quantized_reduce_scatter(self, q: HostArray, levels: int, out: HostArray | None = None, *,
                                 op: str = "sum", async_op: bool = False,
                                 timeout: float | None = None,
                                 algorithm: str | None = None) -> Any:
        """:meth:`quantized_allreduce`, but rank ``r`` receives only block ``r`` of
        ``bitcoll.partition(q.size, size)`` (1-D)."""
        with self._validating("quantized_reduce_scatter"):
            lv = self._levels(levels)
        return self._packed("quantized_reduce_scatter", q, (op, "int", lv), out,
                            np.dtype(np.int8 if op == "sign" else np.int32), False,
                            "alternate", async_op, timeout, algorithm)

    # ------------------------------------------------------------------ packed input and output
    @overload
    def packed_sign_allreduce(self, bits: HostArray, count: int, tie: str = "alternate",
                              out: HostArray | None = None, *, async_op: Literal[False] = False,
                              timeout: float | None = None,
                              algorithm: str | None = None) -> HostArray: ...
    @overload
    def packed_sign_allreduce(self, bits: HostArray, count: int, tie: str = "alternate",
                              out: HostArray | None = None, *, async_op: Literal[True],
                              timeout: float | None = None,
                              algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def packed_sign_allreduce(self, bits: HostArray, count: int, tie: str = "alternate",
                              out: HostArray | None = None, *, async_op: bool,
                              timeout: float | None = None,
                              algorithm: str | None = None) -> Any: ...
    def packed_sign_allreduce(self, bits: HostArray, count: int, tie: str = "alternate",
                              out: HostArray | None = None, *, async_op: bool = False,
                              timeout: float | None = None,
                              algorithm: str | None = None) -> Any:
        """Majority vote over ranks of ``count`` packed sign votes: :meth:`sign_allreduce`
        (op "majority") for callers that pack and unpack the votes themselves (a GPU kernel,
        another framework), without bitcoll's packing and unpacking passes.

        ``bits``: uint8, C-contiguous, exactly ``ceil(count / 8)`` bytes (any shape, read
        flattened); vote ``i`` is bit ``i % 8`` of byte ``i // 8`` (1 votes +1, 0 votes -1:
        :func:`bitcoll.layout.pack_signs`). The padding bits after vote ``count - 1`` are
        ignored. Returns ``out`` (uint8, ``ceil(count / 8)`` bytes, written in place) or a new
        1-D uint8 array: bit ``i`` is the majority at element ``i`` (1 = +1), ties by
        ``tie`` exactly as in :meth:`sign_allreduce` (this call counts in
        ``majority_calls``), padding bits 0; identical on every rank, and bit for bit
        ``pack_signs`` of what :meth:`sign_allreduce` returns for the same votes. Same
        algorithms and bytes on the wire. ``out`` must not overlap ``bits``.
        """
        return self._packed_io("packed_sign_allreduce", bits, "bits", count, "majority", 1,
                               tie, out, True, async_op, timeout, algorithm)

    @overload
    def packed_sign_reduce_scatter(self, bits: HostArray, count: int, tie: str = "alternate",
                                   out: HostArray | None = None, *,
                                   async_op: Literal[False] = False,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> HostArray: ...
    @overload
    def packed_sign_reduce_scatter(self, bits: HostArray, count: int, tie: str = "alternate",
                                   out: HostArray | None = None, *, async_op: Literal[True],
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def packed_sign_reduce_scatter(self, bits: HostArray, count: int, tie: str = "alternate",
                                   out: HostArray | None = None, *, async_op: bool,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Any: ...
    def packed_sign_reduce_scatter(self, bits: HostArray, count: int, tie: str = "alternate",
                                   out: HostArray | None = None, *, async_op: bool = False,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Any:
        """:meth:`packed_sign_allreduce`, but rank ``r`` receives only the majority bits of
        block ``r`` of ``bitcoll.partition(count, size)``, ``[start, stop)``: uint8
        ``ceil((stop - start) / 8)`` bytes, element ``start`` at bit 0, padding bits 0. Tie
        indices are global element indices."""
        return self._packed_io("packed_sign_reduce_scatter", bits, "bits", count, "majority",
                               1, tie, out, False, async_op, timeout, algorithm)

    @overload
    def packed_quantized_allreduce(self, fields: HostArray, count: int, levels: int,
                                   out: HostArray | None = None, *,
                                   async_op: Literal[False] = False,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> HostArray: ...
    @overload
    def packed_quantized_allreduce(self, fields: HostArray, count: int, levels: int,
                                   out: HostArray | None = None, *, async_op: Literal[True],
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def packed_quantized_allreduce(self, fields: HostArray, count: int, levels: int,
                                   out: HostArray | None = None, *, async_op: bool,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Any: ...
    def packed_quantized_allreduce(self, fields: HostArray, count: int, levels: int,
                                   out: HostArray | None = None, *, async_op: bool = False,
                                   timeout: float | None = None,
                                   algorithm: str | None = None) -> Any:
        """Exact sum over ranks of ``count`` packed integers in ``[-levels, levels]``:
        :meth:`quantized_allreduce` for callers that pack and unpack themselves.

        ``fields``: uint8, C-contiguous, exactly ``ceil(count * w_in / 8)`` bytes with
        ``w_in = ceil(log2(2 levels + 1))``: value ``i`` is stored as the unsigned field
        ``value + levels`` at stream bits ``[i w_in, (i + 1) w_in)``, least significant bit
        first, stream bit ``j`` being bit ``j % 8`` of byte ``j // 8``
        (:func:`bitcoll.layout.pack_fields`). Padding bits are ignored; a field above
        ``2 levels`` is a UsageError on this rank (its peers get PeerLostError). Returns
        ``out`` (uint8, written in place) or a new 1-D uint8 array of
        ``ceil(count * w_out / 8)`` bytes, ``w_out = ceil(log2(2 levels size + 1))``: sum
        ``i`` as the field ``sum + levels * size`` at bits ``[i w_out, (i + 1) w_out)``,
        padding bits 0; identical on every rank. Requires ``levels * size <= 32767``.
        ``out`` must not overlap ``fields``.
        """
        with self._validating("packed_quantized_allreduce"):
            lv = self._levels(levels)
        return self._packed_io("packed_quantized_allreduce", fields, "fields", count, "sum",
                               lv, "alternate", out, True, async_op, timeout, algorithm)

    @overload
    def packed_quantized_reduce_scatter(self, fields: HostArray, count: int, levels: int,
                                        out: HostArray | None = None, *,
                                        async_op: Literal[False] = False,
                                        timeout: float | None = None,
                                        algorithm: str | None = None) -> HostArray: ...
    @overload
    def packed_quantized_reduce_scatter(self, fields: HostArray, count: int, levels: int,
                                        out: HostArray | None = None, *, async_op: Literal[True],
                                        timeout: float | None = None,
                                        algorithm: str | None = None) -> Work[Any]: ...
    @overload
    def packed_quantized_reduce_scatter(self, fields: HostArray, count: int, levels: int,
                                        out: HostArray | None = None, *, async_op: bool,
                                        timeout: float | None = None,
                                        algorithm: str | None = None) -> Any: ...
    def packed_quantized_reduce_scatter(self, fields: HostArray, count: int, levels: int,
                                        out: HostArray | None = None, *, async_op: bool = False,
                                        timeout: float | None = None,
                                        algorithm: str | None = None) -> Any:
        """:meth:`packed_quantized_allreduce`, but rank ``r`` receives only the sums of block
        ``r`` of ``bitcoll.partition(count, size)``, ``[start, stop)``: uint8
        ``ceil((stop - start) * w_out / 8)`` bytes, element ``start`` at bit 0."""
        with self._validating("packed_quantized_reduce_scatter"):
            lv = self._levels(levels)
        return self._packed_io("packed_quantized_reduce_scatter", fields, "fields", count,
                               "sum", lv, "alternate", out, False, async_op, timeout,
                               algorithm)


class _Plan(NamedTuple):
    """A synchronous all-reduce's plan: over MPI's own collectives
    (:meth:`Communicator._mpi_plan`), or bitcoll's recursive doubling or ring
    (:meth:`Communicator._fast_plan`)."""

    fields: tuple[object, ...]
    """The call's signature fields: op, element type, count, algorithm ("inline", "native",
    "recursive_doubling" or "ring")."""
    signature: int
    """``signature("allreduce", *fields)``."""
    op: ReduceOp
    """The reduction."""
    mpi: Callable[[int, Array, Array, float], bool] | None = None
    """Over MPI ("inline" and "native"): the whole all-reduce #``seq`` of ``x`` into ``out``,
    argument check included, ``run(seq, x, out, deadline)``: :func:`_inline_allreduce` or
    :func:`_checked_native`. Else None."""


def _inline_allreduce(records: Callable[[int, int, bytes | memoryview, float], bool], sig: int,
                      reduce: GatheredReduce) -> Callable[[int, Array, Array, float], bool]:
    """The whole "inline" all-reduce #``seq`` of ``x`` into ``out`` (C-contiguous, the plan's
    dtype and count, any shape; ``out`` may be ``x`` or share its memory: ``x`` is read before
    anything is written): the argument check carrying ``x``'s bytes, then the local reduction
    of the gathered vectors. Returns False, having written nothing, when the records disagree;
    errors as the records exchange."""
    reduce_into = reduce.run

    def run(seq: int, x: Array, out: Array, deadline: float) -> bool:
        if not records(seq, sig, x.tobytes(), deadline):
            return False
        reduce_into(out if out.ndim == 1 else out.reshape(-1))
        return True
    return run


def _checked_native(checked: Callable[[int, int, Array, Array, float], bool], sig: int,
                      divisor: Array | None) -> Callable[[int, Array, Array, float], bool]:
    """The whole "native" all-reduce #``seq`` of ``x`` into ``out`` (C-contiguous, the plan's
    dtype and count, any shape; ``out is x`` in place, else not overlapping): the transport's
    argument check then MPI's all-reduce
    (:meth:`~bitcoll.transport.base.NativeCollectives.prepared_checked_allreduce`), then
    avg's division by ``divisor`` (else None). Returns False, having written nothing, when
    the records disagree; errors as the transport's."""
    def run(seq: int, x: Array, out: Array, deadline: float) -> bool:
        return checked(seq, sig, x, out, deadline)

    if divisor is None:
        return run
    by = divisor

    def run_avg(seq: int, x: Array, out: Array, deadline: float) -> bool:
        if not checked(seq, sig, x, out, deadline):
            return False
        np.divide(out, by, out=out)
        return True
    return run_avg


class _PackedPlan(NamedTuple):
    """A synchronous sign collective's plan (:meth:`Communicator._fast_packed_plan`)."""

    fields: tuple[object, ...]
    """The call's signature fields, as :meth:`Communicator._packed` makes them."""
    signature: int
    """``signature(name, *fields)``."""
    codecs: tuple[VoteCodec, VoteCodec]
    """The codec for an even and an odd majority call counter (the tie rule alternates with
    the counter's parity, nothing else of it is read: :data:`bitcoll.kernels.TIE_ALTERNATE`);
    codecs are immutable, so the plan keeps them."""
    run: Callable[..., None]
    """The algorithm, a flat one (:data:`_FLAT_PACKED`)."""
    out_dtype: np.dtype[Any]
    """The default output dtype: int8 for majority, int32 for sums."""
    out_size: int
    """Elements of this rank's output."""
    majority: bool
    """Whether the call counts as a majority call (the tie counter)."""
    segment: int
    """The pipeline's segment bytes (:meth:`Communicator._packed_choice`)."""


#: The packed algorithms that need nothing but the call (not the hosts).
_FLAT_PACKED: dict[str, Callable[..., None]] = {
    "direct": packed_direct, "ring": packed_ring, "allgather": packed_allgather}

_UNPLANNED: Any = object()  # a key not in the plan cache yet

#: Most cached all-reduce plans per communicator (one per dtype, count and op in use).
_PLANS_MAX = 256

#: The ops the all-reduce fast path takes as given (anything else goes through parse_op).
_FAST_OPS: dict[object, ReduceOp] = {**{o: o for o in ReduceOp}, **{o.value: o for o in ReduceOp}}


def _check_same_root(ctx: OpContext, root: int) -> None:
    """ProtocolError on every rank unless every rank passed ``root`` (a max all-reduce of
    ``(root, -root)``: every rank sees the same extremes)."""
    if ctx.size == 1:
        return
    probe = np.array([root, -root], dtype=np.int64)
    allreduce_recursive_doubling(ctx, probe, ReduceOp.MAX)
    hi, lo = int(probe[0]), -int(probe[1])
    if hi != lo:
        exc = ProtocolError(mismatch_text("broadcast", ctx.seq, ("root",),
                                          f" (from {lo} to {hi}; this rank passed {root})"),
                            rank=ctx.rank, sequence=ctx.seq, collective="broadcast",
                            fields=("root",))
        AGREED.add(exc)
        raise exc


def _check_timeout(timeout: float) -> float:
    if not isinstance(timeout, (int, float)) or not timeout > 0 or math.isnan(timeout):
        raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}",
                         argument="timeout")
    return float(timeout)


def _check_segment(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise UsageError(f"{name} must be a positive number of bytes, got {value!r}",
                         argument=name)
    return int(value)
