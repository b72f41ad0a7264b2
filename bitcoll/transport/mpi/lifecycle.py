"""The MPI transport's process lifecycle: what happens when a rank fails or exits.

Failures at exit
----------------
An MPI job only ends when every rank ends, and ``MPI_Finalize`` (run by mpi4py after the
interpreter's ``atexit`` handlers) waits for every rank of the job. Two rules keep a failed
job from hanging:

1. **An uncaught exception ends the whole job.** The first transport created installs (once,
   chaining to the hook it found) a :data:`sys.excepthook` that prints the traceback as usual
   (through the previous hook), sends an abort notice with the exception's text to the peers
   of every open transport (they raise ``PeerLostError("rank r aborted: uncaught
   ValueError: ...")`` if they look before they are killed), flushes ``sys.stdout`` and
   ``sys.stderr``, and calls ``MPI.COMM_WORLD.Abort(1)`` (130 for ``KeyboardInterrupt``):
   mpiexec then kills every rank and exits non-zero within a second or so. When the uncaught
   exception is a :class:`~bitcoll.errors.PeerLostError` (this rank only saw another rank
   fail), the abort waits :data:`SECONDARY_ABORT_GRACE_SECONDS` first, so that the rank where
   the failure started prints its own traceback before mpiexec kills it (otherwise it waits
   :data:`OUTPUT_FORWARD_SECONDS`, for mpiexec to forward what was flushed). Like any
   ``MPI_Abort`` this skips the failed rank's ``atexit`` handlers. The hook does nothing more
   than the previous hook when the world has one process, in an interactive session (``python
   -i``, a REPL), or when MPI is not initialized or already finalized. ``SystemExit``
   (``sys.exit(n)``) is not an uncaught exception and exits normally. Exceptions in other
   threads (:data:`threading.excepthook`) are left alone: they end that thread, not the
   process, and the main thread may still finish normally.
2. **A timeout bounds MPI_Finalize.** A transport *records a finalize risk* when one of its
   operations raised CommTimeoutError (a frame, a native collective, :meth:`create`, the
   barrier of :meth:`split`: some peer did not answer before a deadline, so it may be stopped
   or hung), or when MPI itself reported an error on a send, receive or collective (a
   truncation, i.e. a protocol mismatch between live ranks, does not count). Aborts, protocol
   errors and usage errors do not count: the peer that sent the abort notice or the
   mismatched frame is alive. At interpreter exit (an ``atexit`` handler, which first closes
   the open transports), if this process recorded a finalize risk (open or closed transports
   alike) and MPI is initialized and not finalized, the handler prints one line to stderr and
   arms a real-time timer of :func:`finalize_grace` seconds (default
   :data:`FINALIZE_GRACE_SECONDS`, environment variable ``BITCOLL_MPI_FINALIZE_GRACE``;
   ``inf`` disables the bound) with ``SIGALRM`` at its default action. ``MPI_Finalize`` then
   runs as usual: when every rank reaches it (a failure the program handled, every rank
   alive: e.g. the deliberate timeouts of the test suite), it returns at once and the
   process exits with its normal status. When it has not returned at the end of the grace
   period (a peer is stopped, hung or still busy), the kernel kills the process with
   ``SIGALRM``, and mpiexec kills every other rank of the job (a stopped one included) and
   exits non-zero. Without a recorded risk, ``MPI_Finalize`` is never bounded: ranks that
   finish at different times wait for each other as in any MPI program. The handler is
   registered when this module is imported (by ``bitcoll.init``), so the grace period also
   covers the ``atexit`` handlers registered before that import, which run after it.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from ...errors import PeerLostError

if TYPE_CHECKING:
    from .transport import MPITransport

__all__ = ["FINALIZE_GRACE_SECONDS", "FINALIZE_GRACE_ENV", "finalize_grace"]

# MPI requests (with the buffers mpi4py keeps alive through them) and communicators that could
# not be completed or freed. Keeping them referenced forever is deliberate: MPI may still write
# into a receive buffer whose request could not be cancelled, so the memory must never be freed.
_LEAKED: list[object] = []

# Open transports, strongly referenced: an unclosed transport keeps a receive posted into its
# control buffer, so it must not be garbage-collected before close() (run at exit at the latest).
_LIVE: set[MPITransport] = set()


OUTPUT_FORWARD_SECONDS: Final = 0.2
"""How long the uncaught-exception hook waits between flushing its output and MPI_Abort."""

SECONDARY_ABORT_GRACE_SECONDS: Final = 1.0
"""How long an uncaught PeerLostError waits before MPI_Abort (module docstring, rule 1)."""

FINALIZE_GRACE_SECONDS: Final = 10.0
"""Default time ``MPI_Finalize`` gets after a recorded finalize risk (module docstring)."""

FINALIZE_GRACE_ENV: Final = "BITCOLL_MPI_FINALIZE_GRACE"
"""Environment variable overriding :data:`FINALIZE_GRACE_SECONDS` (``inf``: no bound)."""

# Why MPI_Finalize may hang in this process (module docstring, "Failures at exit"): one line per
# recorded risk, the first one is printed at exit.
_FINALIZE_RISKS: list[str] = []

_HOOK_LOCK = threading.Lock()
_hook_installed = False
_previous_excepthook: Callable[[type[BaseException], BaseException, TracebackType | None],
                               Any] | None = None


def finalize_grace() -> float:
    """Seconds ``MPI_Finalize`` gets at exit after a recorded finalize risk.

    :data:`FINALIZE_GRACE_SECONDS` unless the environment variable ``BITCOLL_MPI_FINALIZE_GRACE``
    holds a positive number of seconds (``inf`` disables the bound; anything else is ignored).
    """
    text = os.environ.get(FINALIZE_GRACE_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            return FINALIZE_GRACE_SECONDS
        if value > 0:  # also False for NaN
            return value
    return FINALIZE_GRACE_SECONDS


def _note_finalize_risk(reason: str) -> None:
    _FINALIZE_RISKS.append(reason)


def _mpi_if_running() -> Any | None:
    """``mpi4py.MPI`` when this process imported it and MPI is initialized and not finalized;
    never imports it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return None
    except Exception:  # pragma: no cover - defensive
        return None
    return mpi


