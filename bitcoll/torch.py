"""bitcoll as a ``torch.distributed`` backend: ``init_process_group("bitcoll")``.

Importing this module registers the backend ``"bitcoll"`` (for the devices "cpu" and "cuda";
importing it again, or calling :func:`register` again, is harmless)::

    import torch.distributed as dist
    import bitcoll.torch  # noqa: F401  (registers "bitcoll")

    dist.init_process_group("bitcoll")          # env:// (torchrun, python -m launch, srun)
    dist.all_reduce(t)                          # bitcoll's all-reduce, torch's semantics

Every init method works: ``env://`` (the torchrun contract ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``), ``file://``, ``tcp://`` and an explicit ``store=``. The c10d
store serves only the rendezvous: each process group gets its own bitcoll
:class:`~bitcoll.Communicator` (:func:`bitcoll.init` with the group's store, rank and size),
whose data moves over bitcoll's authenticated TCP connections and, between the ranks of one
host, shared memory.

**The job's secret.** bitcoll's peers prove a shared secret to each other
(:mod:`bitcoll.transport.rendezvous.auth`). ``BITCOLL_SECRET`` (set by ``python -m launch``) or
``BITCOLL_INSECURE=1`` in the environment win. Without them: when every rank of the group runs
on one host (the ranks compare their host names through the store), rank 0's private secret
file, as in :func:`bitcoll.init`; when they span hosts, rank 0 draws a fresh random secret per
group and hands it to the others through the c10d store. A c10d store is not authenticated
(anyone who reaches its port can read its keys), so in that case bitcoll's connections are as
well protected as the store itself, no more: set ``BITCOLL_SECRET`` on every rank where that
matters.

**MPI.** Under ``mpiexec`` the data can move over MPI instead: ``BITCOLL_TORCH_TRANSPORT=mpi``
in the environment, or ``init_process_group("bitcoll", pg_options=bitcoll.torch.Options(
transport="mpi"), rank=..., world_size=...)``; torch's ranks must then be the MPI ranks of
``MPI.COMM_WORLD`` (pass ``rank=MPI.COMM_WORLD.rank``; UsageError otherwise). A sub-group is
an MPI communicator made with ``MPI_Comm_create_group`` over its members.

**Threads and order.** A bitcoll communicator refuses calls from two threads at once, while
torch calls a backend from the user's thread and from the autograd thread (DDP's comm hooks).
So every process group owns one worker thread that runs its collectives one at a time in the
order they were issued; each call returns at once with a :class:`BitcollWork` (``wait``,
``is_completed``, ``get_future``: a ``torch.futures.Future`` completed with the output
tensors). A synchronous torch call (``async_op=False``; torch passes ``asyncOp=False`` in its
options) runs on the calling thread at once when no collective of the group is queued or
running, and returns its work finished; behind queued ones it is queued without waking the
worker thread, and the ``wait`` that follows runs it on the waiting thread once it is next
(still one at a time, in issue order): no thread hand-off on that path. A synchronous
``all_reduce`` of one contiguous CPU tensor (float16/32/64, int8-64, uint8) by SUM, AVG, MIN
or MAX is reduced in place through a numpy view, without staging.
Collectives of different groups run on different threads, concurrently. Code that wants to
call the group's :class:`~bitcoll.Communicator` itself (:func:`communicator_of`) while torch
collectives on the group may be in flight uses :func:`submit`, which queues the call behind
them on the same worker.

**Point to point.** bitcoll has no send/recv: its frames belong to collectives that every
rank of a communicator calls in the same order. ``send``/``recv`` (and ``isend``/``irecv``,
``batch_isend_irecv``) therefore use *channels*: one 2-rank communicator per (sender,
receiver, tag), created on first use by both ends through the group's c10d store (the sender
is rank 0 of it, the receiver rank 1), each with its own worker thread. On a channel the
k-th send pairs with the k-th receive, so messages are matched in order per pair and tag, as
torch specifies; a size or dtype that differs between the two ends is a ProtocolError on
both. Channels of one pair in the two directions are independent, so a rank may send to and
receive from the same peer at once (a ring exchange does not deadlock). Each tag in use costs
its own connections; ``recv`` from any source is not supported (ValueError).

**Semantics.** Every collective follows torch's documentation: ``all_reduce`` with every
``ReduceOp`` (SUM, AVG on floating and complex types, MIN and MAX on real types, PRODUCT,
BAND/BOR/BXOR on integers and bool, PREMUL_SUM on floating and complex types; on bool SUM and
MAX are OR, MIN and PRODUCT are AND), ``reduce`` (the result on the root only),
``broadcast``, ``all_gather`` (list, and into one tensor), ``reduce_scatter`` (list, and from
one tensor), ``gather``, ``scatter``, ``all_to_all`` and ``all_to_all_single`` with uneven
splits, ``barrier``, the coalesced forms DDP and FSDP call, the object collectives, and
``new_group``/``new_subgroups``. SUM, AVG, MIN and MAX run as bitcoll's all-reduce (bfloat16
reduced in float32 and rounded once); PRODUCT and the bitwise ops as an all-gather folded in
rank order on every rank (every rank gets the same bits); PREMUL_SUM scales a copy, then
sums; sparse COO tensors are all-reduced with SUM (DDP's sparse embedding gradients: the
ranks' entries gathered and coalesced in rank order on every rank). Dtypes: float64/32/16,
bfloat16, int8-64, uint8-64, bool, complex64/128. Inputs may be
non-contiguous (a contiguous copy is sent and the result copied back) and CUDA tensors are
staged through host memory (copied to the host when the call is issued, results copied back
before the work completes). Inputs must not change, and outputs must not be read, before the
work completes.

**Failures.** ``init_process_group(timeout=...)`` is every collective's deadline (bitcoll's
own: nothing waits longer). A failed collective raises on its ``wait``: ``DistNetworkError``
when a peer was lost (a rank died or aborted), ``DistBackendError`` for a timeout or a
mismatch; the message names this rank, the group and the collective, and the original
bitcoll error is the ``__cause__``. Bad arguments raise ValueError (bitcoll's UsageError)
naming the rank, before the collective starts: the group stays usable when every rank made
the same mistake. When only some ranks did, the others are left in the collective and fail
with a mismatch (or their deadline); the ranks whose checks failed leave a note in the
group's store, and those failures quote it ("rank 1's all_gather_into_tensor failed its
argument check ...: output must have ..."). After a failure every later collective of the
group raises at once.

**Not served by torch's own functions.** ``torch.distributed.monitored_barrier`` accepts
only gloo groups (it raises ValueError for any other backend before reaching the group):
:func:`monitored_barrier` here takes the same arguments and names the ranks that did not
arrive. ``torch.distributed.split_group`` needs the default group bound to an accelerator
(``init_process_group(device_id=...)`` takes no CPU device) and splits the per-device C++
backends of the parent, which a Python process group does not have: use ``new_group``
(``docs/torch-backend.md`` quotes torch's checks). ``recv`` from any source is not served.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore
from torch._C._distributed_c10d import Work as _C10dWork
from torch.futures import Future

from .communicator import Communicator
from .errors import CommError, PeerLostError, UsageError

__all__ = ["BACKEND_NAME", "ENV_TRANSPORT", "Options", "BitcollProcessGroup", "BitcollWork",
           "register", "communicator_of", "submit", "monitored_barrier", "hook_future"]

BACKEND_NAME = "bitcoll"
#: Environment variable choosing the data transport of new groups: "tcp" (default) or "mpi".
ENV_TRANSPORT = "BITCOLL_TORCH_TRANSPORT"
#: How long a group's shutdown waits for its threads to return (seconds, after its queued
#: collectives finished and its communicators closed).
_JOIN_SECONDS = 5.0
#: Store keys of the argument-check notes (:meth:`BitcollProcessGroup._note_usage`).
_NOTES_KEY = "bitcoll/usage/"
#: The most recent notes a failing rank reads, and how long a store request may take then.
_NOTES_READ = 8
_NOTES_SECONDS = 5.0

Array = npt.NDArray[Any]
Job = Callable[[], Any]


@dataclass(frozen=True)
class Options:
    """``pg_options`` of ``init_process_group("bitcoll", pg_options=...)`` and
    ``new_group(..., pg_options=...)``.

    ``transport``: "tcp" (bitcoll's TCP and shared memory) or "mpi" (under ``mpiexec``);
    None: ``BITCOLL_TORCH_TRANSPORT``, else "tcp". ``shm``, ``integrity``: as in
    :func:`bitcoll.init` (None: its defaults)."""

    transport: str | None = None
    shm: bool | None = None
    integrity: bool | None = None


# ---------------------------------------------------------------------------------- errors
def _dist_error(exc: BaseException, rank: int, group: str, what: str,
                hint: str = "") -> BaseException:
    """torch's error type for a bitcoll error ``exc`` of ``what`` on ``rank`` of ``group``;
    ``hint`` (a CommError's) is appended to the message."""
    where = f"bitcoll rank {rank} (group {group!r}), {what}"
    if isinstance(exc, UsageError):
        err: BaseException = UsageError(f"{where}: {exc}")
    elif isinstance(exc, PeerLostError):
        err = dist.DistNetworkError(f"{where}: peer lost: {exc}{hint}")
    elif isinstance(exc, CommError):
        err = dist.DistBackendError(f"{where}: {type(exc).__name__}: {exc}{hint}")
    elif isinstance(exc, (ValueError, TypeError, RuntimeError)):
        return exc
    else:
        err = dist.DistBackendError(f"{where}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


# ------------------------------------------------------------------------------- the work
class BitcollWork(_C10dWork):
    """The handle of one collective of a bitcoll process group.

    ``wait()`` blocks until it finished and re-raises its error (torch's types, see the
    module docstring); when it is the group's next collective and none is running, ``wait``
    runs it on the calling thread. ``wait(timeout)`` with a positive ``timedelta`` raises
    ``DistBackendError`` if it is not done by then (the collective goes on under its own
    deadline; one run by the waiting thread ends by that deadline). ``is_completed()`` never
    blocks. ``get_future()`` is a ``torch.futures.Future`` completed (value: the output
    tensors, a list) or failed by the thread that ran the collective. It fails as C++ sees a
    failure (:func:`hook_future`: DDP's reducer crashed the process when a peer died in
    backward).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        # Held until the collective finished: a waiter acquires and releases it (cheaper
        # than a threading.Event, which costs a Condition per collective).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._lock = threading.Lock()
        self._done = False  # the outcome is recorded (under _lock)
        self._finished = False  # ... and the future completed: waiters may go
        self._error: BaseException | None = None
        self._value: Any = None
        self._future: Future[Any] | None = None  # made by get_future (most calls need none)
        self._source: Future[Any] | None = None  # the private future the returned one follows
        self._worker: _Worker | None = None

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            self._value, self._error, self._done = value, error, True
            src = self._source
        try:
            if src is not None:
                self._complete(src)
        finally:
            self._finished = True
            self._gate.release()

    def _complete(self, src: Future[Any]) -> None:
        """Complete the private future: the returned one follows it (:func:`_follow`)."""
        if self._error is None:
            src.set_result(self._value)
        else:
            src.set_exception(self._error)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._finished and self._worker is not None:
            self._worker.try_run(self)  # next in line: run it here (no thread hand-off)
        if not self._finished:
            limit = -1.0
            if timeout is not None and timeout.total_seconds() > 0:
                limit = timeout.total_seconds()
            if not self._gate.acquire(timeout=limit):
                raise dist.DistBackendError(f"{self._name} did not complete within the "
                                            f"{limit} s wait")
            self._gate.release()  # for the next waiter
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> Future[Any]:
        with self._lock:
            fut = self._future
            if fut is None:
                src, fut = hook_future()
                self._source, self._future = src, fut
                done = self._done
            else:
                done = False
        if done:  # finished before anyone asked: complete the new future now
            self._complete(src)
        return fut

    def __repr__(self) -> str:
        state = "completed" if self._finished else "pending"
        return f"<BitcollWork {self._name} {state}>"


def _follow(src: Future[Any]) -> Any:
    """The ``then`` callback of :func:`hook_future`'s result: the source's value, or its
    error raised (so that the result fails for C++ callers too)."""
    return src.value()


def hook_future() -> tuple[Future[Any], Future[Any]]:
    """A future to hand to torch from Python, as a pair ``(source, result)``: complete
    ``source`` (``set_result`` or ``set_exception``, from any thread) and give torch
    ``result``, which follows it. torch's Python ``Future.set_exception`` completes a future
    with the exception *as its value* (only Python's ``wait``/``value`` raise it); C++
    callers such as DDP's reducer read that as a result without tensors (a segmentation
    fault in ``finalize_backward``). ``result`` is ``source.then(...)`` whose callback
    raises the error, which fails ``result`` for C++ too. The works of this backend and
    lioncub's DDP comm hooks return such futures."""
    source: Future[Any] = Future()
    return source, source.then(_follow)


_Item = tuple[Job, "BitcollWork", Callable[[BaseException], BaseException]]


class _Worker:
    """Runs jobs one at a time in submission order: on its own daemon thread, or on the
    thread that waits for a job (:meth:`try_run`) when that job is next and no job is
    running, so that a synchronous call costs no hand-off between threads."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._pending: collections.deque[_Item] = collections.deque()
        self._busy = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, work: BitcollWork,
               wrap: Callable[[BaseException], BaseException],
               wake: bool = True) -> BitcollWork:
        """Queue ``job``. ``wake=False`` (a synchronous call, whose caller waits at once)
        leaves the thread asleep: the waiting caller runs the job itself, or the thread takes
        it when the job before it ends."""
        work._worker = self
        with self._cond:
            self._pending.append((job, work, wrap))
            if threading.current_thread() is not self._thread:
                if wake:
                    self._cond.notify()
                return work
        # Submitted from this worker's own thread: by a callback of a future it completed
        # (torch runs a future's callbacks on the thread that completes it), which may wait
        # for this very work (PowerSGD's hook does: a collective inside ``then``, then
        # ``wait()``). Nothing else would run the queue meanwhile, so this thread runs the
        # jobs queued up to this one now, in order.
        self._drain_to(work)
        return work

    def _drain_to(self, work: BitcollWork) -> None:
        """Run queued jobs on this thread, in order, until ``work``'s has run (another
        thread's job that is running first is waited for)."""
        while True:
            with self._cond:
                while self._busy:
                    self._cond.wait()
                if not self._pending or work._done:
                    return
                item = self._pending.popleft()
                self._busy = True
            self._run(item)

    def run_now(self, job: Job, work: BitcollWork,
                wrap: Callable[[BaseException], BaseException]) -> bool:
        """Run ``job`` on this thread at once when no job is queued or running (a synchronous
        call: ``work`` is finished on return); False, with nothing done, otherwise."""
        with self._cond:
            if self._busy or self._pending:
                return False
            self._busy = True
        self._run((job, work, wrap))
        return True

    def idle(self) -> bool:
        """Whether no job is queued or running."""
        with self._cond:
            return not self._busy and not self._pending

    def try_run(self, work: BitcollWork) -> None:
        """Run ``work``'s job on this thread if it is the next one and none is running."""
        with self._cond:
            if self._busy or not self._pending or self._pending[0][1] is not work:
                return
            item = self._pending.popleft()
            self._busy = True
        self._run(item)

    def stop(self) -> None:
        """Let the thread end once the queued jobs are done."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (after :meth:`stop`).

        A daemon thread still inside torch's C++ code (dropping a Work, completing a
        future) when the interpreter finalizes is ended by ``pthread_exit``, which aborts
        the process ("terminate called without an active exception"); joining it here, at
        the group's shutdown, leaves no such thread behind. A no-op on the thread itself."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self, item: _Item) -> None:
        job, work, wrap = item
        error: BaseException | None = None
        value: Any = None
        try:
            value = job()
        except BaseException as exc:  # handed to the waiter
            error = wrap(exc)
        finally:
            with self._cond:
                self._busy = False
                if self._pending:  # the thread has work (a wake-up otherwise is wasted)
                    self._cond.notify()
        work._finish(value, error)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._busy or not self._pending:
                    if self._stopped and not self._pending:
                        return
                    self._cond.wait()
                item = self._pending.popleft()
                self._busy = True
            self._run(item)


# ------------------------------------------------------------------------- tensor staging
class _Staged:
    """A contiguous host copy (or view) of a tensor, and how to copy results back."""

    __slots__ = ("copied", "host", "orig")

    def __init__(self, t: torch.Tensor, copy_in: bool = True) -> None:
        if t.layout != torch.strided:
            raise UsageError(f"a {t.layout} tensor: the bitcoll backend serves strided "
                             "tensors, and sparse COO ones in all_reduce with ReduceOp.SUM "
                             "(use .to_dense())")
        self.orig = t
        src = t.detach()
        if src.device.type == "cpu" and src.is_contiguous() and not src.is_neg() and \
                not src.is_conj():
            self.host, self.copied = src, False
        elif copy_in:  # a negated or conjugated view: its values, materialized
            self.host = src.resolve_neg().resolve_conj().to("cpu").contiguous()
            self.copied = True
            if self.host.data_ptr() == src.data_ptr() and self.host.numel():
                self.host = self.host.clone()
        else:
            self.host = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            self.copied = True

    def back(self) -> None:
        """Copy the host result into the original tensor (if it was staged)."""
        if self.copied:
            self.orig.detach().copy_(self.host)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of a contiguous tensor with unit stride (a one-element view of a strided
    tensor counts as contiguous for torch but keeps its stride)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat


def _raw(t: torch.Tensor) -> Array:
    """The bytes of a contiguous CPU tensor as a 1-D uint8 numpy view (any dtype)."""
    flat = _flat(t)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    return flat.numpy()


def _typed(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor as bitcoll reduces it: numpy view (complex as its real pairs,
    bool as uint8), or the tensor itself for bfloat16."""
    flat = _flat(t)
    if flat.dtype == torch.bfloat16:
        return flat
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8).numpy()
    if flat.is_complex():
        return torch.view_as_real(flat).reshape(-1).numpy()
    return flat.numpy()


#: The dtypes whose CPU tensors bitcoll reduces as numpy views of the same type.
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                           torch.int32, torch.int64, torch.uint8})
_INTS = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
         torch.uint32, torch.uint64}
