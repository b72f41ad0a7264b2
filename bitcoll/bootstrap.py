"""``bitcoll.init``: pick a backend from the environment and build a Communicator.

Backends, in the order ``backend="auto"`` tries them:

1. ``"mpi"``: ``comm=`` was given (an mpi4py communicator), or the process was started by an
   MPI launcher (``mpiexec``/``mpirun``, ``srun --mpi=...``: PMI/PMIx variables) and mpi4py
   imports. Uses a private duplicate of ``comm`` (default ``MPI.COMM_WORLD``).
2. ``"tcp"`` from the **torchrun contract**: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
   ``MASTER_PORT`` are set (``python -m launch``, ``torchrun``, your own scripts).
3. ``"tcp"`` from **Slurm** (``srun`` without MPI): ``SLURM_PROCID``, ``SLURM_NTASKS`` and
   ``SLURM_JOB_NODELIST`` are set; rank = ``SLURM_PROCID``, size = ``SLURM_NTASKS``, master
   address = the first host of ``SLURM_JOB_NODELIST`` (:func:`expand_hostlist`).
4. ``"local"``: a one-rank world.

Where the TCP backend meets (the *rendezvous store*), first match wins:

* ``store=``: a torch.distributed ``Store`` (or any object with its ``set``/``get``/``add``/
  ``wait`` methods) the job already has: no port of bitcoll's own.
* ``BITCOLL_MASTER_PORT`` set: bitcoll's own store on ``MASTER_ADDR:BITCOLL_MASTER_PORT``.
* under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): the store torchrun's agent serves at
  ``MASTER_ADDR:MASTER_PORT`` (``torch.distributed`` is imported for that, and only then).
* otherwise bitcoll's own store, served by rank 0, on ``MASTER_ADDR:MASTER_PORT + 1``: the
  port ``MASTER_PORT`` itself is left to ``torch.distributed.init_process_group``, so both can
  run in one script in either order. Under Slurm without ``MASTER_PORT``: port
  ``20000 + SLURM_JOB_ID % 20000``.

Authentication: see :mod:`bitcoll.transport.rendezvous.auth` (``BITCOLL_SECRET``; without it,
a private file of rank 0's user, which works when every rank runs on one host).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from .communicator import (
    DEFAULT_SEGMENT_BYTES,
    REMOTE_SEGMENT_BYTES,
    Communicator,
)
from .config import (
    DEFAULT_TIMEOUT,
    ENV_CHECKSUM,
    ENV_INTEGRITY,
    ENV_MASTER_PORT,
    ENV_RENDEZVOUS_TIMEOUT,
    ENV_TWO_LEVEL,
    rendezvous_timeout,
    switch,
)
from .errors import CommTimeoutError, UsageError
from .plan import CostModel, load_model
from .topology import usable_cores
from .transport.base import Transport
from .transport.local import LocalTransport

_log = logging.getLogger("bitcoll.tcp")

__all__ = ["init", "detect_backend", "TCP_ENV", "SLURM_ENV", "tcp_environment",
           "expand_hostlist", "TcpEnvironment", "warm_up_tcp"]

TCP_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_ENV = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")
BACKENDS = ("auto", "mpi", "tcp", "local")
#: First port of the range the Slurm rule picks from (``20000 + SLURM_JOB_ID % 20000``).
SLURM_PORT_BASE = 20000


def detect_backend() -> str:
    """The backend ``init(backend="auto")`` would choose in this process (see the module
    docstring for the order)."""
    from .transport.mpi import launched_by_mpi, mpi_available

    if launched_by_mpi() and mpi_available():
        return "mpi"
    if all(os.environ.get(k) for k in TCP_ENV) or all(os.environ.get(k) for k in SLURM_ENV):
        return "tcp"
    return "local"


def _int(env: dict[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name} must be an integer, got {value!r}",
                         argument=name) from None


def _port(value: int, what: str, variable: str) -> int:
    if not 0 < value < 65536:
        raise UsageError(f"{what} must be a TCP port in 1..65535, got {value}",
                         argument=variable)
    return value


_HOST_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<ranges>[^\[\]]+)\](?P<suffix>.*)$")


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``"node[01-03,07],gpu1"`` gives ``["node01", "node02",
    "node03", "node07", "gpu1"]`` (zero padding kept; one bracket group per name, and a
    suffix after it is kept, e.g. ``"r[1-2]-ib"``). UsageError for a malformed list."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"malformed Slurm host list {nodelist!r}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise UsageError(f"malformed Slurm host list {nodelist!r}")
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (x.strip() for x in items):
        if not item:
            continue
        m = _HOST_RANGE.match(item)
        if m is None:
            if "[" in item or "]" in item:
                raise UsageError(f"malformed Slurm host list {nodelist!r}")
            hosts.append(item)
            continue
        for part in m.group("ranges").split(","):
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise UsageError(f"malformed range {part!r} in Slurm host list {nodelist!r}")
            width = len(lo)
            for k in range(int(lo), int(hi if sep else lo) + 1):
                hosts.append(f"{m.group('prefix')}{k:0{width}d}{m.group('suffix')}")
    if not hosts:
        raise UsageError(f"empty Slurm host list {nodelist!r}")
    return hosts


@dataclass(frozen=True)
class TcpEnvironment:
    """Where a TCP-backend rank stands, from the environment: ``rank``, ``size``,
    ``master_addr``, ``master_port`` (bitcoll's own store; None when an external store is
    used), ``agent_store`` (True under torchrun's agent store), ``source`` ("torchrun
    contract" or "Slurm"), ``size_from`` (the variable the world size came from, e.g.
    ``"SLURM_NTASKS=4 (Slurm)"``) and ``warning`` (why the other ranks may never come, e.g.
    Slurm's variables without ``srun``; empty when nothing looks wrong)."""

    rank: int
    size: int
    master_addr: str
    master_port: int | None
    agent_store: bool
    source: str
    size_from: str = ""
    warning: str = ""


#: Slurm's step ids from this one up are no ``srun`` step (the batch script's, the extern
#: step's, the interactive step's, a pending step's).
SLURM_SPECIAL_STEPS = 0xFFFFFFF0


def slurm_without_srun(env: dict[str, str]) -> str:
    """Why a process that has Slurm's ``SLURM_NTASKS`` (more than 1) was not started by
    ``srun``, or "" when it was (or when it is one task anyway). ``srun`` sets
    ``SLURM_STEP_ID`` to the number of its job step; a batch script (``sbatch``) runs once, on
    the job's first node, outside any such step (``SLURM_STEP_ID`` unset, or one of Slurm's
    special step ids), so its ranks 1 to N-1 never start."""
    if not env.get("SLURM_NTASKS", "").isdigit() or int(env["SLURM_NTASKS"]) <= 1:
        return ""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    if step.isdigit() and int(step) < SLURM_SPECIAL_STEPS:
        return ""
    why = "SLURM_STEP_ID is not set" if not step else f"SLURM_STEP_ID={step} is no srun step"
    return (f"this process was not started by srun ({why}): an sbatch script runs once, so the "
            f"other {int(env['SLURM_NTASKS']) - 1} tasks never start; run the program with "
            "`srun python script.py` inside the batch script")


def tcp_environment(environ: dict[str, str] | None = None,
                    external_store: bool = False) -> TcpEnvironment:
    """Read rank, size and the rendezvous address from the environment (the torchrun
    contract first, then Slurm's variables); see the module docstring for the port rule.
    ``external_store``: a store was passed to ``init``, so no port is needed. UsageError
    naming what is missing or malformed."""
    env = dict(os.environ if environ is None else environ)
    warning = ""
    if all(env.get(k) for k in ("RANK", "WORLD_SIZE")):
        source = "torchrun contract"
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        addr = env.get("MASTER_ADDR", "")
        size_from = f"WORLD_SIZE={size} ({source})"
    elif all(env.get(k) for k in SLURM_ENV):
        source = "Slurm"
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        addr = env.get("MASTER_ADDR") or expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        size_from = f"SLURM_NTASKS={size} ({source})"
        warning = slurm_without_srun(env)
    else:
        raise UsageError(
            "backend 'tcp' needs the environment variables " + ", ".join(TCP_ENV)
            + " (torchrun's contract) or " + ", ".join(SLURM_ENV)
            + " (srun); start the ranks with `python -m launch -n N script.py`, torchrun or "
            "srun")
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} is not in [0, world size {size}) ({source})",
                         argument="RANK" if source != "Slurm" else "SLURM_PROCID")
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    port: int | None = None
    if env.get(ENV_MASTER_PORT):
        port = _port(_int(env, ENV_MASTER_PORT), ENV_MASTER_PORT, ENV_MASTER_PORT)
        agent = False
    elif external_store or agent:
        port = None
    elif env.get("MASTER_PORT"):
        port = _port(_int(env, "MASTER_PORT") + 1, "MASTER_PORT + 1", "MASTER_PORT")
    elif source == "Slurm" and env.get("SLURM_JOB_ID"):
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % 20000
    if not addr and not external_store:
        raise UsageError(f"backend 'tcp' needs MASTER_ADDR ({source})", argument="MASTER_ADDR")
    if port is None and not (external_store or agent):
        raise UsageError(f"backend 'tcp' needs MASTER_PORT or {ENV_MASTER_PORT} ({source})",
                         argument="MASTER_PORT")
    if agent and not env.get("MASTER_PORT"):
        raise UsageError("TORCHELASTIC_USE_AGENT_STORE is set but MASTER_PORT is not: this "
                         "process was not started by torchrun")
    return TcpEnvironment(rank, size, addr, port, agent and not external_store, source,
                          size_from, warning)