def _bound_finalize() -> None:
    """Rule 2 of the module docstring: arm the SIGALRM timer when a risk was recorded."""
    if not _FINALIZE_RISKS:
        return
    mpi = _mpi_if_running()
    if mpi is None:
        return
    grace = finalize_grace()
    if not math.isfinite(grace):
        return
    rank = mpi.COMM_WORLD.Get_rank()
    with contextlib.suppress(Exception):
        print(f"bitcoll: rank {rank}: {_FINALIZE_RISKS[0]}; MPI_Finalize gets {grace:g} s, "
              "then this process is killed (SIGALRM) in case a peer is stopped or hung "
              f"({FINALIZE_GRACE_ENV})", file=sys.stderr, flush=True)
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, grace)
    except (ValueError, OSError):  # pragma: no cover - not the main thread / no timer
        pass


def _at_exit() -> None:
    for transport in list(_LIVE):
        transport.close()
    _bound_finalize()


# Registered at import, i.e. before mpi4py is imported by create(); atexit runs handlers in
# reverse order, and mpi4py finalizes MPI after all of them (Py_AtExit), so the timer armed here
# covers MPI_Finalize.
atexit.register(_at_exit)


def _install_excepthook() -> None:
    """Rule 1 of the module docstring: install :func:`_excepthook` once."""
    global _hook_installed, _previous_excepthook
    with _HOOK_LOCK:
        if _hook_installed:
            return
        _hook_installed = True
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _interactive() -> bool:
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def _abort_world(code: int) -> None:
    """``MPI.COMM_WORLD.Abort(code)`` (a seam for the tests)."""
    mpi = sys.modules["mpi4py.MPI"]
    mpi.COMM_WORLD.Abort(code)


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    """Print the traceback (previous hook), tell every peer, end the MPI job."""
    previous = _previous_excepthook if _previous_excepthook is not None else sys.__excepthook__
    try:
        previous(exc_type, exc, tb)
    finally:
        _end_job_after_uncaught(exc_type, exc)


def _end_job_after_uncaught(exc_type: type[BaseException], exc: BaseException) -> None:
    mpi = _mpi_if_running()
    if mpi is None or _interactive():
        return
    code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
    try:
        world = mpi.COMM_WORLD
        if world.Get_size() == 1:
            return
        reason = f"uncaught {exc_type.__name__}: {exc}"
        for transport in list(_LIVE):
            transport._abort_nowait(reason)
        print(f"bitcoll: rank {world.Get_rank()}: uncaught {exc_type.__name__}, aborting the "
              f"MPI job (MPI_Abort({code}))", file=sys.stderr)
    except Exception:  # pragma: no cover - nothing may stop the abort
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # mpiexec forwards a rank's output through its proxy, and MPI_Abort can overtake what was
    # just flushed: give it a moment. Another rank failed first (PeerLostError): let that rank
    # print its traceback and abort the job itself.
    time.sleep(SECONDARY_ABORT_GRACE_SECONDS if issubclass(exc_type, PeerLostError)
               else OUTPUT_FORWARD_SECONDS)
    _abort_world(code)