_R = dist.ReduceOp
_FOLDS: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _R.PRODUCT: torch.mul, _R.BAND: torch.bitwise_and, _R.BOR: torch.bitwise_or,
    _R.BXOR: torch.bitwise_xor}


def _op_type(op: Any) -> Any:
    """The RedOpType of a ``ReduceOp`` (or RedOpType)."""
    return op.op if hasattr(op, "op") else op


@dataclass(frozen=True)
class _Reduction:
    """How one (op, dtype) runs: a bitcoll all-reduce with ``op`` ("sum", "avg", "max",
    "min"), or an all-gather folded with ``fold``; ``factor`` scales first (PREMUL_SUM)."""

    op: str | None
    fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    factor: Any = None


_PLANS: dict[tuple[Any, torch.dtype], _Reduction] = {}


def _reduction(op: Any, dtype: torch.dtype) -> _Reduction:
    """The plan of ReduceOp ``op`` on ``dtype``; UsageError where torch's op is undefined.
    Plans without a factor are cached per (op, dtype)."""
    kind = _op_type(op)
    plan = _PLANS.get((kind, dtype))
    if plan is None:
        plan = _plan(op, kind, dtype)
        if plan.factor is None:
            _PLANS[(kind, dtype)] = plan
    return plan


def _plan(op: Any, kind: Any, dtype: torch.dtype) -> _Reduction:
    name = str(getattr(kind, "name", kind))
    if dtype == torch.bool:
        table: dict[Any, str] = {_R.SUM: "max", _R.MAX: "max", _R.BOR: "max", _R.MIN: "min",
                                 _R.PRODUCT: "min", _R.BAND: "min"}
        if kind in table:
            return _Reduction(table[kind])
        if kind == _R.BXOR:
            return _Reduction(None, torch.bitwise_xor)
        raise UsageError(f"ReduceOp.{name} is not defined for bool tensors")
    integer = dtype in _INTS
    if kind == _R.SUM:
        return _Reduction("sum")
    if kind == _R.AVG:
        if integer:
            raise UsageError(f"ReduceOp.AVG is not defined for integer dtype {dtype}: use SUM "
                             "and divide, or a floating dtype")
        return _Reduction("avg")
    if kind in (_R.MAX, _R.MIN):
        if dtype.is_complex:
            raise UsageError(f"ReduceOp.{name} is not defined for complex dtype {dtype}")
        return _Reduction("max" if kind == _R.MAX else "min")
    if kind == _R.PRODUCT:
        return _Reduction(None, torch.mul)
    if kind in (_R.BAND, _R.BOR, _R.BXOR):
        if not integer:
            raise UsageError(f"ReduceOp.{name} is defined for integer and bool tensors, not "
                             f"{dtype}")
        return _Reduction(None, _FOLDS[kind])
    if kind == _R.PREMUL_SUM:
        if integer:
            raise UsageError(f"ReduceOp.PREMUL_SUM is not defined for integer dtype {dtype}")
        factor = getattr(op, "factor", None)
        if factor is None:
            raise UsageError("ReduceOp.PREMUL_SUM without a factor (make it with "
                             "torch.distributed._make_nccl_premul_sum)")
        return _Reduction("sum", factor=factor)
    raise UsageError(f"unsupported ReduceOp {name}")