#: Deadline (seconds) of the collectives of :func:`warm_up_tcp`: compiling their kernels on a
#: cold numba cache takes seconds, tens of seconds on a busy host.
_WARM_UP_TIMEOUT = 600.0
_warm_lock = threading.Lock()
_warmed = False


def warm_up_tcp() -> None:
    """Compile (or load from numba's disk cache) the kernels a TCP communicator's first
    collectives run, before this process meets its peers: once per process, two
    communicators of this process, over a socket pair, run the streamed all-gather of
    :attr:`Communicator.topology` (the native stream kernel, :mod:`bitcoll.kernels.stream`) and
    a small all-reduce on the frame path.

    A numba kernel is compiled at its first call when numba's cache has no copy of it (a fresh
    checkout, an edited kernel): seconds, tens of seconds on a busy host. Made in a collective,
    that time counts against the collective's deadline on the rank that compiles; a rank whose
    deadline passes during its first stream call gives up at the next quiet poll, while a peer
    that compiled for longer finds its frames waiting and completes the collective. Here no
    peer waits and no deadline runs; ranks that compile for about as long meet afterwards with
    their whole deadlines. ``bitcoll.init`` (TCP backend) and the elastic group
    (:meth:`bitcoll.elastic.ElasticGroup.start`) call it before their rendezvous. Never raises:
    after a failure (logged at debug level, logger ``bitcoll.tcp``) the kernels are compiled at
    their first use, as without it."""
    global _warmed
    with _warm_lock:
        if _warmed:
            return
        _warmed = True
        try:
            _warm_pair()
        except Exception as exc:  # the collectives compile their kernels themselves then
            _log.debug("warming the TCP kernels up failed: %s: %s", type(exc).__name__, exc)


