"""Supervision of a job's child processes, shared by the launcher (:mod:`launch.__main__`, one
child per rank) and the emulated testbed (``bench/netbed.py``, one child per host).

A :class:`Supervisor` watches children that the caller has started and stops them together:

* **Exits are observed in the order they happen.** Each child has a waiter thread blocked in
  ``waitpid``; it wakes when the child dies and queues the exit, so the first failure is the
  first child that *died* with a non-zero status (within the scheduling delay of a woken
  thread, microseconds on an idle launcher), not the lowest-numbered one among those that
  died since the last look. This matters for a job whose other ranks fail a few milliseconds
  after the first one, as soon as they notice it (bitcoll's ``PeerLostError``).
* **First failure**: the children still running get SIGTERM, SIGKILL after the grace period.
  When the first failure is a child killed by a signal (it could say nothing, e.g. SIGKILL),
  the others first get up to ``report_window`` seconds to exit on their own, so that their
  own errors (bitcoll's ``PeerLostError`` naming the lost rank) are printed; the ones still
  running then get SIGTERM.
* **Signals** (:meth:`Supervisor.on_signal`, installed by :meth:`Supervisor.handle_signals`):
  the first SIGINT/SIGTERM is forwarded to every running child, a second one sends SIGKILL;
  children still running a grace period after the first get SIGKILL too.
* :meth:`Supervisor.wait` returns an :class:`Outcome` once every child has exited: the first
  failure (index, return code), the signal received, and whether other children had to be
  stopped. Reporting is the caller's.

Children started with ``start_new_session=True`` are signalled as a process group
(``group=True``: the rank and whatever it started), others one process at a time.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

__all__ = ["Outcome", "Supervisor", "describe_exit", "exit_status"]


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status (``128 + n`` for signal ``n``)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``"exited with status 3"`` or ``"was killed by SIGKILL"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


@dataclass(frozen=True)
class Outcome:
    """How a supervised job ended.

    ``failed``: index of the first child (in time) that exited with a non-zero status or was
    killed, and its return code; None when every child exited 0. ``stopped``: other children
    were still running when that failure was seen (and were sent SIGTERM). ``signal``: the
    first SIGINT/SIGTERM the supervisor received, if any.
    """

    failed: tuple[int, int] | None
    stopped: bool
    signal: int | None

    def status(self) -> int:
        """The job's exit status: the first failure's, else ``128 + signal``, else 0."""
        if self.failed is not None:
            return exit_status(self.failed[1])
        if self.signal is not None:
            return 128 + self.signal
        return 0


_EXIT, _SIGNAL = 0, 1


class Supervisor:
    """Watches child processes (see the module docstring).

    Add every child with :meth:`add` right after starting it, then call :meth:`wait` once.
    """

    def __init__(self, grace_period: float, *, group: bool = True,
                 report_window: float = 0.0) -> None:
        self.grace_period = grace_period
        self.group = group
        self.report_window = report_window
        self.procs: list[subprocess.Popen[bytes]] = []
        #: Exits and signals, in the order they happened. SimpleQueue.put may be called from
        #: a signal handler (it is reentrant), which a Queue's may not.
        self._events: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.signal: int | None = None
        self._signals_seen = 0

    def add(self, proc: subprocess.Popen[bytes]) -> int:
        """Watch ``proc``; return its index."""
        index = len(self.procs)
        self.procs.append(proc)
        threading.Thread(target=self._wait_for, args=(index, proc), daemon=True,
                         name=f"supervise-{proc.pid}").start()
        return index

    def _wait_for(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self._events.put((_EXIT, index))

    def running(self) -> list[subprocess.Popen[bytes]]:
        """The children not reaped yet."""
        return [p for p in self.procs if p.returncode is None]

    def send(self, sig: int) -> None:
        """Send ``sig`` to every child still running (to its process group with ``group``)."""
        for proc in self.running():
            try:
                if self.group:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: forward the first SIGINT/SIGTERM, SIGKILL on the second."""
        self._signals_seen += 1
        if self.signal is None:
            self.signal = signum
        self.send(signal.SIGKILL if self._signals_seen > 1 else signum)
        self._events.put((_SIGNAL, signum))

    @contextlib.contextmanager
    def handle_signals(self) -> Iterator[None]:
        """Route SIGINT and SIGTERM to :meth:`on_signal` (only in the main thread, where
        Python allows handlers; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self.on_signal) for s in handled}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def wait(self) -> Outcome:
        """Wait until every child has exited, stopping them all on the first failure."""
        failed: tuple[int, int] | None = None
        stopped = False
        kill_at: float | None = None
        term_at: float | None = None  # the end of the report window
        exited = 0
        while exited < len(self.procs):
            due = [t for t in (kill_at, term_at) if t is not None]
            timeout = None if not due else max(0.0, min(due) - time.monotonic())
            try:
                kind, value = self._events.get(timeout=timeout)
            except queue.Empty:
                if term_at is not None and time.monotonic() >= term_at:
                    term_at = None
                    if self.running():
                        stopped = True
                        self.send(signal.SIGTERM)
                        deadline = time.monotonic() + self.grace_period
                        kill_at = deadline if kill_at is None else min(kill_at, deadline)
                    continue
                self.send(signal.SIGKILL)
                kill_at = None
                continue
            if kind == _SIGNAL:
                if kill_at is None:
                    kill_at = time.monotonic() + self.grace_period
                continue
            exited += 1
            rc = self.procs[value].returncode
            assert rc is not None
            if rc != 0 and failed is None:
                failed = (value, rc)
                if rc < 0 and self.report_window > 0 and self.running():
                    term_at = time.monotonic() + self.report_window
                elif self.running():
                    stopped = True
                    self.send(signal.SIGTERM)
                    deadline = time.monotonic() + self.grace_period
                    kill_at = deadline if kill_at is None else min(kill_at, deadline)
        return Outcome(failed, stopped, self.signal)