# --------------------------------------------------------------------- communicator set-up
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _secret_env(secret: str | None) -> Any:
    """``BITCOLL_SECRET`` = ``secret`` while bitcoll connects (None: leave it alone)."""
    from .transport.rendezvous.auth import SECRET_ENV

    if secret is None:
        yield
        return
    with _ENV_LOCK:
        old = os.environ.get(SECRET_ENV)
        os.environ[SECRET_ENV] = secret
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(SECRET_ENV, None)
            else:
                os.environ[SECRET_ENV] = old


def _store_secret(store: Any, rank: int, size: int) -> str | None:
    """The secret this group's ranks agree on through ``store`` when the environment gives
    none and they span several hosts (see the module docstring); None otherwise."""
    from .transport.rendezvous.auth import env_secret

    if size == 1 or env_secret() is not None:
        return None
    store.set(f"bitcoll/host/{rank}", socket.gethostname())
    hosts = {bytes(store.get(f"bitcoll/host/{r}")) for r in range(size)}
    if len(hosts) == 1:
        return None  # one host: rank 0's private secret file
    if rank == 0:
        store.set("bitcoll/secret", secrets.token_hex(32))
    return bytes(store.get("bitcoll/secret")).decode("ascii")


def _transport_of(options: Any) -> tuple[str, Options]:
    opts = options if isinstance(options, Options) else Options()
    name = opts.transport or os.environ.get(ENV_TRANSPORT, "") or "tcp"
    if name not in ("tcp", "mpi"):
        raise UsageError(f"bitcoll torch transport must be 'tcp' or 'mpi', got {name!r} "
                         f"(Options.transport or {ENV_TRANSPORT})")
    return name, opts


def _connect(store: Any, rank: int, size: int, timeout: float, options: Any,
             global_ranks: Sequence[int]) -> Communicator:
    """The bitcoll communicator of one process group (collective over its ranks)."""
    from . import bootstrap

    transport, opts = _transport_of(options)
    if transport == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        members = list(global_ranks) or list(range(size))
        if world.Get_size() < size or members[rank] != world.Get_rank():
            raise UsageError(f"transport 'mpi' needs torch's ranks to be the MPI ranks: this "
                             f"is torch rank {members[rank]}, MPI rank {world.Get_rank()} of "
                             f"{world.Get_size()}; pass rank=MPI.COMM_WORLD.rank to "
                             "init_process_group")
        if members == list(range(world.Get_size())):
            return bootstrap.init("mpi", timeout=timeout)
        group = world.Get_group().Incl(members)
        sub = world.Create_group(group)
        group.Free()
        return bootstrap.init(comm=sub, timeout=timeout)
    secret = _store_secret(store, rank, size)
    with _secret_env(secret):
        return bootstrap.init("tcp", timeout=timeout, store=store, rank=rank, size=size,
                              shm=opts.shm, integrity=opts.integrity)