def _warm_pair() -> None:
    """The collectives of :func:`warm_up_tcp` between two communicators of this process."""
    from .transport.tcp import TCPTransport

    socks = socket.socketpair()
    comms: list[Communicator] = []
    errors: list[BaseException] = []

    def run(comm: Communicator) -> None:
        try:
            comm.topology  # noqa: B018  (the streamed all-gather every communicator starts with)
            comm.allgather(np.array([1], np.uint8))  # share_hosts' (bytes: the same kernel)
            v = np.array([1, -1, 0], np.int64)
            comm.allreduce(v, op="max", out=v)  # the elastic commit's (frame path)
        except BaseException as exc:
            errors.append(exc)
            if comm.transport.failure is None:
                comm.transport.abort(f"warm-up failed: {exc}")  # the other side fails now

    try:
        for r in (0, 1):
            comms.append(Communicator(
                TCPTransport(r, 2, {1 - r: socks[r]}, None, 0, checksum=True),
                timeout=_WARM_UP_TIMEOUT))
        peer = threading.Thread(target=run, args=(comms[1],), daemon=True,
                                name="bitcoll-warm-up")
        peer.start()
        run(comms[0])
        peer.join()
    finally:
        for c in comms:
            c.close()
        for s in socks:
            s.close()  # (closed already by a transport that took it)
    if errors:
        raise errors[0]


