"""The public ``Communicator``: validation, algorithm choice, ordering, failure handling.

Every collective is called by every rank of the world in the same order with matching
arguments (same op, dtype, length, algorithm, root). Mismatches are detected from the frame
headers and raise :class:`~bitcoll.errors.ProtocolError` on the rank that sees them and
:class:`~bitcoll.errors.PeerLostError` on the others (the communicator is then aborted).

Arrays: numpy arrays in and out. An input of any shape is read as its flattened (C order)
view; a non-contiguous input is copied first. An ``out`` array must have the documented
dtype and number of elements, be C-contiguous and writeable, else
:class:`~bitcoll.errors.UsageError`. Inputs must not be modified, and outputs not read, until
the collective has completed (for ``async_op=True``: until ``Work.wait`` returned).

Every collective takes ``timeout`` (seconds, default: the communicator's) and
``async_op=True`` (returns a :class:`~bitcoll.work.Work`). Collectives run one at a time in
call order; a synchronous call first waits for pending asynchronous ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .algorithms.allgather_ring import allgather_ring
from .algorithms.allreduce_recursive_doubling import allreduce_recursive_doubling
from .algorithms.allreduce_ring import allreduce_ring, reduce_scatter_ring
from .algorithms.alltoall_direct import alltoall_direct
from .algorithms.barrier_dissemination import barrier_dissemination
from .algorithms.broadcast_tree import broadcast_tree
from .algorithms.context import OpContext
from .config import DEFAULT_TIMEOUT
from .errors import BitcollError, CommError, PeerLostError, ProtocolError, UsageError
from .ops import ReduceOp, check_dtype, parse_op
from .partition import block, block_bounds
from .transport.base import TrafficStats, Transport
from .work import Work

__all__ = ["Communicator", "DEFAULT_TIMEOUT", "DEFAULT_SEGMENT_BYTES",
           "DEFAULT_PACKED_SEGMENT_BYTES", "SMALL_MESSAGE_BYTES"]

T = TypeVar("T")
Array = npt.NDArray[Any]

#: Payload size of one wire segment in the pipelined algorithms.
DEFAULT_SEGMENT_BYTES = 32 << 20
"""Wire segment of the dense ring algorithms. Per-segment costs (a frame, thread hand-offs,
a reduction call, cache misses) dominate on fast links: in interleaved runs (best of 3) of
64-256 MiB all-reduces, 32 MiB segments were 0-20% faster than 8 MiB ones on loopback with 2
and 4 ranks, 12-15% faster on 10 Gbit testbed links and faster over MPI; 1-4 MiB segments were
slower still. Blocks of at most 32 MiB (all-reduces up to 64 MiB on 2 ranks, 128 MiB on 4)
move as one segment per ring step."""
DEFAULT_PACKED_SEGMENT_BYTES = 1 << 20
"""Wire segment of the packed-bit pipelines: 1 MiB of packed signs is 8M elements, so a
64M-element sign all-reduce on 4 ranks packs, counts and decodes in 2 segments per block."""
#: At or below this many bytes the dense all-reduce uses recursive doubling (latency-bound).
SMALL_MESSAGE_BYTES = 64 << 10

_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "ring", "recursive_doubling", "native"),
    "reduce_scatter": ("auto", "ring", "native"),
    "allgather": ("auto", "ring", "native"),
    "broadcast": ("auto", "tree", "native"),
    "alltoall": ("auto", "direct", "native"),
    "barrier": ("auto", "dissemination", "native"),
    "packed": ("auto", "direct", "ring", "allgather"),
}
#: The MPI transport's method behind algorithm="native" of each collective.
_NATIVE = {"allreduce": "native_allreduce", "reduce_scatter": "native_reduce_scatter",
           "allgather": "native_allgather", "broadcast": "native_bcast",
           "alltoall": "native_alltoall", "barrier": "native_barrier", "packed": "-"}
TIE_RULES = ("positive", "negative", "alternate")
SIGN_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
INT_DTYPES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))
#: Largest ``levels * size`` of the exact-sum collectives (16-bit result fields).
MAX_SUM_RANGE = (1 << 15) - 1


def as_vector(x: object, name: str = "x") -> Array:
    """Return the 1-D C-contiguous view (or copy) of the numpy array ``x``; check its dtype."""
    if not isinstance(x, np.ndarray):
        raise UsageError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    check_dtype(x.dtype)
    return np.ascontiguousarray(x).reshape(-1)


def in_place(flat: Array, vec: Array) -> bool:
    """True when the output ``flat`` is the input ``vec`` itself; UsageError when they overlap
    otherwise (the result would depend on the algorithm's order of reads and writes)."""
    if not np.shares_memory(flat, vec):
        return False
    if flat.__array_interface__["data"][0] == vec.__array_interface__["data"][0] and \
            flat.size == vec.size and flat.strides == vec.strides:
        return True
    raise UsageError("out overlaps x without being x; pass out=x to reduce in place or a "
                     "separate array")


def output(out: object, size: int, dtype: np.dtype[Any], shape: tuple[int, ...] | None = None,
           name: str = "out") -> tuple[Array, Array]:
    """Validate or allocate an output; return (array as the user sees it, its 1-D view)."""
    if out is None:
        arr = np.empty(shape if shape is not None else (size,), dtype=dtype)
        return arr, arr.reshape(-1)
    if not isinstance(out, np.ndarray):
        raise UsageError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != dtype:
        raise UsageError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.size != size:
        raise UsageError(f"{name} has {out.size} elements, expected {size}")
    if not out.flags.c_contiguous:
        raise UsageError(f"{name} must be C-contiguous so that it can be written in place")
    if not out.flags.writeable:
        raise UsageError(f"{name} is read-only")
    return out, out.reshape(-1)


def signature(*fields: object) -> int:
    """32-bit digest of a collective's name and arguments, carried in every frame header."""
    return zlib.crc32(repr(fields).encode())


class Communicator:
    """A group of ``size`` ranks that run collectives together.

    Create one with :func:`bitcoll.init`. Attributes: ``rank`` (0-based), ``size``,
    ``backend`` ("local", "tcp" or "mpi"), ``stats`` (:class:`TrafficStats`: bytes and
    messages this rank handed to / took from its transport, headers included; ``reset()``
    zeroes them), ``timeout`` (default deadline in seconds), ``segment_bytes`` (wire segment
    size of the dense ring algorithms) and ``packed_segment_bytes`` (wire segment size of the
    packed-bit pipelines). Every rank must use the same segment sizes (frames of different
    lengths fail the collective with ProtocolError).
    """

    def __init__(self, transport: Transport, timeout: float = DEFAULT_TIMEOUT,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 packed_segment_bytes: int = DEFAULT_PACKED_SEGMENT_BYTES) -> None:
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
        self._call_owner = ""
        self._splits = 0  # split() calls so far: names the sub-groups' namespaces
        self._agreed_failure: CommError | None = None  # see _AgreedError

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
        """Bytes and messages sent and received by this rank since init (or ``reset()``)."""
        return self._transport.stats

    @property
    def majority_calls(self) -> int:
        """Majority collectives started so far on this communicator: the ``k`` of the
        "alternate" tie rule for the next one."""
        return self._majority_calls

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

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ machinery
    def _check_usable(self) -> None:
        if self._closed:
            raise UsageError("the communicator is closed")
        failure = self._transport.failure or self._agreed_failure
        if failure is not None:
            cls = PeerLostError if isinstance(failure, PeerLostError) else CommError
            raise cls(f"the communicator was aborted: {failure}") from failure

    @contextlib.contextmanager
    def _validating(self, name: str) -> Iterator[None]:
        """Argument checks of a collective: a UsageError on one rank aborts the communicator
        so that its peers fail at once instead of waiting for their deadline."""
        self._check_usable()
        try:
            yield
        except UsageError as exc:
            if self.size > 1 and self._transport.failure is None:
                self._transport.abort(f"UsageError in {name} on rank {self.rank}: {exc}")
            raise

    def _drain(self) -> None:
        last = self._last
        if last is not None:
            cf.wait([last])

    def _algorithm(self, collective: str, algorithm: str | None, auto: str) -> str:
        choices = _ALGORITHMS[collective]
        name = "auto" if algorithm is None else algorithm
        if name not in choices:
            raise UsageError(f"unknown algorithm {algorithm!r} for {collective}; "
                             f"expected one of {', '.join(choices)}")
        if name == "native" and not hasattr(self._transport, _NATIVE[collective]):
            raise UsageError(f"algorithm 'native' needs the MPI backend (this is {self.backend})")
        return auto if name == "auto" else name

    @property
    def segment_bytes(self) -> int:
        """Wire segment size in bytes of the dense ring algorithms (>= 1)."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        self._segment_bytes = _check_segment("segment_bytes", value)

    @property
    def packed_segment_bytes(self) -> int:
        """Wire segment size in bytes of the packed-bit pipelines (>= 1)."""
        return self._packed_segment_bytes

    @packed_segment_bytes.setter
    def packed_segment_bytes(self, value: int) -> None:
        self._packed_segment_bytes = _check_segment("packed_segment_bytes", value)

    def run(self, name: str, fields: tuple[object, ...], body: Callable[[OpContext], T],
            async_op: bool, timeout: float | None, packed: bool = False) -> T | Work[T]:
        """Run one collective: assign its sequence number, then execute ``body`` now or on the
        worker thread. Any error aborts the communicator (every peer fails fast) unless the
        world has one rank. Public for the packed-bit collectives and extensions.
        ``packed``: the context's segment size is ``packed_segment_bytes`` instead of
        ``segment_bytes``."""
        self._check_usable()
        limit = self.timeout if timeout is None else _check_timeout(timeout)
        if not self._call_lock.acquire(blocking=False):
            self._concurrent_call(name)
        try:
            return self._run_locked(name, fields, body, async_op, limit, packed)
        finally:
            self._call_lock.release()

    def _concurrent_call(self, name: str) -> None:
        """A second thread called a collective while one is inside another: refuse it (and
        abort, so that no rank pairs frames of two different calls)."""
        owner = self._call_owner
        msg = (f"{name} called from thread {threading.current_thread().name!r} while thread "
               f"{owner!r} is inside a collective on this communicator; collectives of one "
               "communicator must be called by one thread at a time, in the same order on "
               "every rank (give each thread its own communicator: comm.split(0))")
        if self.size > 1 and self._transport.failure is None:
            self._transport.abort(f"UsageError on rank {self.rank}: {msg}")
        raise UsageError(msg)

    def _run_locked(self, name: str, fields: tuple[object, ...],
                    body: Callable[[OpContext], T], async_op: bool, limit: float,
                    packed: bool) -> T | Work[T]:
        self._call_owner = threading.current_thread().name
        with self._lock:
            seq = self._seq
            self._seq += 1
        sig = signature(name, *fields)

        def execute() -> T:
            self._check_usable()
            seg = self._packed_segment_bytes if packed else self._segment_bytes
            ctx = OpContext(self._transport, seq, sig, time.monotonic() + limit, seg,
                            self._scratch)
            try:
                return body(ctx)
            except BaseException as exc:
                if isinstance(exc, CommError) and exc in _AGREED:
                    # Every rank found the same problem from the same data and raises it
                    # itself: no abort notice (it could overtake a peer's last frame).
                    self._agreed_failure = exc
                    raise
                if self.size > 1 and self._transport.failure is None:
                    self._transport.abort(f"{type(exc).__name__} in {name} #{seq} on rank "
                                          f"{self.rank}: {exc}")
                raise

        if async_op:
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="bitcoll")
            fut = self._executor.submit(execute)
            self._last = fut
            return Work(fut, f"{name} #{seq}")
        self._drain()
        return execute()

    # ------------------------------------------------------------------ dense collectives
    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, out: Array | None = None,
                  *, async_op: bool = False, timeout: float | None = None,
                  algorithm: str | None = None) -> Any:
        """Element-wise reduction of ``x`` over all ranks; every rank gets the same bits.

        ``x``: any supported dtype and shape (read flattened). ``op``: "sum", "avg" (floating
        dtypes only), "max", "min". Returns ``out`` (same dtype and shape as ``x``; ``out=x``
        reduces in place), or a Work with ``async_op=True``. ``algorithm``: "auto" (recursive
        doubling up to 64 KiB, ring above), "ring", "recursive_doubling", "native" (MPI's
        own, MPI backend only).

        Example, 2 ranks: rank 0 ``x=[1, 2]``, rank 1 ``x=[3, 4]`` → both get ``[4, 6]``.
        """
        with self._validating("allreduce"):
            rop = parse_op(op)
            vec = as_vector(x)
            check_dtype(vec.dtype, rop)
            res, flat = output(out, vec.size, vec.dtype, x.shape)
            auto = "recursive_doubling" if vec.nbytes <= SMALL_MESSAGE_BYTES else "ring"
            algo = self._algorithm("allreduce", algorithm, auto)

            inplace = in_place(flat, vec)

        def body(ctx: OpContext) -> Array:
            if algo == "ring":
                # Out of place, the ring reads x directly: no copy of the input.
                allreduce_ring(ctx, flat, rop, src=None if inplace else vec)
                return res
            if not inplace:
                np.copyto(flat, vec)
            if algo == "native":
                self._native_allreduce(ctx, flat, rop)
            else:
                allreduce_recursive_doubling(ctx, flat, rop)
            return res

        return self.run("allreduce", (rop.value, vec.dtype.str, vec.size, algo), body,
                        async_op, timeout)

    def _native(self, method: str) -> Any:
        """A native-collective method of the MPI transport (checked by ``_algorithm``)."""
        return getattr(self._transport, method)

    def _native_allreduce(self, ctx: OpContext, flat: Array, op: ReduceOp) -> None:
        native = self._native("native_allreduce")
        mpi_op = "sum" if op is ReduceOp.AVG else op.value
        native(flat.copy(), flat, mpi_op, ctx.deadline)
        if op is ReduceOp.AVG:
            np.divide(flat, np.asarray(self.size, dtype=flat.dtype), out=flat)

    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM,
                       out: Array | None = None, *, async_op: bool = False,
                       timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Reduce ``x`` over ranks and give rank ``r`` only block ``r`` of
        ``bitcoll.partition(x.size, size)`` (the first ``n mod p`` ranks get one element more).

        Returns ``out`` (1-D, ``stop_r - start_r`` elements, dtype of ``x``) or a Work.
        ``algorithm``: "auto"/"ring", or "native" (MPI backend).
        """
        with self._validating("reduce_scatter"):
            rop = parse_op(op)
            vec = as_vector(x)
            check_dtype(vec.dtype, rop)
            start, stop = block(vec.size, self.size, self.rank)
            res, flat = output(out, stop - start, vec.dtype)
            algo = self._algorithm("reduce_scatter", algorithm, "ring")

        def body(ctx: OpContext) -> Array:
            if algo == "native":
                bounds = block_bounds(vec.size, self.size)
                counts = [int(c) for c in np.diff(bounds)]
                native = self._native("native_reduce_scatter")
                native(vec, flat, counts, "sum" if rop is ReduceOp.AVG else rop.value,
                       ctx.deadline)
                if rop is ReduceOp.AVG:
                    np.divide(flat, np.asarray(self.size, dtype=flat.dtype), out=flat)
                return res
            # The input is read where it is; partial sums go to a reused work buffer.
            work = ctx.scratch(2, vec.size, vec.dtype)
            reduce_scatter_ring(ctx, work, rop, src=vec)
            np.copyto(flat, work[start:stop])
            return res

        return self.run("reduce_scatter", (rop.value, vec.dtype.str, vec.size, algo), body,
                        async_op, timeout)

    def allgather(self, x: Array, out: Array | None = None, *, async_op: bool = False,
                  timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Concatenate every rank's ``x`` (same length and dtype on every rank) in rank order.

        Returns ``out`` (1-D, ``size * x.size`` elements) or a Work. Rank ``j``'s data is
        ``out[j * x.size:(j + 1) * x.size]`` on every rank.
        """
        with self._validating("allgather"):
            vec = as_vector(x)
            m, p = vec.size, self.size
            res, flat = output(out, m * p, vec.dtype)
            algo = self._algorithm("allgather", algorithm, "ring")

        def body(ctx: OpContext) -> Array:
            if algo == "native":
                native = self._native("native_allgather")
                native(vec, flat, ctx.deadline)
                return res
            np.copyto(flat[self.rank * m:(self.rank + 1) * m], vec)
            allgather_ring(ctx, flat, [j * m for j in range(p + 1)])
            return res

        return self.run("allgather", (vec.dtype.str, m, algo), body, async_op, timeout)

    def broadcast(self, x: Array, root: int = 0, *, async_op: bool = False,
                  timeout: float | None = None, algorithm: str | None = None) -> Any:
        """Copy the root's ``x`` into ``x`` on every rank, in place (``x`` must be C-contiguous
        and writeable everywhere). Returns ``x`` or a Work.

        Every rank must pass the same ``root``: the roots are compared first (one small
        all-reduce), and a mismatch is a ProtocolError on every rank."""
        with self._validating("broadcast"):
            _, flat = output(x, getattr(x, "size", 0),
                             getattr(x, "dtype", np.dtype(np.float32)), name="x")
            check_dtype(flat.dtype)
            if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or \
                    not 0 <= root < self.size:
                raise UsageError(f"root must be a rank in [0, {self.size}), got {root!r}")
            algo = self._algorithm("broadcast", algorithm, "tree")

        def body(ctx: OpContext) -> Array:
            _check_same_root(ctx, int(root))
            if algo == "native":
                native = self._native("native_bcast")
                native(flat, int(root), ctx.deadline)
            else:
                broadcast_tree(ctx, flat, int(root))
            return x

        # The root is not in the signature: _check_same_root compares it across ranks first.
        return self.run("broadcast", (flat.dtype.str, flat.size, algo), body, async_op,
                        timeout)

    def alltoall(self, x: Array, out: Array | None = None, *, async_op: bool = False,
                 timeout: float | None = None, algorithm: str | None = None) -> Any:
        """All-to-all exchange: ``x`` holds ``size`` equal blocks; block ``j`` goes to rank
        ``j`` and lands there as block ``rank``. ``x.size`` must be a multiple of ``size``.
        Returns ``out`` (1-D, ``x.size`` elements) or a Work. ``out=x`` exchanges in place
        (through a copy of ``x``); an ``out`` overlapping ``x`` otherwise is a UsageError."""
        with self._validating("alltoall"):
            vec = as_vector(x)
            if vec.size % self.size:
                raise UsageError(f"alltoall needs a length divisible by the world size "
                                 f"{self.size}, got {vec.size}")
            res, flat = output(out, vec.size, vec.dtype)
            algo = self._algorithm("alltoall", algorithm, "direct")
            inplace = in_place(flat, vec)

        def body(ctx: OpContext) -> Array:
            # In place, the blocks are read from a copy: the exchange overwrites them.
            src = vec.copy() if inplace else vec
            if algo == "native":
                native = self._native("native_alltoall")
                native(src, flat, ctx.deadline)
            else:
                alltoall_direct(ctx, src, flat)
            return res

        return self.run("alltoall", (vec.dtype.str, vec.size, algo), body, async_op, timeout)

    def barrier(self, *, async_op: bool = False, timeout: float | None = None,
                algorithm: str | None = None) -> Any:
        """Return once every rank has entered the barrier (or a Work)."""
        with self._validating("barrier"):
            algo = self._algorithm("barrier", algorithm, "dissemination")

        def body(ctx: OpContext) -> None:
            if algo == "native":
                native = self._native("native_barrier")
                native(ctx.deadline)
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
                                 f"{color!r}")
            if key is None:
                key = self.rank
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
                raise UsageError(f"split key must be an integer, got {key!r}")
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
        return Communicator(transport, timeout=self.timeout, segment_bytes=self.segment_bytes,
                            packed_segment_bytes=self.packed_segment_bytes)

    # ------------------------------------------------------------------ packed-bit collectives
    def _packed(self, name: str, x: Array, codec_args: tuple[str, str, int], out: Array | None,
                out_dtype: np.dtype[Any], gather: bool, tie: str, async_op: bool,
                timeout: float | None, algorithm: str | None) -> Any:
        """Shared front of the four packed collectives (see :meth:`sign_allreduce`)."""
        from .algorithms.sign_allreduce_allgather import packed_allgather
        from .algorithms.sign_allreduce_direct import packed_direct
        from .algorithms.sign_allreduce_ring import packed_ring
        from .algorithms.votes import TIES, VoteCodec

        kind, source, levels = codec_args
        with self._validating(name):
            if kind not in ("majority", "sum"):
                raise UsageError(f"{name} op must be 'majority' or 'sum', got {kind!r}")
            if not isinstance(x, np.ndarray):
                raise UsageError(f"x must be a numpy.ndarray, got {type(x).__name__}")
            allowed = SIGN_DTYPES if source == "sign" else INT_DTYPES
            if x.dtype not in allowed:
                names = ", ".join(sorted(d.name for d in allowed))
                raise UsageError(f"{name} takes {names} input, got {x.dtype}")
            vec = np.ascontiguousarray(x).reshape(-1)
            if tie not in TIE_RULES:
                raise UsageError(f"unknown tie rule {tie!r}; expected one of "
                                 f"{', '.join(TIE_RULES)}")
            n = vec.size
            lo, hi = (0, n) if gather else block(n, self.size, self.rank)
            shape = x.shape if gather else (hi - lo,)
            if out is not None and isinstance(out, np.ndarray) and kind == "sum":
                if out.dtype not in INT_DTYPES:
                    raise UsageError(f"out must have an integer dtype "
                                     f"(int8/16/32/64), got {out.dtype}")
                out_dtype = out.dtype
                bound = levels * self.size
                if bound > np.iinfo(out_dtype).max:
                    raise UsageError(f"out dtype {out_dtype} cannot hold sums up to "
                                     f"{bound} (levels {levels} x {self.size} ranks)")
            res, flat = output(out, hi - lo, out_dtype, shape)
            algo = self._algorithm("packed", algorithm, "direct")
            tie_call = 0
            if kind == "majority":
                with self._lock:
                    tie_call = self._majority_calls
                    self._majority_calls += 1
            codec = VoteCodec(kind, source, levels, self.size, TIES[tie], tie_call)
        run_algo = {"direct": packed_direct, "ring": packed_ring,
                    "allgather": packed_allgather}[algo]

        def body(ctx: OpContext) -> Array:
            if source == "int" and n and (vec.min() < -levels or vec.max() > levels):
                bad = int(np.argmax((vec < -levels) | (vec > levels)))
                raise UsageError(f"{name}: value {int(vec[bad])} at index {bad} is "
                                 f"outside [-{levels}, {levels}]")
            if ctx.size == 1:
                codec.local(vec, flat)
            else:
                run_algo(ctx, codec, vec, flat, gather)
            return res

        fields = (kind, source, levels, tie, vec.dtype.str, n, algo, gather)
        return self.run(name, fields, body, async_op, timeout, packed=True)

    def sign_allreduce(self, x: Array, op: str = "majority", tie: str = "alternate",
                       out: Array | None = None, *, async_op: bool = False,
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

        NaN in ``x`` raises UsageError (found while packing; the peers get PeerLostError).
        ``algorithm``: "direct" (default: bandwidth-optimal direct-exchange reduce-scatter of
        packed bits, aggregation at each block's owner, all-gather of the packed result,
        pipelined in segments), "ring" (partial counts forwarded round a ring), "allgather"
        (every rank gathers every rank's bits and votes locally; the Distributed Lion
        baseline). Bytes sent per rank by "direct" for majority: about
        ``2 (p - 1) / p * n / 8`` plus headers.

        Example, 3 ranks with ``x = [1., -2.]``, ``[-1., -1.]``, ``[3., 0.]``: majority gives
        ``[1, -1]`` and sum gives ``[1, -2]`` on every rank.
        """
        return self._packed("sign_allreduce", x, (op, "sign", 1), out,
                            np.dtype(np.int8 if op == "majority" else np.int32), True, tie,
                            async_op, timeout, algorithm)

    def sign_reduce_scatter(self, x: Array, op: str = "majority", tie: str = "alternate",
                            out: Array | None = None, *, async_op: bool = False,
                            timeout: float | None = None,
                            algorithm: str | None = None) -> Any:
        """:meth:`sign_allreduce`, but rank ``r`` receives only block ``r`` of
        ``bitcoll.partition(x.size, size)`` (1-D). Tie indices are global element indices."""
        return self._packed("sign_reduce_scatter", x, (op, "sign", 1), out,
                            np.dtype(np.int8 if op == "majority" else np.int32), False, tie,
                            async_op, timeout, algorithm)

    def _levels(self, levels: object) -> int:
        if not isinstance(levels, (int, np.integer)) or isinstance(levels, bool) or levels < 1:
            raise UsageError(f"levels must be an integer >= 1, got {levels!r}")
        if int(levels) * self.size > MAX_SUM_RANGE:
            raise UsageError(f"levels * size = {int(levels) * self.size} exceeds "
                             f"{MAX_SUM_RANGE} (16-bit result fields)")
        return int(levels)

    def quantized_allreduce(self, q: Array, levels: int, out: Array | None = None, *,
                            async_op: bool = False, timeout: float | None = None,
                            algorithm: str | None = None) -> Any:
        """Exact sum over ranks of integers ``q`` (int8/16/32/64) in ``[-levels, levels]``.

        Each element travels as a ``ceil(log2(2 levels + 1))``-bit field to its block's
        owner, which sums exactly and all-gathers the sums as
        ``ceil(log2(2 levels size + 1))``-bit fields. Returns int32 (shape of ``q``; ``out``
        may be any integer dtype that holds ``+-levels * size``). A value outside the range
        raises UsageError (its peers get PeerLostError). ``algorithm`` as in
        :meth:`sign_allreduce`. Requires ``levels * size <= 32767``.
        """
        with self._validating("quantized_allreduce"):
            lv = self._levels(levels)
        return self._packed("quantized_allreduce", q, ("sum", "int", lv), out,
                            np.dtype(np.int32), True, "alternate", async_op, timeout,
                            algorithm)

    def quantized_reduce_scatter(self, q: Array, levels: int, out: Array | None = None, *,
                                 async_op: bool = False, timeout: float | None = None,
                                 algorithm: str | None = None) -> Any:
        """:meth:`quantized_allreduce`, but rank ``r`` receives only block ``r`` of
        ``bitcoll.partition(q.size, size)`` (1-D)."""
        with self._validating("quantized_reduce_scatter"):
            lv = self._levels(levels)
        return self._packed("quantized_reduce_scatter", q, ("sum", "int", lv), out,
                            np.dtype(np.int32), False, "alternate", async_op, timeout,
                            algorithm)


#: Errors every rank detects from the same exchanged data (so every rank raises its own);
#: the communicator is then unusable on every rank without an abort notice.
_AGREED: weakref.WeakSet[BaseException] = weakref.WeakSet()


def _check_same_root(ctx: OpContext, root: int) -> None:
    """ProtocolError on every rank unless every rank passed ``root`` (a max all-reduce of
    ``(root, -root)``: every rank sees the same extremes)."""
    if ctx.size == 1:
        return
    probe = np.array([root, -root], dtype=np.int64)
    allreduce_recursive_doubling(ctx, probe, ReduceOp.MAX)
    hi, lo = int(probe[0]), -int(probe[1])
    if hi != lo:
        exc = ProtocolError(f"broadcast called with different roots across ranks (from {lo} "
                            f"to {hi}; this rank passed {root})")
        _AGREED.add(exc)
        raise exc


def _check_timeout(timeout: float) -> float:
    if not isinstance(timeout, (int, float)) or not timeout > 0 or math.isnan(timeout):
        raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _check_segment(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise UsageError(f"{name} must be a positive number of bytes, got {value!r}")
    return int(value)
