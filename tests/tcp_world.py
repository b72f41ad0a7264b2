"""Run ``size`` local ranks as separate processes, each with its own TCPTransport.

    results = run_world(3, worker, arg1, arg2)

starts fresh processes (the ``forkserver`` start method by default: a clean single-threaded
server process, started once with numpy, bitcoll and the worker's module imported, forks each
rank, so a rank starts in milliseconds; ``start_method="spawn"`` works too) on 127.0.0.1 and a
free port; each rank
creates ``TCPTransport.create(rank, size, "127.0.0.1", port, timeout=create_timeout)``, calls
``worker(transport, *args)`` (a module-level, importable function), closes the transport and
sends back the (picklable) return value. ``run_world`` returns one :class:`RankResult` per
started rank, in rank order: the value, or the type name and message of the exception raised by
``create``, the worker or ``close``, or (for a process that died without reporting, e.g.
killed) its exit code. Ranks still running after ``timeout`` seconds are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bitcoll.transport.tcp import TCPTransport
from launch.__main__ import free_ports

__all__ = ["RankResult", "forkserver", "free_port", "make_event", "run_world"]

PRELOAD = ("rank_preload",)
"""What the fork server imports once, before it forks any rank (numpy, bitcoll, lioncub, these
helpers and the sweeps' numba kernels: see ``rank_preload``)."""


def forkserver(*modules: str) -> Any:
    """The ``forkserver`` multiprocessing context, its server running and preloading
    :data:`PRELOAD` and ``modules``. The preload list only takes effect when the server starts
    (the session's first caller); a rank imports anything else it needs itself. A forked rank
    inherits the server's environment and working directory, not the caller's: callers that
    depend on either pass them along (see ``multiproc``)."""
    from multiprocessing import forkserver as server

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *modules])
    # Python 3.11's fork server does not take over the caller's sys.path: it finds the test
    # helpers it preloads through PYTHONPATH, set while it starts (its ranks get sys.path from
    # the caller, as spawned ones do).
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), *([before] if before else [])])
    try:
        server.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    exitcode: int | None = None
    reported: bool = False

    @property
    def ok(self) -> bool:
        return self.reported and self.error_type is None

    def unwrap(self) -> Any:
        """The worker's value; AssertionError describing the failure otherwise."""
        assert self.ok, (f"rank {self.rank}: {self.error_type}: {self.error} "
                         f"(exit code {self.exitcode})")
        return self.value


#: Ports :func:`free_port` has handed out in this process.
_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the launcher's
    :func:`launch.__main__.free_ports`, as for the benchmarks) and not handed out before in
    this process: a process counts the worlds it builds on each address (the store's
    generation), so a test that reused an earlier test's port would find its rank in this
    process expecting a newer store than a rank that starts counting afresh."""
    port = free_ports(host, exclude=sorted(_HANDED_OUT))[0]
    _HANDED_OUT.add(port)
    return port


def make_event(start_method: str = "forkserver") -> Any:
    """A multiprocessing Event that can be passed to the ranks of :func:`run_world`."""
    return mp.get_context(start_method).Event()


def _rank_main(q: Any, rank: int, size: int, port: int, create_timeout: float,
               worker: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        transport = TCPTransport.create(rank, size, "127.0.0.1", port, timeout=create_timeout)
        try:
            value = worker(transport, *args)
        finally:
            transport.close()
        q.put((rank, value, None, None))
    except BaseException as exc:  # report everything, including assertion failures
        q.put((rank, None, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


def run_world(size: int, worker: Callable[..., Any], *args: Any, timeout: float = 60.0,
              create_timeout: float = 20.0, ranks: Sequence[int] | None = None,
              port: int | None = None, start_method: str = "forkserver") -> list[RankResult]:
    """Start ranks ``ranks`` (default all of ``range(size)``) of a ``size``-rank world."""
    ctx: Any = (forkserver(worker.__module__) if start_method == "forkserver"
                else mp.get_context(start_method))
    q = ctx.Queue()
    port = free_port() if port is None else port
    started = list(range(size)) if ranks is None else list(ranks)
    procs = {r: ctx.Process(target=_rank_main, daemon=True, name=f"tcp-rank-{r}",
                            args=(q, r, size, port, create_timeout, worker, args))
             for r in started}
    for p in procs.values():
        p.start()
    results = {r: RankResult(r) for r in started}
    deadline = time.monotonic() + timeout
    pending = set(started)
    while pending and time.monotonic() < deadline:
        try:
            rank, value, etype, emsg = q.get(timeout=0.1)
        except queue.Empty:
            # A rank that died without reporting (killed) will never report.
            dead = {r for r in pending if not procs[r].is_alive() and procs[r].exitcode != 0}
            # A rank's queue feeder thread is joined before the process exits, so what a dead
            # rank put is in the pipe already: an empty queue now stays without its report.
            if dead and q.empty():
                pending -= dead
            continue
        results[rank] = RankResult(rank, value, etype, emsg, reported=True)
        pending.discard(rank)
    for r, p in procs.items():
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)
            if not results[r].reported:
                results[r].error_type = "Hung"
                results[r].error = f"still running after {timeout} s; killed"
        results[r].exitcode = p.exitcode
    q.close()
    return [results[r] for r in started]


def set_up_two(create: Callable[[int, int], TCPTransport], join: float = 60.0
               ) -> dict[int, object]:
    """Rank 0 and rank 1 of a two-rank world set up in two threads of this process, each by
    ``create(rank, port)`` on a shared free port, then closed: each rank's outcome,
    "connected" or the exception its set-up raised. AssertionError when a rank is still
    setting up after ``join`` seconds (it waited for its deadline)."""
    port = free_port()
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            create(r, port).close()
            out[r] = "connected"
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    assert not any(t.is_alive() for t in threads), "a rank waited for its deadline"
    return out


def wait_dead(pid: int, deadline: float) -> None:
    """Return once process ``pid`` has exited (a zombie counts: its files and sockets are
    closed); AssertionError at ``deadline`` (``time.monotonic()`` seconds)."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):  # gone between open and read
            return
        except OSError:  # no /proc: ask the kernel whether the pid still exists
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.01)  # polls a condition; sets up no interleaving
    raise AssertionError(f"process {pid} did not die")