def _tcp_transport(timeout: float, store: object | None, integrity: bool,
                   send_buffer: int | None, place: tuple[int, int] | None = None,
                   checksum: bool | None = None) -> Transport:
    from .transport.rendezvous.external_store import check_store, torchrun_store
    from .transport.tcp import TCPTransport

    if store is not None:
        check_store(store)
    setup = rendezvous_timeout(timeout)  # the ranks meet sooner than a collective's deadline
    if place is not None and store is not None:  # rank and size given with the store
        rank, size = place
        te = TcpEnvironment(rank, size, os.environ.get("MASTER_ADDR", ""), 0, False,
                            "init arguments", f"size={size} (bitcoll.init's argument)")
    else:
        te = tcp_environment(external_store=store is not None)
        if te.size > 1 and te.agent_store:
            store, _ = torchrun_store(setup)
    if te.warning:  # say it now, not only at the deadline
        warnings.warn(f"bitcoll.init: {te.warning} (waiting up to {setup:g} s for them)",
                      RuntimeWarning, stacklevel=3)
    if te.size > 1:
        warm_up_tcp()  # kernels compiled before the peers wait on this rank's collectives
    try:
        return TCPTransport.create(te.rank, te.size, te.master_addr, te.master_port or 0,
                                   timeout=setup, store=store, integrity=integrity,
                                   send_buffer=send_buffer, checksum=checksum)
    except CommTimeoutError as exc:
        # Name where the world size came from (and why the others may never come).
        raise CommTimeoutError(
            f"{exc}; the world size came from {te.size_from}"
            + (f"; {te.warning}" if te.warning else "")
            + f" (the rendezvous deadline is {setup:g} s: {ENV_RENDEZVOUS_TIMEOUT})",
            rank=exc.rank, peer=exc.peer) from exc


