"""Membership epochs: a TCP job that survives lost ranks and takes new ones in.

An :class:`ElasticGroup` is one process's seat in an elastic job. Its members are
*processes*, named by a member id that is never reused; the ranks of the job run collectives
on the communicator of the current *epoch* (:attr:`ElasticGroup.comm`). An epoch is a fixed
member list; its communicator numbers the members ``0..size-1`` in list order. When a
collective fails (:class:`~bitcoll.errors.CommError`: a killed process, a closed connection,
a peer hung past its deadline) the survivors agree through the rendezvous store on who is
still there and build the communicator of the next epoch (:meth:`ElasticGroup.recover`);
processes that wait to join are taken in at a step boundary (:meth:`ElasticGroup.commit`
says when, :meth:`ElasticGroup.recover` does it).

The store
---------
Every member talks to a store that must outlive every rank: the one ``python -m launch
--max-restarts N`` serves (``BITCOLL_ELASTIC_STORE=host:port``, authenticated with the job's
secret, :mod:`launch.store_host`), or torchrun's agent store. Rank 0's own store (plain
``bitcoll.init``) would die with rank 0, so :meth:`ElasticGroup.from_env` refuses to run
without one of the two. Each member keeps two store connections: one for the protocol, one
for its *heartbeat* thread, which writes a counter under ``hb/<id>`` every
``heartbeat`` seconds and reads the counters of the epoch's other members: when one has not
moved for ``dead_after`` seconds (a stopped or hung process, a host cut off), the thread
aborts the epoch's communicator, so every member's collective fails at once and the
transition starts then, not at the collective's deadline (``timeout``, the backstop). A
false alarm (a member starved of CPU) costs the step in flight, not the member: it is still
waited for while its heartbeat moves.

Keys (under ``prefix``, default ``"elastic/"``, for generation 0; generation ``g > 0``
under ``prefix + "g<g>/"``, see *Generations* below)::

    generation              (under ``prefix`` itself) the newest generation; absent: 0
    current                 the newest epoch number (a job exists: later processes join)
    roster                  the newest epoch's number and members (JSON), written with current
    e/0/id/<r>              the member id of initial rank r (epoch 0 forms from RANK order)
    hb/<id>                 the heartbeat counter of a member or joiner
    joiners/count, /<n>     joiners in arrival order
    admit/<id>              "<epoch> <attempt>": the transition that took joiner <id> in
    e/<e>/t/<a>/here/<id>   a member's report in attempt a of leaving epoch e
    e/<e>/t/<a>/claim       counter: the first to add 1 decides attempt a
    e/<e>/t/<a>/decider     the decider's id
    e/<e>/t/<a>/decision    the decision (JSON): members of epoch e+1, who left, who joined,
                            the committed step, or "no quorum"
    e/<e>/t/<a>/mesh/...    the connection set-up of epoch e+1 (transport.tcp_bootstrap)

Leaving epoch ``e`` (:meth:`ElasticGroup.recover`)
-------------------------------------------------
1. Every survivor aborts its communicator (the peers fail at once), writes its report
   (``committed``: the last step it applied; ``pending``: it holds the next step's
   exchanged result, not applied yet) under ``here/<id>`` of attempt ``a`` (0 first) and
   adds 1 to ``claim``; the one that gets 1 is the *decider* of attempt ``a``.
2. The decider waits until every member of epoch ``e`` has reported, or is *gone*: its
   process is seen dead on this host (``/proc``), or its heartbeat did not move for
   ``dead_after`` seconds (timed from when this process's heartbeat thread first saw it
   still). A member whose heartbeat moves is waited for: the verdicts depend on liveness,
   not on which survivor reports first; only a member alive but silent in the protocol for
   twice the collective deadline (``2 * timeout``) is left out as hung. The survivors are
   the members that reported, in their old rank order; the joiners whose heartbeat is
   present follow them.
3. **Quorum.** The survivors must be more than half of epoch ``e``'s members and at least
   ``min_size``; otherwise the decision is "no quorum" and every survivor raises
   :class:`NoQuorumError`. Two disjoint sets cannot both hold a majority, so there is never
   more than one epoch ``e + 1`` (no split brain), even if a decider is slow and a second
   attempt starts.
4. The decision (written once, by the decider) names epoch ``e + 1``'s members, the old
   ranks that left, the joiners and the *committed step* ``C``: the largest ``committed``
   reported. The others wait for it while watching the decider's heartbeat; a decider that
   dies (or stalls ``dead_after``, or names itself not within ``timeout`` of its claim)
   before deciding sends them to attempt ``a + 1``.
5. A process that is not in the decision (it reported too late, or it is a stale rank of an
   old epoch) raises :class:`EvictedError`: it must not touch the job's state again; it
   may come back as a joiner (:meth:`ElasticGroup.rejoin`).
6. The members build epoch ``e + 1``'s connections under the attempt's key namespace. The
   handshakes prove a key derived from the job's secret *and* the epoch, the attempt and the
   member list (:func:`epoch_secret`), so a process of another epoch, or a stranger, is
   refused at the hello. The host keys are then all-gathered (the new communicator's first
   collective) and ranks on one host share memory as ``bitcoll.init`` arranges it. A
   failure in this step starts the leaving of epoch ``e + 1``.

Commit: every step on every live rank or on none
-------------------------------------------------
A training step first exchanges (its collectives), then calls :meth:`ElasticGroup.commit`
(one all-reduce of three int64) and applies its update only when that returns. Since no rank
completes an all-reduce before every rank entered it, a rank that applied step ``k`` proves
that every member finished step ``k``'s exchange. Hence after any failure the survivors'
``committed`` differ by at most one, and those one behind hold step ``C``'s result: the
decision's ``C`` tells each survivor to keep its state (``committed == C``), apply its
pending result (``committed == C - 1`` and ``pending``) or discard a half-done step. Only the
step in flight is lost, never a committed one, and no rank ever applies a step another live
rank does not.

Joining
-------
A process that finds ``current`` in the store (a restarted rank, or one started by hand) is
a *joiner*: it registers under ``joiners/`` and waits, heartbeating, until a transition
takes it in. Rank 0 of the epoch looks for joiners at most every ``join_check`` seconds and
sets a flag in the next :meth:`commit`; every member then sees the flag at the same step and
calls :meth:`recover` with nothing failed (a planned transition). The joiner gets the
job's state from the members over the new epoch's authenticated connections
(:func:`share_state`: each holder sends one slice straight into the joiner's arrays, and
the holders' average of a float32 state, e.g. momenta, is computed slice by slice by its
owner and sent from there, in the same call).

Generations
-----------
A process that finds a job running but every member of its newest epoch (``roster``) gone
(dead on this host, or its heartbeat still for ``dead_after``) would wait forever as a
joiner: nobody is left to admit it. That is what happens when every process of the job is
replaced at once, as torchrun's agent does (one worker fails: the agent stops all workers
of the node and starts them again; with the c10d rendezvous the other nodes' agents restart
theirs too). Such a process starts the next *generation* (``generation`` + 1): a fresh key
namespace where the processes of the new start form epoch 0 from their ``RANK`` order, as
the first start did. The job's state then comes from the program's own checkpoint (nobody
holding it is left). A process that sees one member's heartbeat move joins as before.

Not covered: a lost store (the launcher's host) ends the job; MPI jobs fail fast as before
(ULFM is not in the MPICH wheel); see ``docs/elastic.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .communicator import Communicator
from .errors import BitcollError, CommError, CommTimeoutError, ProtocolError, UsageError
from .partition import block_bounds
from .topology import digest, host_key
from .transport.rendezvous import auth
from .transport.rendezvous.tcp_bootstrap import (
    RendezvousStore,
    _Rendezvous,
    build_mesh,
    send_buffer_bytes,
)

__all__ = ["ElasticGroup", "Epoch", "EvictedError", "JobFinished", "NoQuorumError", "StoreFactory",
           "epoch_secret", "share_state", "ENV_ELASTIC_STORE", "DEFAULT_HEARTBEAT",
           "DEFAULT_DEAD_AFTER"]

_log = logging.getLogger("bitcoll.elastic")

#: Environment variable with the ``host:port`` of the store ``python -m launch`` serves.
ENV_ELASTIC_STORE: Final = "BITCOLL_ELASTIC_STORE"
#: Seconds between two heartbeats of a member.
DEFAULT_HEARTBEAT: Final = 0.1
#: Seconds without a heartbeat after which a member that did not report is gone.
DEFAULT_DEAD_AFTER: Final = 0.5
#: Seconds between rank 0's looks for joiners (one store round trip each).
DEFAULT_JOIN_CHECK: Final = 0.5
#: Poll interval of the store waits of the protocol.
_POLL: Final = 0.005

#: Opens a new connection to the job's store (each call a new one: the protocol and the
#: heartbeat thread must not wait on each other).
StoreFactory = Callable[[], RendezvousStore]

#: Called with a protocol point ("formed": a decision names the next epoch, before its
#: connections are built; "initial": the same for epoch 0) and the epoch, when set: the
#: tests' way to fail a process at an exact point of a transition.
_FAULT_HOOK: Callable[[str, Epoch], None] | None = None


class EvictedError(CommError):
    """This process is no longer a member: the others moved to a new epoch without it
    (it reported too late, or it belongs to an old epoch). Its state is stale; it may come
    back as a joiner (:meth:`ElasticGroup.rejoin`)."""


class JobFinished(BitcollError):
    """The job ended (its members called :meth:`ElasticGroup.finish`) while this process
    waited to join: there is nothing left to do."""


class NoQuorumError(CommError):
    """The survivors of an epoch are not more than half of its members (or fewer than
    ``min_size``): the job cannot go on without risking two diverging halves."""


def epoch_secret(secret: bytes, epoch: int, attempt: int, members: Sequence[str]) -> bytes:
    """The key the connection hellos of an epoch prove: the job's secret bound to the epoch,
    the attempt that decided it and its member list (32 bytes)."""
    return auth.mac(secret, "bitcoll-elastic-epoch", epoch, attempt, "\n".join(members))


@dataclass(frozen=True)
class Epoch:
    """What a transition decided, as seen by this process.

    ``number``: the epoch; ``members``: member ids in rank order; ``rank``/``size``: this
    process's rank and the world size; ``left``: the ranks *of the previous epoch* that are
    not in this one; ``joined``: the new ranks of the processes that joined (they hold no
    state: see :func:`share_state`); ``holders``: the ranks that hold the job's state;
    ``step``: the committed step ``C`` (-1 before any); ``action``: what this process does
    with its own state: "keep", "apply" (its pending result) or "discard" (back to its last
    applied step) — or "receive" for a joiner."""

    number: int
    members: tuple[str, ...]
    rank: int
    left: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    holders: tuple[int, ...] = ()
    step: int = -1
    action: str = "keep"

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass
class _Report:
    committed: int
    pending: bool
    joiner: bool = False


def _load_kernels() -> None:
    """Load numba's machinery and the kernels an epoch's first collectives run, before the
    process announces itself. The first kernel a process runs loads numba's registries, which
    takes seconds on a busy host, and a kernel numba's cache has no copy of (a fresh checkout,
    an edited kernel) is compiled at its first call, seconds to tens of seconds: done here,
    that time does not count against the deadline of the epoch's first collective (the
    host-key all-gather: the stream kernel), which the other members wait on
    (:func:`bitcoll.bootstrap.warm_up_tcp`)."""
    from . import kernels
    from .bootstrap import warm_up_tcp

    kernels.pack_signs(np.zeros(8, np.float32))
    warm_up_tcp()


def _proc_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid``; None when it is gone or a
    zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    if not fields or fields[0] == b"Z" or fields[0] == b"X":
        return None
    return int(fields[19])


def _new_id(label: str) -> str:
    pid = os.getpid()
    start = _proc_start(pid) or 0
    return f"{label}:{digest(host_key()):x}:{pid}:{start}:{secrets.token_hex(4)}"


def _gone_here(member: str) -> bool:
    """True when ``member`` ran on this host and its process no longer exists."""
    parts = member.split(":")
    if len(parts) != 5:
        return False
    _, host, pid, start, _ = parts
    if host != f"{digest(host_key()):x}":
        return False
    try:
        return _proc_start(int(pid)) != int(start)
    except ValueError:
        return False


@dataclass
class _Watch:
    """What a heartbeat thread watches: the other members of an epoch (their heartbeat
    keys) and what to call, once, when one of them falls silent."""

    keys: dict[str, int]  # heartbeat key -> the member's rank in the epoch
    on_silent: Callable[[list[int]], None]
    since: float  # when the watch began (a member not seen to beat is silent from here)


@dataclass
class _Heartbeat:
    """A member's heartbeat thread: every ``every`` seconds it writes its counter under
    ``key`` and looks at the counters of the members of the current epoch (the *watch*).
    A member whose counter did not move for ``dead_after`` is *silent*: the thread calls the
    watch's ``on_silent`` once (the group aborts the epoch's communicator, so every member's
    collective fails at once instead of at its deadline). ``seen`` holds, per heartbeat
    key, the last counter read and since when it has not moved: the decider of a transition
    starts from it, so a silence is not timed twice."""

    store: RendezvousStore
    key: str
    every: float
    dead_after: float = DEFAULT_DEAD_AFTER
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    watch: _Watch | None = None
    seen: dict[str, tuple[bytes | None, float]] = field(default_factory=dict)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True, name="bitcoll-heartbeat")
        self.thread.start()

    def set_watch(self, watch: _Watch | None) -> None:
        with self.lock:
            self.watch = watch

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.store.set(self.key, str(n).encode(), time.monotonic() + 10.0)
                self._look()
            except Exception:  # the store is gone: the protocol sees it too
                return
            self.stop.wait(self.every)

    def _look(self) -> None:
        """One look at the watched members' counters (one store round trip each)."""
        with self.lock:
            watch = self.watch
        if watch is None:
            return
        silent: list[int] = []
        for k, rank in watch.keys.items():
            value = self.store.try_get(k, time.monotonic() + 10.0)
            now = time.monotonic()
            with self.lock:
                prev = self.seen.get(k)
                if prev is None or prev[0] != value:
                    self.seen[k] = (value, now if prev is not None else watch.since)
                elif now - max(prev[1], watch.since) >= self.dead_after:
                    silent.append(rank)
        if silent:
            with self.lock:
                if self.watch is not watch:
                    return
                self.watch = None
            watch.on_silent(silent)

    def still_since(self, key: str, value: bytes | None) -> float | None:
        """Since when the counter under ``key`` has shown ``value`` (None: not seen so)."""
        with self.lock:
            prev = self.seen.get(key)
        return prev[1] if prev is not None and prev[0] == value else None

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5.0)
        with contextlib.suppress(Exception):
            self.store.close()