# --------------------------------------------------------------------------- the group
def _store_wait(store: Any, key: str, seconds: float) -> bool:
    """Whether ``key`` is in ``store`` now or appears within ``seconds``."""
    if store.check([key]):
        return True
    if seconds <= 0:
        return False
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except (dist.DistError, RuntimeError):
        return bool(store.check([key]))
    return True


def _own_client(store: Any) -> Any:
    """``store.clone()`` (a new connection to the same store) where the store has it."""
    clone = getattr(store, "clone", None)
    return clone() if callable(clone) else store


class _Channel:
    """One direction of point-to-point traffic with one peer for one tag (module docstring).
    The 2-rank communicator is made on the channel's worker by its first message."""

    def __init__(self, pg: BitcollProcessGroup, peer: int, tag: int, sending: bool) -> None:
        src, dst = (pg.rank(), peer) if sending else (peer, pg.rank())
        self.name = f"p2p {src}->{dst} tag {tag}"
        self.key = f"bitcoll/p2p/{src}/{dst}/{tag}/"
        self.sending = sending
        self.comm: Communicator | None = None
        self.worker = _Worker(f"bitcoll-{self.name}")

    def communicator(self, pg: BitcollProcessGroup) -> Communicator:
        if self.comm is None:
            # A client connection of its own: a torch TCPStore client serves one request at a
            # time, so a blocking wait of one channel's set-up would hold up the others'.
            store = PrefixStore(self.key, _own_client(pg._store))
            secret = _store_secret(store, 0 if self.sending else 1, 2)
            from . import bootstrap

            with _secret_env(secret):
                self.comm = bootstrap.init("tcp", timeout=pg._timeout, store=store,
                                           rank=0 if self.sending else 1, size=2)
        return self.comm


class BitcollProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on a bitcoll
    :class:`~bitcoll.Communicator` (see the module docstring). Made by torch through the
    registered backend; not constructed by users."""

    # The collectives take the arguments torch's Python front end and its C++ trampoline
    # pass (lists and an options object); the stubs overload the public forms as well, hence
    # the ``type: ignore[override]`` on each.

    def __init__(self, comm: Communicator, store: Any, rank: int, size: int,
                 timeout: float, group_name: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lacks this form
        self._me = rank  # rank() is a call into C++
        self._comm = comm
        self._store = store
        self._timeout = timeout
        self._group_name = group_name or "default"
        self._group_desc = ""
        self._worker = _Worker(f"bitcoll-{self._group_name}")
        self._channels: dict[tuple[int, int, bool], _Channel] = {}
        self._channels_lock = threading.Lock()
        self._closed = False
        self._mb_store: Any = None  # monitored_barrier's own store client (made on use)
        self._notes_store: Any = None  # the argument-check notes' own client (made on use)
        self._own_notes: dict[int, str] = {}  # sequence -> this rank's failed check there
        self._mb_seq = 0
        self._mb_clean = False  # the last monitored_barrier passed

    # -------------------------------------------------------------- identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def communicator(self) -> Communicator:
        """The bitcoll communicator behind this group."""
        return self._comm

    def __repr__(self) -> str:
        return (f"<BitcollProcessGroup {self._group_name!r} rank {self.rank()} of "
                f"{self.size()}>")

    # -------------------------------------------------------------- machinery
    def _wrap(self, what: str, notes: bool = True) -> Callable[[BaseException], BaseException]:
        """torch's error for a failure of ``what``; with ``notes`` (a collective of the group's
        communicator) a CommError's message quotes the argument-check notes of its call
        (:meth:`_notes_hint`)."""
        rank, group = self._me, self._group_name
        if not notes:
            return lambda exc: _dist_error(exc, rank, group, what)
        return lambda exc: _dist_error(exc, rank, group, what, self._notes_hint(exc))

    def _submit(self, what: str, job: Job, opts: Any = None) -> BitcollWork:
        """Queue ``job`` (returns the future's value) on this group's worker. ``opts``: the
        call's options; with ``opts.asyncOp`` False (torch's ``async_op=False``, whose caller
        waits at once) the job runs on the calling thread right away when no other job is
        queued or running (the work is returned finished), else it is queued without waking
        the worker thread (see :meth:`_Worker.submit`)."""
        if self._closed:
            raise UsageError(f"bitcoll rank {self._me}: process group "
                             f"{self._group_name!r} was shut down")
        work = BitcollWork(f"{what} on group {self._group_name!r}")
        wrap = self._wrap(what)
        if opts is None or getattr(opts, "asyncOp", True):
            return self._worker.submit(job, work, wrap)
        if not self._worker.run_now(job, work, wrap):
            self._worker.submit(job, work, wrap, wake=False)
        return work

    def _check(self, what: str, fn: Callable[[], Any]) -> Any:
        """Argument checks on the caller's thread: errors name the rank, and leave a note for
        the peers (:meth:`_note_usage`)."""
        try:
            return fn()
        except UsageError as exc:
            self._note_usage(what, exc)
            raise _dist_error(exc, self.rank(), self._group_name, what) from exc

    def _staged(self, what: str, tensors: Sequence[torch.Tensor],
                copy_in: bool = True) -> list[_Staged]:
        """``tensors`` staged (:class:`_Staged`) as part of ``what``'s argument check: a
        tensor the group does not serve (a sparse one) is that check's UsageError."""
        return self._check(what, lambda: [_Staged(t, copy_in) for t in tensors])  # type: ignore[no-any-return]

    def _notes(self) -> Any:
        """The argument-check notes' store client (its own connection, made on first use)."""
        if self._notes_store is None:
            store = _own_client(self._store)
            if store is not self._store:  # a store without clone() keeps its own timeout
                with contextlib.suppress(Exception):
                    store.set_timeout(datetime.timedelta(seconds=_NOTES_SECONDS))
            self._notes_store = store
        return self._notes_store

    def _note_usage(self, what: str, exc: UsageError) -> None:
        """This rank's ``what`` failed its argument check before it started, so peers whose
        arguments passed are left in it: note that in the group's store under the number the
        call would have had (the communicator's next), for their failure to quote
        (:meth:`_notes_hint`). Only when no collective of the group is queued or running
        (the next number is then this call's); best effort (a store error is ignored)."""
        if self.size() == 1 or not self._worker.idle():
            return
        seq = self._comm.collectives_started
        msg = str(exc)
        msg = msg[len(what) + 2:] if msg.startswith(f"{what}: ") else msg
        text = f"rank {self._me}'s {what} failed its argument check before it started: {msg}"
        if len(self._own_notes) >= _NOTES_READ:
            self._own_notes.pop(next(iter(self._own_notes)))
        self._own_notes[seq] = what
        with contextlib.suppress(Exception):
            store = self._notes()
            n = store.add(_NOTES_KEY + "count", 1)
            store.set(f"{_NOTES_KEY}{n}", f"{seq}|{self._me}|{text}")

    def _notes_hint(self, exc: BaseException) -> str:
        """For a CommError of the group's collective #``exc.sequence``: what the notes of
        that number say (``"; rank 1's ... failed its argument check ..."``): the peers'; a
        rank whose own check failed there says so instead (its peers were left in that
        collective); "" when there are none, when every rank's check failed there (the same
        mistake everywhere: nobody was left in it, and the failure has another cause), or
        when the store does not answer."""
        if not isinstance(exc, CommError) or exc.sequence is None or self.size() == 1:
            return ""
        seq, p = exc.sequence, self.size()
        mine = self._own_notes.get(seq)
        found: dict[int, str] = {}
        with contextlib.suppress(Exception):
            store = self._notes()
            count = int(store.add(_NOTES_KEY + "count", 0))
            for n in range(count, max(0, count - _NOTES_READ - p), -1):
                at, rank, text = store.get(f"{_NOTES_KEY}{n}").decode().split("|", 2)
                if int(at) == seq and int(rank) != self._me:
                    found.setdefault(int(rank), text)
        if len(found) + (mine is not None) >= p:
            return ""
        if mine is not None:
            return (f"; this rank's {mine} had failed its argument check before it started, "
                    "and its peers were left in that collective")
        return "".join(f"; {found[r]}" for r in sorted(found))

    def _reduce_into(self, tensors: Sequence[_Staged], red: _Reduction) -> None:
        """All-reduce each staged tensor in place (worker thread)."""
        comm = self._comm
        for st in tensors:
            t = st.host
            if red.factor is not None:
                t.mul_(red.factor)
            if red.fold is not None:
                self._fold(t, red.fold)
            else:
                x = _typed(t)
                comm.allreduce(x, red.op or "sum", out=x)

    def _fold(self, t: torch.Tensor, fold: Callable[[torch.Tensor, torch.Tensor],
                                                    torch.Tensor]) -> None:
        """``t`` = fold over the ranks' ``t`` in rank order (an all-gather, then local)."""
        p, n = self.size(), t.numel()
        gathered = torch.empty((p, n), dtype=t.dtype)
        self._comm.allgather(_raw(t), out=_raw(gathered))
        acc = gathered[0].clone()
        for j in range(1, p):
            acc = fold(acc, gathered[j])
        t.reshape(-1).copy_(acc)

    # -------------------------------------------------------------- all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BitcollWork:  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if len(tensors) == 1 and tensors[0].layout == torch.strided:
            lean = self._lean_allreduce(tensors, op, opts)
            if lean is not None:
                return lean
        elif any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op, opts)
        plans = self._check("allreduce", lambda: [_reduction(op, t.dtype) for t in tensors])
        staged = self._staged("allreduce", tensors)

        def job() -> list[torch.Tensor]:
            for st, red in zip(staged, plans, strict=True):
                self._reduce_into([st], red)
                st.back()
            return list(tensors)

        return self._submit("allreduce", job, opts)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any,
                          opts: Any) -> BitcollWork:
        """All-reduce of sparse COO tensors (DDP's gradients of ``nn.Embedding(sparse=True)``),
        SUM only, as gloo serves them: each becomes the sum of every rank's tensor, sparse
        and coalesced, with the same indices and bits on every rank (:meth:`_sparse_sum`)."""
        def check() -> None:
            for t in tensors:
                if t.layout != torch.sparse_coo:
                    raise UsageError(f"all_reduce of a {t.layout} tensor is not served: "
                                     "strided and sparse COO tensors are")
            if _op_type(op) != dist.ReduceOp.SUM:
                raise UsageError("sparse tensors are all-reduced with ReduceOp.SUM only")

        self._check("allreduce", check)

        def job() -> list[torch.Tensor]:
            for t in tensors:
                self._sparse_sum(t)
            return list(tensors)

        return self._submit("allreduce", job, opts)

    def _sparse_sum(self, t: torch.Tensor) -> None:
        """``t`` (sparse COO, on any device) = the sum of every rank's ``t``: the ranks'
        shapes, value dtypes, sparse dimensions and entry counts gathered first (UsageError on
        every rank when any but the counts differ), then their coalesced indices and values
        (:meth:`_gather_list`); the entries in rank order are coalesced (duplicates summed) on
        every rank alike, so every rank gets the same indices and bits. Worker thread."""
        comm, p = self._comm, self.size()
        src = t.detach().to("cpu").coalesce()
        idx, vals = src.indices().t().contiguous(), src.values().contiguous()  # entry by row
        kind = zlib.crc32(f"{vals.dtype} {idx.shape[1]}".encode())
        head = torch.tensor([idx.shape[0], kind, *src.shape], dtype=torch.int64)
        heads = torch.empty((p, head.numel()), dtype=torch.int64)
        comm.allgather(_raw(head), out=_raw(heads))
        if heads[:, 1:].ne(head[1:]).any():
            other = " (another dtype or sparse_dim)"
            raise UsageError("all_reduce of sparse tensors of different shapes, dtypes or "
                             "sparse dimensions: " + ", ".join(
                                 f"rank {r} {tuple(heads[r, 2:].tolist())}"
                                 f"{other if heads[r, 1] != kind else ''}" for r in range(p)))
        counts = heads[:, 0].tolist()
        all_i = [torch.empty((k, idx.shape[1]), dtype=torch.int64) for k in counts]
        all_v = [torch.empty((k, *vals.shape[1:]), dtype=vals.dtype) for k in counts]
        self._gather_list(idx, all_i)
        self._gather_list(vals, all_v)
        total = torch.sparse_coo_tensor(torch.cat(all_i).t(), torch.cat(all_v),
                                        src.shape).coalesce()
        with torch.no_grad():
            t.copy_(total.to(t.device))

    def _lean_allreduce(self, tensors: list[torch.Tensor], op: Any,
                        opts: Any) -> BitcollWork | None:
        """The all-reduce of one contiguous CPU tensor of a dtype numpy holds
        (``_NUMPY_DTYPES``) by an op bitcoll's all-reduce runs (its plan cached already, which
        a PREMUL_SUM's never is), in place through a numpy view made now, without staging: run
        on this thread at once when the call is synchronous and no job is queued or running
        (:meth:`_submit`), queued otherwise. None when the call does not qualify (the general
        path then checks and stages it)."""
        src = tensors[0]
        red = _PLANS.get((_op_type(op), src.dtype))
        if red is None or red.fold is not None or \
                src.dtype not in _NUMPY_DTYPES or not src.is_cpu or not src.is_contiguous() \
                or src.is_neg():  # a negated view has no numpy view: the general path copies
            return None
        x = (src.detach() if src.requires_grad else src).numpy()
        if x.ndim != 1:
            x = x.reshape(-1)
        comm, how = self._comm, red.op or "sum"

        def job() -> list[torch.Tensor]:
            comm.allreduce(x, how, out=x)
            return list(tensors)

        return self._submit("allreduce", job, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: Any = None) -> BitcollWork:
        """All tensors in one bitcoll all-reduce per dtype (DDP's and torch's coalesced
        form)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        plans = self._check("allreduce_coalesced",
                            lambda: [_reduction(op, t.dtype) for t in tensors])
        staged = self._staged("allreduce_coalesced", tensors)

        def job() -> list[torch.Tensor]:
            groups: dict[tuple[torch.dtype, int], list[int]] = {}
            for i, st in enumerate(staged):
                groups.setdefault((st.host.dtype, id(plans[i].fold)), []).append(i)
            for idx in groups.values():
                red = plans[idx[0]]
                if len(idx) == 1 or red.fold is not None:
                    for i in idx:
                        self._reduce_into([staged[i]], red)
                    continue
                flat = torch.cat([staged[i].host.reshape(-1) for i in idx])
                self._reduce_into([_Staged(flat)], red)
                at = 0
                for i in idx:
                    h = staged[i].host
                    h.reshape(-1).copy_(flat[at:at + h.numel()])
                    at += h.numel()
            for st in staged:
                st.back()
            return list(tensors)

        return self._submit("allreduce_coalesced", job, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> BitcollWork:  # type: ignore[override]
        """The reduction lands on ``opts.rootRank`` only (others' tensors unchanged)."""
        root = int(opts.rootRank)
        self._check("reduce", lambda: self._check_root(root))
        plans = self._check("reduce", lambda: [_reduction(opts.reduceOp, t.dtype)
                                               for t in tensors])
        staged = self._staged("reduce", tensors)
        mine = self.rank() == root

        def job() -> list[torch.Tensor]:
            for st, red in zip(staged, plans, strict=True):
                work = st if mine else _Staged(st.host.clone())
                self._reduce_into([work], red)
                if mine:
                    st.back()
            return list(tensors)

        return self._submit("reduce", job, opts)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size():
            raise UsageError(f"root {root} is not a rank of the group (size {self.size()})")

    # -------------------------------------------------------------- broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> BitcollWork:  # type: ignore[override]
        root = int(opts.rootRank)
        self._check("broadcast", lambda: self._check_root(root))
        staged = self._staged("broadcast", tensors)

        def job() -> list[torch.Tensor]:
            for st in staged:
                self._comm.broadcast(_raw(st.host), root)
                st.back()
            return list(tensors)

        return self._submit("broadcast", job, opts)

    # -------------------------------------------------------------- all-gather
    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> BitcollWork:
        """List form: ``output_tensors[i][j]`` gets rank j's ``input_tensors[i]`` (sizes may
        differ by rank: each rank's output list gives every rank's size)."""
        p = self.size()

        def check() -> None:
            for outs, x in zip(output_tensors, input_tensors, strict=True):
                if len(outs) != p:
                    raise UsageError(f"all_gather needs {p} output tensors, got {len(outs)}")
                if any(o.dtype != x.dtype for o in outs):
                    raise UsageError("all_gather output tensors must have the input's dtype")
                if outs[self.rank()].numel() != x.numel():
                    raise UsageError(f"all_gather: output {self.rank()} has "
                                     f"{outs[self.rank()].numel()} elements, the input "
                                     f"{x.numel()}")

        self._check("allgather", check)
        staged_in = self._staged("allgather", input_tensors)
        staged_out = [self._staged("allgather", outs, False) for outs in output_tensors]

        def job() -> list[list[torch.Tensor]]:
            for st, outs in zip(staged_in, staged_out, strict=True):
                self._gather_list(st.host, [o.host for o in outs])
                for o in outs:
                    o.back()
            return output_tensors

        return self._submit("allgather", job, opts)

    def _gather_list(self, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Every rank's ``x`` into ``outs`` (rank order), padded to the largest (worker)."""
        sizes = [o.numel() for o in outs]
        m = max(sizes, default=0)
        if m == x.numel():
            src = x
        else:
            src = torch.zeros(m, dtype=x.dtype)
            src[:x.numel()] = x.reshape(-1)
        flat = torch.empty((len(outs), m), dtype=x.dtype)
        self._comm.allgather(_raw(src), out=_raw(flat))
        for j, o in enumerate(outs):
            o.reshape(-1).copy_(flat[j, :sizes[j]])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> BitcollWork:
        """``all_gather_into_tensor``: ``output`` holds ``size`` inputs in rank order."""
        lean = self._lean_allgather(output, input, opts)
        if lean is not None:
            return lean
        return self._submit("all_gather_into_tensor",
                            self._allgather_job([output], [input], "all_gather_into_tensor"),
                            opts)

    def _lean_allgather(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any) -> BitcollWork | None:
        """``all_gather_into_tensor`` of a contiguous CPU tensor into a contiguous CPU output
        of its dtype and ``size`` times its elements (any dtype: the bytes move), through
        byte views made now, without staging: run on this thread at once when the call is
        synchronous and no job is queued or running (:meth:`_submit`), queued otherwise, as
        :meth:`_lean_allreduce`. None when the call does not qualify (the general path then
        checks and stages it)."""
        if not (input.is_cpu and output.is_cpu and input.is_contiguous()
                and output.is_contiguous()) or input.dtype != output.dtype \
                or output.numel() != self.size() * input.numel() \
                or input.is_neg() or output.is_neg() or input.is_conj() or output.is_conj():
            return None
        x, y = _raw(input.detach()), _raw(output.detach())
        comm = self._comm

        def job() -> list[torch.Tensor]:
            comm.allgather(x, out=y)
            return [output]

        return self._submit("all_gather_into_tensor", job, opts)

    all_gather_single = _allgather_base

    def _allgather_job(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                       what: str) -> Job:
        p = self.size()

        def check() -> None:
            for o, x in zip(outputs, inputs, strict=True):
                if o.numel() != p * x.numel() or o.dtype != x.dtype:
                    raise UsageError(f"{what}: output must have {p} x {x.numel()} elements of "
                                     f"{x.dtype}, got {o.numel()} of {o.dtype}")

        self._check(what, check)
        ins = self._staged(what, inputs)
        outs = self._staged(what, outputs, False)

        def job() -> list[torch.Tensor]:
            for si, so in zip(ins, outs, strict=True):
                self._comm.allgather(_raw(si.host), out=_raw(so.host))
                so.back()
            return list(outputs)

        return job

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> BitcollWork:
        return self._submit("all_gather_into_tensor_coalesced",
                            self._allgather_job(outputs, inputs,
                                                "all_gather_into_tensor_coalesced"), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> BitcollWork:
        return self.allgather(output_lists, input_list, opts)

    # -------------------------------------------------------------- reduce-scatter
    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any) -> BitcollWork:
        """List form: rank r gets the reduction over ranks of ``input_tensors[i][r]``."""
        p, me = self.size(), self.rank()
        op = opts.reduceOp

        def check() -> list[_Reduction]:
            for out, ins in zip(output_tensors, input_tensors, strict=True):
                if len(ins) != p:
                    raise UsageError(f"reduce_scatter needs {p} input tensors, got {len(ins)}")
                if ins[me].numel() != out.numel():
                    raise UsageError(f"reduce_scatter: input {me} has {ins[me].numel()} "
                                     f"elements, the output {out.numel()}")
            return [_reduction(op, out.dtype) for out in output_tensors]

        plans = self._check("reduce_scatter", check)
        staged_out = self._staged("reduce_scatter", output_tensors, False)
        ins_host = [[x.detach().to("cpu").reshape(-1) for x in ins] for ins in input_tensors]

        def job() -> list[torch.Tensor]:
            for so, ins, red in zip(staged_out, ins_host, plans, strict=True):
                m = max(x.numel() for x in ins)
                buf = torch.zeros((p, m), dtype=so.host.dtype)
                for j, x in enumerate(ins):
                    buf[j, :x.numel()] = x
                self._reduce_scatter_flat(buf.reshape(-1), so.host, red, m)
                so.back()
            return list(output_tensors)

        return self._submit("reduce_scatter", job, opts)

    def _reduce_scatter_flat(self, buf: torch.Tensor, out: torch.Tensor, red: _Reduction,
                             m: int) -> None:
        """Reduce the contiguous ``buf`` (``size`` blocks of ``m``) over ranks; this rank's
        block (first ``out.numel()`` elements of it) into ``out`` (worker thread)."""
        if red.factor is not None:
            buf = buf * red.factor
        n = out.numel()
        if red.fold is not None or red.op is None or buf.dtype.is_complex or \
                buf.dtype == torch.bool:
            whole = _Staged(buf.clone())
            self._reduce_into([whole], _Reduction(red.op, red.fold))
            mine = whole.host[self.rank() * m:self.rank() * m + n]
            out.reshape(-1).copy_(mine)
            return
        if n == m:
            self._comm.reduce_scatter(_typed(buf), red.op, out=_typed(out))
            return
        block = torch.empty(m, dtype=buf.dtype)
        self._comm.reduce_scatter(_typed(buf), red.op, out=_typed(block))
        out.reshape(-1).copy_(block[:n])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any) -> BitcollWork:
        """``reduce_scatter_tensor``: ``input`` is ``size`` blocks of ``output``'s size."""
        return self._submit("reduce_scatter_tensor",
                            self._reduce_scatter_job([output], [input], opts,
                                                     "reduce_scatter_tensor"), opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def _reduce_scatter_job(self, outputs: Sequence[torch.Tensor],
                            inputs: Sequence[torch.Tensor], opts: Any, what: str) -> Job:
        p = self.size()

        def check() -> list[_Reduction]:
            for o, x in zip(outputs, inputs, strict=True):
                if x.numel() != p * o.numel() or o.dtype != x.dtype:
                    raise UsageError(f"{what}: input must have {p} x {o.numel()} elements of "
                                     f"{o.dtype}, got {x.numel()} of {x.dtype}")
            return [_reduction(opts.reduceOp, o.dtype) for o in outputs]

        plans = self._check(what, check)
        ins = self._staged(what, inputs)
        outs = self._staged(what, outputs, False)

        def job() -> list[torch.Tensor]:
            for si, so, red in zip(ins, outs, plans, strict=True):
                self._reduce_scatter_flat(si.host.reshape(-1), so.host, red, so.host.numel())
                so.back()
            return list(outputs)

        return job

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],  # type: ignore[override]
                                        inputs: list[torch.Tensor],
                                        opts: Any) -> BitcollWork:
        return self._submit("reduce_scatter_tensor_coalesced",
                            self._reduce_scatter_job(outputs, inputs, opts,
                                                     "reduce_scatter_tensor_coalesced"), opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    # -------------------------------------------------------------- rooted and all-to-all
    def _exchange(self, what: str, label: str, sends: list[tuple[int, Array]],
                  recvs: list[tuple[int, Array]]) -> None:
        """One bitcoll collective that sends and receives these byte arrays (worker)."""
        def body(ctx: Any) -> None:
            reqs = [ctx.irecv(peer, arr) for peer, arr in recvs]
            reqs += [ctx.isend(peer, arr) for peer, arr in sends]
            ctx.wait(*reqs)

        self._comm.run(f"torch.{what}", (label,), body, False, None)

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any) -> BitcollWork:
        root, me, p = int(opts.rootRank), self.rank(), self.size()

        def check() -> None:
            self._check_root(root)
            if len(input_tensors) != 1:
                raise UsageError("gather takes one input tensor")
            if me == root and (len(output_tensors) != 1 or len(output_tensors[0]) != p):
                raise UsageError(f"gather needs {p} output tensors on the root")

        self._check("gather", check)
        x = self._staged("gather", input_tensors)[0]
        outs = self._staged("gather", output_tensors[0], False) if me == root else []

        def job() -> list[list[torch.Tensor]]:
            if me == root:
                outs[me].host.copy_(x.host.reshape(outs[me].host.shape))
                recvs = [(j, _raw(o.host)) for j, o in enumerate(outs) if j != me]
                self._exchange("gather", str(x.host.dtype), [], recvs)
                for o in outs:
                    o.back()
            else:
                self._exchange("gather", str(x.host.dtype), [(root, _raw(x.host))], [])
            return output_tensors

        return self._submit("gather", job, opts)

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any) -> BitcollWork:
        root, me, p = int(opts.rootRank), self.rank(), self.size()

        def check() -> None:
            self._check_root(root)
            if len(output_tensors) != 1:
                raise UsageError("scatter takes one output tensor")
            if me == root and (len(input_tensors) != 1 or len(input_tensors[0]) != p):
                raise UsageError(f"scatter needs {p} input tensors on the root")

        self._check("scatter", check)
        out = self._staged("scatter", output_tensors, False)[0]
        ins = self._staged("scatter", input_tensors[0]) if me == root else []

        def job() -> list[torch.Tensor]:
            label = str(out.host.dtype)
            if me == root:
                out.host.copy_(ins[me].host.reshape(out.host.shape))
                sends = [(j, _raw(s.host)) for j, s in enumerate(ins) if j != me]
                self._exchange("scatter", label, sends, [])
            else:
                self._exchange("scatter", label, [], [(root, _raw(out.host))])
            out.back()
            return output_tensors

        return self._submit("scatter", job, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> BitcollWork:
        """``all_to_all``: ``input_tensors[j]`` goes to rank j, lands in its
        ``output_tensors[rank]`` (sizes may differ per pair)."""
        p, me = self.size(), self.rank()

        def check() -> None:
            if len(output_tensors) != p or len(input_tensors) != p:
                raise UsageError(f"all_to_all needs {p} input and {p} output tensors")
            if output_tensors[me].numel() != input_tensors[me].numel():
                raise UsageError(f"all_to_all: input {me} and output {me} differ in size")

        self._check("alltoall", check)
        ins = self._staged("alltoall", input_tensors)
        outs = self._staged("alltoall", output_tensors, False)

        def job() -> list[torch.Tensor]:
            outs[me].host.reshape(-1).copy_(ins[me].host.reshape(-1))
            self._exchange("alltoall", str(outs[me].host.dtype),
                           [(j, _raw(ins[j].host)) for j in range(p) if j != me],
                           [(j, _raw(outs[j].host)) for j in range(p) if j != me])
            for o in outs:
                o.back()
            return output_tensors

        return self._submit("alltoall", job, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> BitcollWork:
        """``all_to_all_single``: rows of ``input`` (dim 0) split by ``input_split_sizes``
        (empty: equal), block j to rank j; ``output`` split by ``output_split_sizes``."""
        p, me = self.size(), self.rank()

        def splits(t: torch.Tensor, given: Sequence[int], name: str) -> list[int]:
            rows = t.shape[0] if t.dim() else 1
            if not given:
                if rows % p:
                    raise UsageError(f"all_to_all_single: {name} has {rows} rows, not "
                                     f"divisible by the group size {p}; pass split sizes")
                return [rows // p] * p
            if len(given) != p or sum(given) != rows or min(given) < 0:
                raise UsageError(f"all_to_all_single: {name} split sizes {list(given)} must "
                                 f"be {p} sizes >= 0 adding up to its {rows} rows")
            return [int(s) for s in given]

        def check() -> tuple[list[int], list[int]]:
            if output.dtype != input.dtype:
                raise UsageError("all_to_all_single: output and input dtypes differ")
            si = splits(input, input_split_sizes, "input")
            so = splits(output, output_split_sizes, "output")
            if si[me] != so[me]:
                raise UsageError(f"all_to_all_single: this rank sends itself {si[me]} rows "
                                 f"but expects {so[me]}")
            return si, so

        si, so = self._check("all_to_all_single", check)
        sin, sout = self._staged("all_to_all_single", [input])[0], \
            self._staged("all_to_all_single", [output], False)[0]

        def job() -> torch.Tensor:
            src, dst = _raw(sin.host), _raw(sout.host)
            row_in = src.size // max(1, sum(si)) if sum(si) else 0
            row_out = dst.size // max(1, sum(so)) if sum(so) else 0
            a = [0, *np.cumsum(si).tolist()]
            b = [0, *np.cumsum(so).tolist()]
            dst[b[me] * row_out:b[me + 1] * row_out] = src[a[me] * row_in:a[me + 1] * row_in]
            self._exchange("alltoall_base", str(sout.host.dtype),
                           [(j, src[a[j] * row_in:a[j + 1] * row_in]) for j in range(p)
                            if j != me],
                           [(j, dst[b[j] * row_out:b[j + 1] * row_out]) for j in range(p)
                            if j != me])
            sout.back()
            return output

        return self._submit("all_to_all_single", job, opts)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    # -------------------------------------------------------------- barriers
    def barrier(self, opts: Any = None) -> BitcollWork:
        def job() -> list[torch.Tensor]:
            self._comm.barrier()
            return []

        return self._submit("barrier", job, opts)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` (:func:`monitored_barrier`): every rank reports its
        arrival to rank 0 through the group's store, rank 0 waits for them (ranks 1, 2, ...
        in order) until ``timeout`` (default the group's) and publishes its verdict; every
        rank returns once the verdict is "all arrived", or raises ``DistBackendError``
        naming the ranks that did not arrive (the first one, or with ``wait_all_ranks`` all
        of them; a rank that arrives after the verdict raises it too). A rank other than 0
        raises after twice ``timeout`` without a verdict (rank 0 did not arrive). Runs behind
        the group's collectives issued before it."""
        limit = self._timeout if timeout is None else timeout.total_seconds()
        if limit <= 0:
            raise _dist_error(UsageError(f"monitored_barrier timeout must be > 0, got "
                                         f"{limit} s"), self.rank(), self._group_name,
                              "monitored_barrier")

        def job() -> list[torch.Tensor]:
            self._monitored(limit, bool(wait_all_ranks))
            return []

        self._submit("monitored_barrier", job).wait()

    def _monitored(self, limit: float, wait_all: bool) -> None:
        """The body of :meth:`monitored_barrier` (group worker)."""
        if self._mb_store is None:
            self._mb_store = PrefixStore("bitcoll/monitored_barrier/",
                                         _own_client(self._store))
        store, seq, me, p = self._mb_store, self._mb_seq, self.rank(), self.size()
        self._mb_seq += 1
        verdict = f"{seq}/verdict"
        if me != 0:
            store.set(f"{seq}/arrived/{me}", "1")
            # rank 0 gives its verdict at most ``limit`` after it arrived: wait twice that,
            # so that a verdict naming others is not mistaken for rank 0's absence
            if not _store_wait(store, verdict, 2 * limit):
                raise dist.DistBackendError(
                    f"bitcoll rank {me} (group {self._group_name!r}), monitored_barrier: "
                    f"rank 0 gave no verdict within {2 * limit} s (rank 0 did not arrive)")
            said = bytes(store.get(verdict)).decode()
            if said != "ok":
                raise dist.DistBackendError(f"bitcoll rank {me} (group "
                                            f"{self._group_name!r}), monitored_barrier: "
                                            f"{said}")
            return
        deadline = time.monotonic() + limit
        missing: list[int] = []
        for r in range(1, p):
            if not _store_wait(store, f"{seq}/arrived/{r}", deadline - time.monotonic()):
                missing.append(r)
                if not wait_all:
                    break
        if not missing:
            store.set(verdict, "ok")
            for r in range(1, p):
                store.delete_key(f"{seq}/arrived/{r}")
            if seq and self._mb_clean:  # everyone is past the previous (passed) barrier
                store.delete_key(f"{seq - 1}/verdict")
            self._mb_clean = True
            return
        self._mb_clean = False
        names = ", ".join(str(r) for r in missing)
        said = (f"rank{'s' if len(missing) > 1 else ''} {names} of {p} did not arrive within "
                f"{limit} s" + ("" if wait_all else " (the first rank missing; "
                                "wait_all_ranks=True names every one)"))
        store.set(verdict, said)
        raise dist.DistBackendError(f"bitcoll rank 0 (group {self._group_name!r}), "
                                    f"monitored_barrier: {said}")

    # -------------------------------------------------------------- point to point
    def _channel(self, peer: int, tag: int, sending: bool) -> _Channel:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise _dist_error(UsageError(f"peer {peer} is not another rank of the group "
                                         f"(size {self.size()})"), self.rank(),
                              self._group_name, "send" if sending else "recv")
        key = (peer, int(tag), sending)
        with self._channels_lock:
            ch = self._channels.get(key)
            if ch is None:
                ch = self._channels[key] = _Channel(self, peer, int(tag), sending)
            return ch

    def _p2p(self, tensors: list[torch.Tensor], peer: int, tag: int,
             sending: bool) -> BitcollWork:
        what = "send" if sending else "recv"
        if len(tensors) != 1:
            raise _dist_error(UsageError(f"{what} takes one tensor"), self.rank(),
                              self._group_name, what)
        try:
            st = _Staged(tensors[0], copy_in=sending)
        except UsageError as exc:
            raise _dist_error(exc, self.rank(), self._group_name, what) from exc
        ch = self._channel(peer, tag, sending)

        def job() -> list[torch.Tensor]:
            comm = ch.communicator(self)
            arr = _raw(st.host)

            def body(ctx: Any) -> None:
                ctx.wait(ctx.isend(1, arr) if sending else ctx.irecv(0, arr))

            comm.run("torch.p2p", (str(st.host.dtype), int(arr.size)), body, False, None)
            if not sending:
                st.back()
            return list(tensors)

        work = BitcollWork(f"{ch.name} on group {self._group_name!r}")
        return ch.worker.submit(job, work, self._wrap(ch.name, notes=False))

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> BitcollWork:
        return self._p2p(tensors, int(dstRank), tag, True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> BitcollWork:
        return self._p2p(tensors, int(srcRank), tag, False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> BitcollWork:
        raise _dist_error(UsageError("recv from any source is not supported by the bitcoll "
                                     "backend; name the source rank"), self.rank(),
                          self._group_name, "recv")

    # -------------------------------------------------------------- life cycle
    def shutdown(self) -> None:
        """Finish the queued collectives, then close the group's communicators."""
        if self._closed:
            return
        self._closed = True
        done = threading.Event()
        self._worker.submit(lambda: done.set(), BitcollWork("shutdown"), lambda e: e)
        done.wait(self._timeout)
        self._worker.stop()
        with self._channels_lock:
            channels = list(self._channels.values())
        for ch in channels:
            ch.worker.stop()
            if ch.comm is not None:
                ch.comm.close()
        self._comm.close()
        # the threads have nothing left but to return (a job still running fails on the
        # closed communicator): a short bound, never the group's timeout
        deadline = time.monotonic() + min(self._timeout, _JOIN_SECONDS)
        for worker in [self._worker, *(ch.worker for ch in channels)]:
            worker.join(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        """Abort the communicator (peers fail at once), then close it."""
        if self._comm.size > 1 and self._comm.transport.failure is None:
            self._comm.transport.abort(f"process group aborted on rank {self.rank()}")
        self.shutdown()


# ------------------------------------------------------------------------ registration
def _create(backend_opts: Any, pg_options: Any) -> BitcollProcessGroup:
    """The backend's creator (torch's extended API): one bitcoll communicator per group."""
    timeout = float(backend_opts.timeout.total_seconds())
    rank, size = int(backend_opts.group_rank), int(backend_opts.group_size)
    store = backend_opts.store
    name = str(backend_opts.group_id or "default")
    global_ranks = list(backend_opts.global_ranks_in_group or [])
    try:
        comm = _connect(store, rank, size, timeout, pg_options, global_ranks)
    except BaseException as exc:
        raise _dist_error(exc, rank, name, "process group set-up") from exc
    return BitcollProcessGroup(comm, store, rank, size, timeout, name)


def register() -> None:
    """Register the backend ``"bitcoll"`` with ``torch.distributed`` (done on import;
    repeating it is harmless)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])


def _group(group: Any) -> BitcollProcessGroup:
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group() if group is None else group
    if not isinstance(pg, BitcollProcessGroup):
        raise UsageError(f"{pg!r} is not a process group of the {BACKEND_NAME!r} backend "
                         f"(init_process_group({BACKEND_NAME!r}) or new_group(backend="
                         f"{BACKEND_NAME!r}))")
    return pg


def communicator_of(group: dist.ProcessGroup | None = None) -> Communicator:
    """The bitcoll :class:`~bitcoll.Communicator` behind ``group`` (None: the default group),
    of the same ranks in the same order. UsageError if ``group`` is not a bitcoll group.

    The communicator refuses calls from two threads at once: while torch collectives of the
    group may be in flight (they run on the group's worker thread), call it through
    :func:`submit`."""
    return _group(group)._comm


def monitored_barrier(group: dist.ProcessGroup | None = None,
                      timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for a bitcoll group (None: the default group):
    torch's own function accepts only gloo groups (``distributed_c10d.monitored_barrier``
    raises ValueError for any other backend). Same arguments and semantics as torch's: the
    ranks that did not arrive within ``timeout`` (default the group's) are named in the
    ``DistBackendError`` raised on rank 0, and here on every rank that arrived
    (:meth:`BitcollProcessGroup.monitored_barrier`). UsageError if ``group`` is not a
    bitcoll group."""
    _group(group).monitored_barrier(timeout, wait_all_ranks)


def submit(fn: Callable[[Communicator], Any],
           group: dist.ProcessGroup | None = None) -> Future[Any]:
    """Run ``fn(communicator_of(group))`` on the group's worker thread, after the torch
    collectives issued before it and before those issued after it (every rank must submit in
    the same order relative to its collectives). Returns a ``torch.futures.Future`` of its
    result (failed with torch's error types, see the module docstring)."""
    pg = _group(group)
    return pg._submit("submit", lambda: fn(pg._comm)).get_future()


register()