def _agreed_model(comm: Communicator) -> CostModel:
    """Rank 0's cost model (:func:`bitcoll.plan.load_model`, its host's cores), given to every
    rank with one broadcast so that every rank's automatic choices agree. A rank whose own
    model file or variables are bad raises UsageError (its peers: PeerLostError)."""
    with comm._validating("init"):
        model = load_model()
        if "BITCOLL_COST_HOST_CORES" not in os.environ:
            model = model.replace(host_cores=float(usable_cores()))
    if comm.size == 1:
        return model
    return CostModel.from_array(comm.broadcast(model.as_array(), root=0))


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT,
         segment_bytes: int | None = None,
         packed_segment_bytes: int | None = None, *,
         comm: object | None = None, store: object | None = None,
         integrity: bool | None = None, shm: bool | None = None,
         two_level: bool | None = None, send_buffer: int | None = None,
         rank: int | None = None, size: int | None = None,
         checksum: bool | None = None) -> Communicator:
    """Create the communicator of this process's world.

    ``backend``: "auto", "mpi", "tcp" or "local" (see the module docstring for how "auto"
    chooses and where the TCP ranks meet). ``timeout``: the default deadline in seconds of
    every blocking operation, connection set-up included. ``segment_bytes``: the wire segment
    size of the dense ring algorithms (default: 32 MiB when every rank runs on one host, 4 MiB
    when they span several, :data:`~bitcoll.communicator.REMOTE_SEGMENT_BYTES`);
    ``packed_segment_bytes``: that of the packed-bit pipelines (default None: the planner
    chooses it per call, :func:`bitcoll.plan.segment_for`). Every rank must pass the same
    values.
    ``comm``: an mpi4py communicator (e.g. ``MPI.COMM_WORLD.Split(...)``): the MPI backend on
    a private duplicate of it (collective over ``comm``). ``store``: a torch.distributed
    ``Store`` (duck-typed: ``set``/``get``/``add``/``wait``) for the TCP backend's rendezvous;
    rank and size still come from the environment. ``integrity`` (TCP backend; default:
    ``BITCOLL_INTEGRITY=1`` in the environment, else off): every data frame carries a keyed MAC
    checked on arrival, so a frame altered on the wire is a ProtocolError rather than a wrong
    result (every rank must use the same setting; costs a hash pass over the bytes on each
    side, see the README). ``checksum`` (TCP backend; default: ``BITCOLL_CHECKSUM`` in the
    environment, ``0`` or ``1``, else on; off where ``integrity`` is on, whose tag covers it):
    every TCP data frame carries a CRC32C checked on arrival, so a frame altered on the wire is
    a ProtocolError naming the link rather than a wrong result (every rank must use the same
    setting; shared memory and MPI carry none). ``shm`` (TCP backend; default: ``BITCOLL_SHM``
    in the environment, ``0`` or ``1``, else on): ranks that share a host exchange frames
    through shared memory instead of TCP (:mod:`bitcoll.transport.shm.hybrid`); ignored by the
    other backends. ``two_level`` (default: ``BITCOLL_TWO_LEVEL`` in the environment, ``0`` or
    ``1``, else on): whether the two-level algorithms are the default when the ranks run on
    several hosts and some host runs several (:attr:`Communicator.two_level`); every rank must
    use the same setting (a rank that differs fails the first collective it changes with
    ProtocolError). ``send_buffer`` (TCP backend; default: ``BITCOLL_SEND_BUFFER`` in the
    environment, else 128 KiB, :data:`bitcoll.transport.tcp.SEND_BUFFER_BYTES`): the send
    buffer of each TCP data connection, in bytes, 0 for the kernel's own sizing (see the
    README, "Socket buffers"); a rank with a bad value refuses to join, and the others fail at
    once naming it. ``rank`` and ``size`` (only with ``store=``, both or neither):
    this process's rank and the number of ranks, instead of reading them from the
    environment (a torch.distributed backend knows them from its process group).

    Once the ranks know which of them share a host, the numba kernels of this process get
    its share of the host's cores (:func:`bitcoll.kernels.fit_threads_to_host`; not when
    ``NUMBA_NUM_THREADS`` is set or :func:`bitcoll.kernels.set_num_threads` was called).

    Raises UsageError for an unknown backend, ``comm`` that is not an mpi4py
    intra-communicator, ``comm`` with a non-MPI backend, ``store`` lacking a method or with a
    non-TCP backend, ``send_buffer`` with a non-TCP backend, ``rank``/``size`` without
    ``store`` (or one without the other, or not a rank in ``[0, size)``), or an
    inconsistent environment; CommTimeoutError when the other ranks do not show up before
    the deadline.

    Use it as a context manager to release the connections at the end::

        with bitcoll.init() as comm:
            y = comm.allreduce(x, op="avg")
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}",
                         argument="backend")
    if comm is not None and store is not None:
        raise UsageError("pass comm= (MPI backend) or store= (TCP backend), not both")
    if comm is not None:
        if backend not in ("auto", "mpi"):
            raise UsageError(f"comm= selects the MPI backend; backend={backend!r} contradicts "
                             "it", argument="backend")
        backend = "mpi"
    if store is not None:
        if backend not in ("auto", "tcp"):
            raise UsageError(f"store= selects the TCP backend; backend={backend!r} "
                             "contradicts it", argument="backend")
        backend = "tcp"
    place: tuple[int, int] | None = None
    if rank is not None or size is not None:
        if store is None or rank is None or size is None:
            raise UsageError("rank= and size= come together, and only with store=")
        if isinstance(rank, bool) or isinstance(size, bool) or not isinstance(rank, int) or \
                not isinstance(size, int) or size < 1 or not 0 <= rank < size:
            raise UsageError(f"rank {rank!r} is not in [0, size {size!r})")
        place = (rank, size)
    check = switch(integrity, "integrity", ENV_INTEGRITY, False)
    layered = switch(two_level, "two_level", ENV_TWO_LEVEL, True)
    from .transport.shm.hybrid import shm_enabled

    use_shm = shm_enabled(shm)
    if backend == "auto":
        backend = detect_backend()
    if integrity and backend != "tcp":
        raise UsageError(f"integrity=True protects the TCP backend's frames; the {backend} "
                         "backend does not use it", argument="integrity")
    checked = switch(checksum, "checksum", ENV_CHECKSUM, True)
    if checksum and backend != "tcp":
        raise UsageError(f"checksum=True checks the TCP backend's frames; the {backend} "
                         "backend does not use it", argument="checksum")
    if send_buffer is not None and backend != "tcp":
        raise UsageError(f"send_buffer= sizes the TCP backend's connections; the {backend} "
                         "backend does not use it", argument="send_buffer")
    transport: Transport
    if backend == "mpi":
        from .transport.mpi import MPITransport

        transport = MPITransport.create(comm, timeout=timeout)
    elif backend == "tcp":
        transport = _tcp_transport(timeout, store, check, send_buffer, place, checked)
    else:
        transport = LocalTransport()
    comm = Communicator(transport, timeout=timeout,
                        segment_bytes=DEFAULT_SEGMENT_BYTES if segment_bytes is None
                        else segment_bytes,
                        packed_segment_bytes=packed_segment_bytes, two_level=layered)
    try:
        comm.topology  # noqa: B018  (exchanges the host keys once, see bitcoll.topology)
        comm.cost_model = _agreed_model(comm)
    except BaseException:
        comm.close()
        raise
    from . import kernels

    kernels.fit_threads_to_host(comm.local_size)  # the host's cores shared by its ranks
    # -- shared memory between the ranks of one host (bitcoll.transport.shm) ------------------
    if backend == "tcp" and comm.topology.num_hosts < comm.size:
        comm = share_hosts(comm, use_shm, timeout)  # closes comm when it raises
    # -- end of shared memory ----------------------------------------------------------------
    if segment_bytes is None and comm.num_hosts > 1:
        comm.segment_bytes = REMOTE_SEGMENT_BYTES  # across links: smaller pieces stream better
    comm._number_from_here()  # the program's first collective is #0 on every backend
    return comm


def share_hosts(comm: Communicator, use_shm: bool, timeout: float) -> Communicator:
    """``bitcoll.init``'s step for a TCP world where some host runs several ranks: agree on
    the ``shm`` setting (one all-gather of a byte; a host whose ranks disagree is a UsageError
    on every rank), then, when it is on, a new Communicator over a
    :class:`~bitcoll.transport.shm.HybridTransport` (same settings, topology known; over the
    plain TCP transport on ranks that map no segment, so that every rank returns a new
    communicator at collective #0). A step of :func:`init` (and of the elastic group's
    epochs), not of the transport: no transport module imports the communicator.
    Collective over ``comm``; ``comm`` is closed when this raises."""
    from .transport.shm.hybrid import ENV_SHM, HybridTransport
    from .transport.tcp import TCPTransport

    try:
        topo = comm.topology
        flags = comm.allgather(np.array([1 if use_shm else 0], np.uint8), timeout=timeout)
        split = sorted({h for h in set(topo.hosts)
                        if len({int(flags[r]) for r in range(comm.size) if topo.hosts[r] == h})
                        > 1})
        if split:
            bad = [r for r in range(comm.size) if topo.hosts[r] in split]
            on = [r for r in bad if flags[r]]
            raise UsageError(
                f"rank {comm.rank}: ranks {bad} share a host but disagree on shared memory "
                f"(on for ranks {on}, off for the others); pass the same shm= to "
                f"bitcoll.init, or set {ENV_SHM} alike, on every rank")
        tcp = comm.transport
        if isinstance(tcp, TCPTransport):
            tcp.oversubscribed = topo.oversubscribed
        if not use_shm or not isinstance(tcp, TCPTransport):
            return comm
        wrapped = HybridTransport.create(tcp, topo.hosts, timeout)
    except BaseException:
        comm.close()
        raise
    # A new Communicator on every rank, also where no segment was mapped (a host of one rank,
    # or a failed probe): every rank must restart at collective #0 together.
    return Communicator(wrapped, timeout=comm.timeout, segment_bytes=comm.segment_bytes,
                        packed_segment_bytes=comm.packed_segment_bytes, topology=topo,
                        two_level=comm.two_level, cost_model=comm.cost_model,
                        shm=bool(flags.any()))