class ElasticGroup:
    """One process's seat in an elastic TCP job (see the module docstring).

    Build it with :meth:`from_env` (under ``python -m launch --max-restarts N`` or
    torchrun) or :meth:`create`. ``connect``: opens a connection to the job's store;
    ``secret``: the job's secret; ``rank``/``size``: this process's place in the initial
    world (used only when epoch 0 forms); ``timeout``: deadline in seconds of collectives
    and of every protocol wait; ``heartbeat``, ``dead_after``: see the module docstring;
    ``min_size``: the fewest members an epoch may have (the quorum is the larger of this and
    a majority of the previous epoch); ``shm``: share memory between the members of a host
    (as ``bitcoll.init``); ``join_timeout``: how long a joiner waits to be taken in;
    ``prefix``: the store namespace.

    Attributes: :attr:`comm` (the current epoch's communicator), :attr:`epoch`
    (an :class:`Epoch`), :attr:`member_id`.
    """

    def __init__(self, connect: StoreFactory, secret: bytes, rank: int, size: int, *,
                 timeout: float = 30.0, heartbeat: float = DEFAULT_HEARTBEAT,
                 dead_after: float = DEFAULT_DEAD_AFTER, min_size: int = 1,
                 shm: bool | None = None, join_timeout: float = 600.0,
                 join_check: float = DEFAULT_JOIN_CHECK, prefix: str = "elastic/",
                 label: str = "rank") -> None:
        if size < 1 or not 0 <= rank < size:
            raise UsageError(f"rank {rank} is not in [0, {size})")
        for name, value in (("timeout", timeout), ("heartbeat", heartbeat),
                            ("dead_after", dead_after), ("join_timeout", join_timeout)):
            if not value > 0:
                raise UsageError(f"{name} must be > 0 seconds, got {value}")
        if dead_after < 2 * heartbeat:
            raise UsageError(f"dead_after ({dead_after} s) must be at least two heartbeats "
                             f"({heartbeat} s)")
        if min_size < 1:
            raise UsageError(f"min_size must be >= 1, got {min_size}")
        self._connect = connect
        self._secret = bytes(secret)
        self._initial = (rank, size)
        self.timeout = float(timeout)
        self.heartbeat = float(heartbeat)
        self.dead_after = float(dead_after)
        self.min_size = int(min_size)
        self.join_timeout = float(join_timeout)
        self.join_check = float(join_check)
        self._shm = shm
        self._base = prefix
        self._p = prefix  # the namespace of this process's generation (see _generation)
        self.generation = 0
        self.member_id = _new_id(f"{label}{rank}")
        self._store: RendezvousStore | None = None
        self._beat: _Heartbeat | None = None
        self._comm: Communicator | None = None
        self._epoch: Epoch | None = None
        self._admitted = 0  # joiners taken in so far (from the decisions)
        self._next_join_check = 0.0
        self._closed = False
        self.transitions: list[tuple[int, float]] = []  # (epoch, seconds the transition took)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, **kwargs: Any) -> ElasticGroup:
        """The group of this process from the launcher's environment: ``RANK``,
        ``WORLD_SIZE``, the job's secret (``BITCOLL_SECRET``) and the store:
        ``BITCOLL_ELASTIC_STORE`` (``python -m launch --max-restarts N``) or torchrun's agent
        store. Joins the job (:meth:`start`). ``kwargs`` go to the constructor.

        UsageError under an MPI launcher (MPI jobs fail fast: the MPICH wheel has no ULFM),
        and when no store outlives the ranks."""
        from .transport.mpi import launched_by_mpi

        if launched_by_mpi():
            raise UsageError("elastic jobs need the TCP backend: an MPI job cannot survive a "
                             "lost rank (no ULFM in the MPICH wheel); start the ranks with "
                             "`python -m launch --max-restarts N`")
        rank = int(os.environ.get("RANK", "0"))
        size = int(os.environ.get("WORLD_SIZE", "1"))
        timeout = float(kwargs.pop("timeout", 30.0))
        secret = auth.env_secret()
        where = os.environ.get(ENV_ELASTIC_STORE, "")
        connect: StoreFactory
        if where:
            host, _, port = where.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"{ENV_ELASTIC_STORE} must be host:port, got {where!r}")
            if secret is None:
                raise UsageError(f"an elastic job needs {auth.SECRET_ENV} (the launcher sets "
                                 "it)")
            key = secret

            def connect() -> RendezvousStore:
                from .transport.rendezvous.store import StoreClient

                return StoreClient.connect(host, int(port), time.monotonic() + timeout,
                                           secret=key)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True":
            from .transport.rendezvous.external_store import ExternalStore, torchrun_store

            if secret is None:
                raise UsageError(f"an elastic job under torchrun needs {auth.SECRET_ENV} set "
                                 "to the same value on every node")

            def connect() -> RendezvousStore:
                store, host = torchrun_store(timeout)
                return ExternalStore(store, host=host)
        else:
            raise UsageError("an elastic job needs a store that outlives every rank: start "
                             "it with `python -m launch --max-restarts N` (or torchrun); "
                             "rank 0's own store would die with rank 0")
        group = cls(connect, secret, rank, size, timeout=timeout, **kwargs)
        group.start()
        return group

    @classmethod
    def create(cls, connect: StoreFactory, secret: bytes, rank: int, size: int,
               **kwargs: Any) -> ElasticGroup:
        """Construct and :meth:`start` a group (the arguments of the constructor)."""
        group = cls(connect, secret, rank, size, **kwargs)
        group.start()
        return group

    def _k(self, suffix: str) -> str:
        return self._p + suffix

    @property
    def store(self) -> RendezvousStore:
        if self._store is None:
            raise UsageError("the elastic group is not started")
        return self._store

    def start(self) -> Epoch:
        """Join the job: form epoch 0 with the initial ranks, or, when the job already runs
        (``current`` is in the store), wait as a joiner until a transition takes this process
        in. Returns the epoch. Raises CommTimeoutError when epoch 0 does not form within
        ``timeout`` or no transition takes the joiner within ``join_timeout``."""
        _load_kernels()
        self._store = self._connect()
        self._generation()
        self._beat = _Heartbeat(self._connect(), self._k(f"hb/{self.member_id}"),
                                self.heartbeat, self.dead_after)
        self._beat.start()
        if self.store.try_get(self._k("current")) is not None:
            return self.rejoin()
        rank, size = self._initial
        st = self.store
        deadline = time.monotonic() + self.timeout
        if st.add(self._k(f"e/0/claim/{rank}"), 1, deadline) != 1:
            raise UsageError(f"two processes claim initial rank {rank} of the elastic job (a "
                             "second process started with this RANK, or this one replaces "
                             "a process of that rank while other processes are still "
                             "forming the first epoch: start it again once they are gone)",
                             argument="RANK")
        st.set(self._k(f"e/0/id/{rank}"), self.member_id.encode(), deadline)
        keys = [self._k(f"e/0/id/{r}") for r in range(size)]
        try:
            st.wait(keys, deadline)
        except CommTimeoutError:
            missing = st.missing(keys)
            raise CommTimeoutError(f"elastic job: {len(missing)} initial ranks never showed "
                                   f"up within {self.timeout:g} s") from None
        members = tuple(st.get(k, deadline).decode() for k in keys)
        epoch = Epoch(0, members, rank, holders=tuple(range(size)))
        if _FAULT_HOOK is not None:
            _FAULT_HOOK("initial", epoch)
        self._establish(epoch, attempt=0, ns=self._k("e/0/mesh/"))
        return epoch

    def _generation(self) -> None:
        """Pick the job's *generation* (its key namespace) before this process announces
        itself. Generation 0 lives under ``prefix``, generation ``g`` under ``prefix +
        "g<g>/"``; ``prefix + "generation"`` holds the newest. A process that finds the newest
        generation running (``current`` set, not ``finished``) but every member of its newest
        epoch gone (dead on this host, or its heartbeat still for ``dead_after``) knows that
        nobody is left to take it in: every process of the job was replaced at once, as
        torchrun's agent does when one worker fails (it stops and restarts the whole worker
        group). It then starts generation ``g + 1``, where the processes of the new start form
        epoch 0 from their ``RANK`` order, instead of waiting as joiners of a dead job. The
        same holds before the first epoch formed (no ``current``): when this process's initial
        rank was claimed before and every process that registered for epoch 0 is gone, the
        whole start was replaced while it formed."""
        st = self.store
        key = self._base + "generation"
        while True:
            raw = st.try_get(key)
            gen = int(raw) if raw is not None else 0
            self.generation = gen
            self._p = self._base if gen == 0 else f"{self._base}g{gen}/"
            if st.try_get(self._k("finished")) is not None:
                return
            if st.try_get(self._k("current")) is not None:
                if not self._all_gone(self._roster()):
                    return
            elif not self._initial_gone():
                return
            # One process of the new start moves the job on (a slow one that saw generation
            # ``gen`` gone must not set it back later); the others read it again.
            if st.add(self._k("successor"), 1) == 1:
                _log.debug("%s: every member of generation %d is gone; generation %d starts",
                           self.member_id, gen, gen + 1)
                st.set(key, str(gen + 1).encode())

    def _roster(self) -> list[str]:
        """The members of the newest epoch of this generation (empty before the first)."""
        raw = self.store.try_get(self._k("roster"))
        return [] if raw is None else list(json.loads(raw)["members"])

    def _initial_gone(self) -> bool:
        """True when this process's initial rank was claimed in this generation before (an
        earlier incarnation started forming epoch 0 and was replaced before it formed) and
        every process that registered for epoch 0 is gone: the whole start was replaced (a
        launcher restarting every rank), so nobody is left to form epoch 0 with."""
        rank, size = self._initial
        if self.store.try_get(self._k(f"e/0/claim/{rank}")) is None:
            return False
        ids = [self.store.try_get(self._k(f"e/0/id/{r}")) for r in range(size)]
        return self._all_gone([i.decode() for i in ids if i is not None])

    def _all_gone(self, members: list[str]) -> bool:
        """True when every one of ``members`` (member ids; at least one) is gone: dead on this
        host, or its heartbeat did not move for ``dead_after`` seconds (watched from now).
        False as soon as one heartbeat moves."""
        if not members:
            return False
        members = [m for m in members if not _gone_here(m)]
        keys = [self._k(f"hb/{m}") for m in members]
        first = {k: self.store.try_get(k) for k in keys}
        end = time.monotonic() + self.dead_after
        while keys:
            if any(self.store.try_get(k) != first[k] for k in keys):
                return False
            if time.monotonic() >= end:
                break
            time.sleep(min(self.heartbeat / 2, 0.05))
        return True

    def rejoin(self) -> Epoch:
        """Register as a joiner and wait (at most ``join_timeout``) until a transition takes
        this process in; return the new epoch (``action == "receive"``: get the state with
        :func:`share_state`). Also the way back for an evicted process."""
        st = self.store
        if self._comm is not None:
            with contextlib.suppress(Exception):
                self._comm.close()
            self._comm = None
        self.member_id = _new_id("joiner")
        if self._beat is not None:
            self._beat.close()
        self._beat = _Heartbeat(self._connect(), self._k(f"hb/{self.member_id}"),
                                self.heartbeat, self.dead_after)
        self._beat.start()
        deadline = time.monotonic() + self.join_timeout
        # the heartbeat must be visible before a decider can see the registration
        st.wait([self._k(f"hb/{self.member_id}")], deadline)
        n = st.add(self._k("joiners/count"), 1, deadline)
        st.set(self._k(f"joiners/{n}"), self.member_id.encode(), deadline)
        finished = self._k("finished")
        admit_key = self._k(f"admit/{self.member_id}")
        while True:
            admit = st.try_get(admit_key)
            if admit is not None:
                break
            time.sleep(_POLL)
            if st.try_get(finished) is not None:
                raise JobFinished("elastic: the job finished while this process waited to "
                                  "join")
            if time.monotonic() >= deadline:
                raise CommTimeoutError(f"elastic: no transition took this joiner in within "
                                       f"{self.join_timeout:g} s")
        e_s, a_s = admit.decode().split()
        e, a = int(e_s), int(a_s)
        t = self._k(f"e/{e}/t/{a}/")
        decision = json.loads(self.store.get(t + "decision", deadline))
        try:
            return self._follow(decision, e, a, t, has_state=False)
        except (EvictedError, NoQuorumError):
            raise
        except CommError:
            if self._epoch is None:
                raise
            return self.recover(-1, False, has_state=False)

    # ------------------------------------------------------------------ state
    @property
    def comm(self) -> Communicator:
        """The current epoch's communicator."""
        if self._comm is None:
            raise UsageError("the elastic group has no epoch (not started, or evicted)")
        return self._comm

    @property
    def epoch(self) -> Epoch:
        if self._epoch is None:
            raise UsageError("the elastic group has no epoch (not started)")
        return self._epoch

    def _poll(self, key: str, deadline: float, what: str,
              alive: Callable[[], bool] | None = None) -> bytes:
        """Wait for ``key``; stop early (CommTimeoutError) when ``alive()`` says the
        process expected to write it is gone."""
        while True:
            value = self.store.try_get(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise CommTimeoutError(what)
            if alive is not None and not alive():
                raise CommTimeoutError(what + " (its writer is gone)")
            time.sleep(_POLL)

    # ------------------------------------------------------------------ commit
    def commit(self, step: int) -> bool:
        """The commit point of step ``step`` (collective): one all-reduce of three int64
        that completes on a rank only once every rank entered it. Returns True when joiners
        are waiting (every rank gets the same answer): call :meth:`recover` at this step
        boundary to take them in. Raises the CommError of a failed collective (then call
        :meth:`recover` with the step's result still pending), ProtocolError when the ranks
        are at different steps."""
        flag = 0
        comm = self.comm
        if comm.rank == 0 and time.monotonic() >= self._next_join_check:
            self._next_join_check = time.monotonic() + self.join_check
            try:
                waiting = self.store.add(self._k("joiners/count"), 0)
            except CommError:
                waiting = self._admitted
            flag = 1 if waiting > self._admitted else 0
            if flag:
                _log.debug("%s: joiners wait (%d > %d)", self.member_id, waiting,
                           self._admitted)
        v = np.array([step, -step, flag], dtype=np.int64)
        comm.allreduce(v, op="max", out=v)
        if int(v[0]) != step or int(-v[1]) != step:
            raise ProtocolError(f"elastic commit: ranks are at different steps "
                                f"({int(-v[1])}..{int(v[0])}, this rank {step})")
        return bool(v[2])

    # ------------------------------------------------------------------ transitions
    def recover(self, committed: int, pending: bool = False, *, has_state: bool = True
                ) -> Epoch:
        """Leave the current epoch and return the next one (see the module docstring).

        ``committed``: the last step this rank applied (-1: none); ``pending``: it holds the
        next step's exchanged result, not applied; ``has_state``: False for a joiner that
        did not receive the job's state yet. Call it after a CommError of a collective of
        :attr:`comm`, or when :meth:`commit` returned True. The old communicator is aborted
        and closed. Raises NoQuorumError, EvictedError, or CommTimeoutError when no decision
        is reached within the deadlines."""
        t0 = time.monotonic()
        epoch, first = self._recover(committed, pending, has_state)
        self.transitions.append((epoch.number, time.monotonic() - t0))
        if first is not None and first != epoch.action:
            epoch = replace(epoch, action=first)
        return epoch

    def _recover(self, committed: int, pending: bool, has_state: bool
                 ) -> tuple[Epoch, str | None]:
        old = self.epoch
        if self._beat is not None:
            self._beat.set_watch(None)
        if self._comm is not None:
            with contextlib.suppress(Exception):
                if self._comm.transport.failure is None and self._comm.size > 1:
                    self._comm.transport.abort(f"rank {old.rank} leaves epoch {old.number}")
            with contextlib.suppress(Exception):
                self._comm.close()
            self._comm = None
        report = json.dumps({"committed": int(committed), "pending": bool(pending),
                             "state": bool(has_state)}).encode()
        e = old.number
        attempt = 0
        end = time.monotonic() + 4 * self.timeout + 10 * self.dead_after
        while True:
            if time.monotonic() > end:
                raise CommTimeoutError(f"elastic: no new epoch after epoch {e} within the "
                                       "deadline")
            t = self._k(f"e/{e}/t/{attempt}/")
            _log.debug("%s leaves epoch %d, attempt %d: %s", self.member_id, e, attempt, report)
            self.store.set(t + f"here/{self.member_id}", report)
            if self.store.add(t + "claim", 1) == 1:
                decision = self._decide(old, attempt, t)
            else:
                try:
                    decision = json.loads(self._poll(
                        t + "decision", end,
                        f"no decision in attempt {attempt}", self._decider_alive(t)))
                except CommTimeoutError:
                    attempt += 1
                    continue
            try:
                epoch = self._follow(decision, e, attempt, t, has_state=has_state,
                                     committed=committed, pending=pending)
            except (EvictedError, NoQuorumError):
                raise
            except CommError as exc:
                _log.debug("%s: epoch %d failed to form: %s", self.member_id, e + 1, exc)
                # a member of the new epoch failed while it formed: leave that one as well,
                # standing where the decision put this rank
                if self._epoch is None or self._epoch.number <= e:
                    raise
                first = self._epoch.action
                if first == "receive":
                    return self._recover(-1, False, False)[0], "receive"
                nested, _ = self._recover(self._epoch.step, False, True)
                return nested, first
            return epoch, None

    def _decider_alive(self, t: str) -> Callable[[], bool]:
        """A check for :meth:`_poll`: False once attempt ``t``'s decider is gone (dead on
        this host, or its heartbeat still for ``dead_after``; no decider named within
        ``timeout`` of the first look counts as gone too: the claimant names itself right
        after its claim, so only a claimant that died in between is not named)."""
        decider: list[str] = []
        last: list[bytes | None] = [None]
        since = [time.monotonic()]

        def alive() -> bool:
            now = time.monotonic()
            if not decider:
                d = self.store.try_get(t + "decider")
                if d is None:  # the claimant names itself right after its claim
                    return now - since[0] < self.timeout
                decider.append(d.decode())
                since[0] = now
            if _gone_here(decider[0]):
                return False
            hb = self.store.try_get(self._k(f"hb/{decider[0]}"))
            if hb != last[0]:
                last[0], since[0] = hb, now
            return now - since[0] < self.dead_after

        return alive

    def _decide(self, old: Epoch, attempt: int, t: str) -> dict[str, Any]:
        """The decider's part of leaving epoch ``old`` (steps 2-4)."""
        st = self.store
        st.set(t + "decider", self.member_id.encode())
        start = time.monotonic()
        members = list(old.members)
        here = {t + f"here/{m}": m for m in members}
        last_hb: dict[str, tuple[bytes | None, float]] = {}
        while True:
            now = time.monotonic()
            missing = [here[k] for k in st.missing(list(here))]
            if not missing or now - start > 2 * self.timeout:
                break
            waiting = False
            for m in missing:
                if _gone_here(m):
                    continue
                hb = st.try_get(self._k(f"hb/{m}"))
                prev = last_hb.get(m)
                if prev is None or prev[0] != hb:
                    if prev is not None:
                        last_hb[m] = (hb, now)
                    else:  # still since the heartbeat thread saw it so, or from now
                        seen = None if self._beat is None else \
                            self._beat.still_since(self._k(f"hb/{m}"), hb)
                        last_hb[m] = (hb, start if seen is None else min(seen, start))
                if now - last_hb[m][1] < self.dead_after:
                    waiting = True
            if not waiting:
                break
            time.sleep(_POLL)
        reports: dict[str, dict[str, Any]] = {}
        for k, m in here.items():
            raw = st.try_get(k)
            if raw is not None:
                reports[m] = json.loads(raw)
        survivors = [m for m in members if m in reports]
        need = max(self.min_size, len(members) // 2 + 1)
        decision: dict[str, Any]
        holders = [i for i, m in enumerate(survivors) if reports[m]["state"]]
        if len(survivors) < need or not holders:
            decision = {"quorum": False, "need": need, "have": len(survivors),
                        "of": len(members)}
        else:
            count = st.add(self._k("joiners/count"), 0)
            joiners: list[str] = []
            for n in range(self._admitted + 1, count + 1):
                j = st.try_get(self._k(f"joiners/{n}"))
                if j is None:
                    continue
                jid = j.decode()
                if not _gone_here(jid) and st.try_get(self._k(f"hb/{jid}")) is not None:
                    joiners.append(jid)
            step = max(int(reports[survivors[i]]["committed"]) for i in holders)
            decision = {"quorum": True, "epoch": old.number + 1,
                        "members": survivors + joiners,
                        "left": [i for i, m in enumerate(members) if m not in reports],
                        "holders": holders, "step": step, "admitted": count,
                        "joiners": joiners}
        _log.debug("%s decides %s: %s", self.member_id, t, decision)
        st.set(t + "decision", json.dumps(decision).encode())
        if decision["quorum"]:
            for j in decision["joiners"]:
                st.set(self._k(f"admit/{j}"), f"{old.number} {attempt}".encode())
        return decision

    def _follow(self, decision: dict[str, Any], e: int, attempt: int, t: str, *,
                has_state: bool, committed: int = -1, pending: bool = False) -> Epoch:
        """Steps 5-6: check the decision, build the new epoch's communicator."""
        if not decision.get("quorum"):
            self._epoch = None
            raise NoQuorumError(
                f"elastic: no quorum after epoch {e}: {decision['have']} of "
                f"{decision['of']} members left, at least {decision['need']} needed")
        members: list[str] = decision["members"]
        if self.member_id not in members:
            self._epoch = None
            raise EvictedError(f"elastic: this process ({self.member_id}) is not a member of "
                               f"epoch {decision['epoch']}: the others went on without it")
        self._admitted = max(self._admitted, int(decision["admitted"]))
        rank = members.index(self.member_id)
        holders = tuple(int(h) for h in decision["holders"])
        step = int(decision["step"])
        action = _action(step, committed, pending) if rank in holders else "receive"
        joined = tuple(r for r in range(len(members)) if r not in holders)
        epoch = Epoch(int(decision["epoch"]), tuple(members), rank, tuple(decision["left"]),
                      joined, holders, step, action)
        if _FAULT_HOOK is not None:
            _FAULT_HOOK("formed", epoch)
        self._establish(epoch, attempt, t + "mesh/")
        return epoch

    def _establish(self, epoch: Epoch, attempt: int, ns: str) -> None:
        """Build the epoch's communicator (connections bound to the epoch's key)."""
        from .bootstrap import share_hosts
        from .transport.shm import shm_enabled
        from .transport.tcp import TCPTransport

        self._epoch = epoch
        use_shm = shm_enabled(self._shm)
        key = epoch_secret(self._secret, epoch.number, attempt, epoch.members)
        rdv = _Rendezvous(self.store, ns, key, "the elastic job's store")
        deadline = time.monotonic() + self.timeout
        send = send_buffer_bytes()
        if epoch.size == 1:
            transport = TCPTransport(0, 1, {}, None, 0)
        else:
            socks, job_id = build_mesh(epoch.rank, epoch.size, rdv, deadline, self.timeout,
                                       None, False, send)
            transport = TCPTransport(epoch.rank, epoch.size, socks, rdv, job_id,
                                     integrity=False, send_buffer=send)
        comm = Communicator(transport, timeout=self.timeout)
        try:
            comm.topology  # noqa: B018  (the epoch's first collective: every member is in)
        except BaseException:
            comm.close()
            raise
        if comm.num_hosts < comm.size:
            comm = share_hosts(comm, use_shm, self.timeout)
        self._comm = comm
        self._watch(epoch, comm)
        if epoch.rank == 0:
            self.store.set(self._k("roster"), json.dumps(
                {"epoch": epoch.number, "members": list(epoch.members)}).encode())
            self.store.set(self._k("current"), str(epoch.number).encode())

    def _watch(self, epoch: Epoch, comm: Communicator) -> None:
        """Let the heartbeat thread watch the epoch's other members: when one is silent for
        ``dead_after`` seconds (stopped, hung, cut off), the communicator is aborted, so
        every member's collective fails now and the transition starts (the decider then
        leaves out the silent member unless it reports)."""
        if self._beat is None or epoch.size == 1:
            return
        number = epoch.number

        def on_silent(ranks: list[int]) -> None:
            _log.debug("%s: ranks %s of epoch %d are silent", self.member_id, ranks, number)
            with contextlib.suppress(Exception):
                if comm.transport.failure is None:
                    comm.transport.abort(
                        f"elastic: rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))} of epoch {number} sent no heartbeat "
                        f"for {self.dead_after:g} s")

        keys = {self._k(f"hb/{m}"): r for r, m in enumerate(epoch.members)
                if m != self.member_id}
        self._beat.set_watch(_Watch(keys, on_silent, time.monotonic()))

    # ------------------------------------------------------------------ end
    def finish(self) -> None:
        """Mark the job finished (call it on every member after the last committed step;
        rank 0 writes the mark): processes still waiting to join give up with
        :class:`JobFinished` instead of waiting for ``join_timeout``."""
        if self._epoch is not None and self._epoch.rank == 0:
            self.store.set(self._k("finished"), b"1")

    def close(self) -> None:
        """Close the communicator and the store connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._beat is not None:
            self._beat.set_watch(None)
        if self._comm is not None:
            with contextlib.suppress(Exception):
                self._comm.close()
            self._comm = None
        if self._beat is not None:
            self._beat.close()
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()

    def __enter__(self) -> ElasticGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _action(step: int, committed: int, pending: bool) -> str:
    if committed == step:
        return "keep"
    if committed == step - 1 and pending:
        return "apply"
    if committed == step - 1:
        raise ProtocolError(f"elastic: step {step} was committed elsewhere but this rank "
                            f"holds neither it nor its result (at step {committed})")
    raise ProtocolError(f"elastic: this rank is at step {committed}, the survivors at {step}")


#: An array, or several (each 1-D and C-contiguous), taken as their concatenation.
Arrays = npt.NDArray[Any] | Sequence[npt.NDArray[Any]]


def _flat_views(arrays: Arrays | None, what: str, dtype: Any = None
                ) -> list[npt.NDArray[Any]]:
    """``arrays`` as a list of writable C-contiguous 1-D arrays (UsageError otherwise)."""
    if arrays is None:
        return []
    items = [arrays] if isinstance(arrays, np.ndarray) else list(arrays)
    for a in items:
        if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous \
                or not a.flags.writeable:
            raise UsageError(f"{what} must be writable C-contiguous 1-D arrays", argument=what)
        if dtype is not None and a.dtype != dtype:
            raise UsageError(f"{what} must be {np.dtype(dtype).name} arrays, got {a.dtype}",
                             argument=what)
    return items


def _pieces(arrays: Sequence[npt.NDArray[Any]], start: int, stop: int
            ) -> list[npt.NDArray[Any]]:
    """Views of elements ``[start, stop)`` of the concatenation of ``arrays`` (same dtype),
    one per array they touch, in order; empty views are left out."""
    out = []
    pos = 0
    for a in arrays:
        lo, hi = max(start, pos), min(stop, pos + a.size)
        if lo < hi:
            out.append(a[lo - pos:hi - pos])
        pos += a.size
    return out


def share_state(comm: Communicator, state: Arrays, holders: Sequence[int], *,
                average: Arrays | None = None, out: Arrays | None = None) -> None:
    """The job's state to every rank (collective; the arrays have the same sizes and dtypes
    on every rank).

    ``holders``: the ranks that hold the job's state (``Epoch.holders``). ``state`` (an
    array or a list of arrays, 1-D, C-contiguous, any dtype, taken byte by byte as their
    concatenation) ends bitwise equal to the holders' copy on every rank: the holders' copies
    must be identical; the others' are overwritten. ``average`` (float32 arrays, or None)
    ends, on every rank, as the holders' mean (summed in holder order, divided by the number
    of holders), bitwise the same everywhere; the non-holders' values are not read.
    ``out`` (float32 arrays of the same sizes as ``average``'s, or None: ``average`` itself)
    receives the mean instead, and ``average`` is then only read: a holder's input survives
    a failed call, and the mean lands straight where the caller keeps it (no copies).

    The holders split both into ``len(holders)`` slices (``numpy.array_split`` order, see
    :mod:`bitcoll.partition`); holder ``i`` *owns* slice ``i``. In one call, without a
    barrier in between:

    1. owner ``i`` sends its slice of ``state`` straight into every non-holder's arrays,
       and every holder sends its slice ``j`` of ``average`` to owner ``j``;
    2. each owner sums the contributions to its slice (in holder order), divides, and sends
       the mean slice into every other rank's ``average``.

    So a rank that holds nothing receives ``state`` once and ``average`` once, spread over the
    holders' links (no staging copies on either side); a holder sends ``1/h`` of ``state`` to
    each joiner and ``(h - 1)/h + (size - 1)/h`` of ``average``. UsageError for a bad
    ``holders`` list or arrays."""
    hs = sorted(set(int(h) for h in holders))
    if not hs or hs[0] < 0 or hs[-1] >= comm.size:
        raise UsageError(f"holders must be ranks of the communicator, got {list(holders)}")
    raw = [a.view(np.uint8) for a in _flat_views(state, "state")]
    avg = _flat_views(average, "average", np.float32)
    dst = _flat_views(out, "out", np.float32) if out is not None else avg
    if [a.size for a in dst] != [a.size for a in avg]:
        raise UsageError(f"out must have the sizes of average ({[a.size for a in avg]}), "
                         f"got {[a.size for a in dst]}", argument="out")
    h = len(hs)
    others = [r for r in range(comm.size) if r not in hs]
    if not others and not avg:
        return
    nbytes = sum(a.size for a in raw)
    nav = sum(a.size for a in avg)
    sb = block_bounds(nbytes, h)
    ab = block_bounds(nav, h)
    me = hs.index(comm.rank) if comm.rank in hs else -1

    def body(ctx: Any) -> None:
        reqs = []
        if me < 0:  # a rank without state: everything comes from the owners
            for i, o in enumerate(hs):
                reqs += [ctx.irecv(o, v) for v in _pieces(raw, sb[i], sb[i + 1])]
                reqs += [ctx.irecv(o, v) for v in _pieces(dst, ab[i], ab[i + 1])]
            ctx.wait(*reqs)
            return
        lo, hi = ab[me], ab[me + 1]
        parts: dict[int, npt.NDArray[np.float32]] = {}
        early = []
        cuts = np.cumsum([0] + [v.size for v in _pieces(avg, lo, hi)])
        for i, o in enumerate(hs):  # 1. the contributions to my slice (framed as sent)
            if o != comm.rank:
                parts[i] = np.empty(hi - lo, np.float32)
                early += [ctx.irecv(o, parts[i][a:b]) for a, b in itertools.pairwise(cuts)]
        for i, o in enumerate(hs):  # 2. (posted now) the other owners' means
            if o != comm.rank:
                reqs += [ctx.irecv(o, v) for v in _pieces(dst, ab[i], ab[i + 1])]
        for r in others:  # 1. my slice of the state
            reqs += [ctx.isend(r, v) for v in _pieces(raw, sb[me], sb[me + 1])]
        for i, o in enumerate(hs):  # 1. my contributions to the other slices
            if o != comm.rank:
                reqs += [ctx.isend(o, v) for v in _pieces(avg, ab[i], ab[i + 1])]
        if avg:
            ctx.wait(*early)
            mine = np.concatenate(_pieces(avg, lo, hi)) if hi > lo else \
                np.zeros(0, np.float32)
            parts[me] = mine
            total = parts[0]  # every part is this call's own array (mine: a concatenation)
            for i in range(1, h):
                total += parts[i]
            total /= np.float32(h)
            pos = 0
            for v in _pieces(dst, lo, hi):
                v[...] = total[pos:pos + v.size]
                pos += v.size
            for r in range(comm.size):  # 2. my mean slice to every other rank
                if r != comm.rank:
                    reqs += [ctx.isend(r, v) for v in _pieces(dst, lo, hi)]
        ctx.wait(*reqs)

    comm.run("share_state", (nbytes, nav, tuple(hs)), body, False, None)
