"""bitcoll-run: start the ranks of a TCP job on this node (torchrun-style).

Usage::

    python -m launch [options] script.py [script args...]
    python -m launch [options] -m package.module [module args...]
    bitcoll-run [options] script.py [script args...]

Runs ``--nproc-per-node`` copies of the script (or module, as ``python -m`` would) with the
interpreter running the launcher (``sys.executable``), each with its rank in the environment,
and waits for them. Everything after the script name (or after ``-m module``) is passed to the
script untouched.

Options
-------
``-n N``, ``--nproc-per-node N``
    ranks started on this node (required, >= 1).
``--nnodes N``
    number of nodes of the job (default 1); start the launcher once per node.
``--node-rank K``
    this node's index in ``[0, nnodes)`` (default 0); node ``K`` runs global ranks
    ``K * nproc_per_node ... (K + 1) * nproc_per_node - 1``. Rank 0 (on node 0) serves the
    rendezvous store.
``--master-addr HOST``
    address of rank 0's node, reachable from every node (default ``127.0.0.1``).
``--master-port PORT``
    TCP port of the rendezvous store on ``--master-addr``. Default: a port the launcher finds
    free when ``--nnodes`` is 1; required otherwise.
``--grace-period SECONDS``
    how long ranks get to exit after SIGTERM before SIGKILL (default 5).

Environment contract
--------------------
Each rank's process inherits the launcher's environment plus:

=================== ===============================================================
``RANK``            global rank, ``node_rank * nproc_per_node + local_rank``
``WORLD_SIZE``      ``nnodes * nproc_per_node``
``LOCAL_RANK``      index of the rank on this node, ``[0, nproc_per_node)``
``LOCAL_WORLD_SIZE`` ``nproc_per_node``
``MASTER_ADDR``     ``--master-addr``
``MASTER_PORT``     ``--master-port`` (or the port chosen by the launcher)
``PYTHONUNBUFFERED`` ``1`` unless already set, so output appears as it is printed
=================== ===============================================================

``bitcoll.init()`` reads these and connects the ranks over TCP. The ranks' standard input is
``/dev/null``; each rank runs in its own process group.

Output
------
Every line a rank writes to stdout (stderr) is written to the launcher's stdout (stderr)
prefixed with ``[rank R] ``, one whole line at a time. The launcher's own messages start with
``launch: `` and go to stderr.

Failure handling and exit status
--------------------------------
* All ranks exit 0: the launcher exits 0.
* A rank exits with a non-zero status or is killed by a signal: the launcher sends SIGTERM to
  the process groups of the ranks still running, SIGKILL after the grace period, reports the
  first failure, e.g. ``launch: rank 2 (pid 1234) was killed by SIGKILL; terminated the other
  ranks``, and exits with that rank's status (``128 + signal number`` for a signal).
* SIGINT or SIGTERM sent to the launcher is forwarded to every rank (a second one sends
  SIGKILL); the launcher then waits for the ranks as above and exits with the first failing
  rank's status, or ``128 + signal number`` if every rank exited 0.
* Bad options: exit status 2 with a usage message; a rank that cannot be started: 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

__all__ = ["main", "parse_args", "LaunchConfig", "child_env", "exit_status", "describe_exit"]

PROG = "bitcoll-run"
DEFAULT_GRACE = 5.0
POLL_SECONDS = 0.05
#: Options that take a value (the splitter must not mistake the value for the script).
_VALUE_OPTIONS = frozenset({"-n", "--nproc-per-node", "--nnodes", "--node-rank",
                            "--master-addr", "--master-port", "--grace-period"})


@dataclass
class LaunchConfig:
    """The parsed command line."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    grace_period: float = DEFAULT_GRACE
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        """The command line of one rank."""
        if self.module is not None:
            return [sys.executable, "-m", self.module, *self.args]
        assert self.script is not None
        return [sys.executable, self.script, *self.args]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} [options] (script.py | -m module) [args...]",
        description="Start the ranks of a bitcoll TCP job on this node (see `python -m "
                    "pydoc launch.__main__` for the environment contract and exit status).")
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, metavar="N",
                   help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes in the job")
    p.add_argument("--node-rank", type=int, default=0, metavar="K", help="this node's index")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                   help="address of rank 0's node (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="rendezvous port (default: a free port when --nnodes is 1)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a library module as a script, like python -m")
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's options and the target (script or -m module...)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if a in ("-m", "--module"):
            return list(argv[:i]), ["-m", *argv[i + 1:]]
        if a.startswith("-m") and not a.startswith("--"):
            return list(argv[:i]), ["-m", a[2:], *argv[i + 1:]]
        if not a.startswith("-") or a == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if a in _VALUE_OPTIONS else 1
    return list(argv), []


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """Parse the launcher's command line (without the program name).

    Exits with status 2 and a usage message (argparse convention) on invalid options.
    """
    parser = _parser()
    opts, target = _split(argv)
    ns = parser.parse_args(opts)
    module: str | None = None
    script: str | None = None
    args: list[str] = []
    if target and target[0] == "-m":
        if len(target) < 2 or not target[1]:
            parser.error("-m needs a module name")
        module, args = target[1], target[2:]
    elif target:
        script, args = target[0], target[1:]
    else:
        parser.error("no script or -m module given")
    if ns.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {ns.nproc_per_node}")
    if ns.nnodes < 1:
        parser.error(f"--nnodes must be >= 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in [0, {ns.nnodes}), got {ns.node_rank}")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        parser.error(f"--master-port must be in 1..65535, got {ns.master_port}")
    if ns.master_port is None and ns.nnodes > 1:
        parser.error("--master-port is required when --nnodes > 1")
    if ns.grace_period < 0:
        parser.error(f"--grace-period must be >= 0, got {ns.grace_period}")
    return LaunchConfig(nproc_per_node=ns.nproc_per_node, nnodes=ns.nnodes,
                        node_rank=ns.node_rank, master_addr=ns.master_addr,
                        master_port=ns.master_port, grace_period=ns.grace_period,
                        module=module, script=script, args=args)


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now."""
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(sockaddr)
        return int(s.getsockname()[1])


def child_env(cfg: LaunchConfig, local_rank: int, port: int,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of local rank ``local_rank`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        "WORLD_SIZE": str(cfg.nnodes * cfg.nproc_per_node),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(port),
    })
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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


class _Output:
    """Copies one rank's stream to ours, line by line, with the rank prefix."""

    def __init__(self, src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock):
        self._src, self._dst, self._prefix, self._lock = src, dst, prefix, lock
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for line in iter(lambda: self._src.readline(1 << 16), b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    try:
                        self._dst.write(self._prefix + line)
                        self._dst.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone (closed pipe): keep draining the child
        finally:
            self._src.close()


class Launcher:
    """Starts and supervises the ranks of one node."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen[bytes]] = []
        self.outputs: list[_Output] = []
        self._signal: int | None = None
        self._signals_seen = 0
        self._lock = threading.Lock()

    def _say(self, msg: str) -> None:
        with self._lock:
            try:
                sys.stderr.write(f"launch: {msg}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def _kill(self, sig: int) -> None:
        """Send ``sig`` to the process group of every rank still running."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(sig)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals_seen += 1
        if self._signal is None:
            self._signal = signum
        self._kill(signal.SIGKILL if self._signals_seen > 1 else signum)

    def start(self) -> None:
        cfg = self.cfg
        port = cfg.master_port if cfg.master_port is not None else free_port(cfg.master_addr)
        out = sys.stdout.buffer
        err = sys.stderr.buffer
        for local in range(cfg.nproc_per_node):
            env = child_env(cfg, local, port)
            proc = subprocess.Popen(cfg.command(), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            self.procs.append(proc)
            prefix = f"[rank {env['RANK']}] ".encode()
            assert proc.stdout is not None and proc.stderr is not None
            self.outputs.append(_Output(proc.stdout, out, prefix, self._lock))
            self.outputs.append(_Output(proc.stderr, err, prefix, self._lock))

    def supervise(self) -> int:
        """Wait for the ranks; stop them all on the first failure; return the exit status."""
        cfg = self.cfg
        failed: tuple[int, subprocess.Popen[bytes], int] | None = None
        kill_at: float | None = None
        while True:
            running = 0
            for local, proc in enumerate(self.procs):
                rc = proc.poll()
                if rc is None:
                    running += 1
                elif rc != 0 and failed is None:
                    failed = (cfg.node_rank * cfg.nproc_per_node + local, proc, rc)
            if running == 0:
                break
            if (failed is not None or self._signal is not None) and kill_at is None:
                if failed is not None:
                    self._kill(signal.SIGTERM)
                kill_at = time.monotonic() + cfg.grace_period
            if kill_at is not None and time.monotonic() >= kill_at:
                self._kill(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(POLL_SECONDS)
        for o in self.outputs:
            o.thread.join(5.0)
        if failed is not None:
            rank, proc, rc = failed
            others = len(self.procs) > 1 and (kill_at is not None)
            tail = "; terminated the other ranks" if others else ""
            self._say(f"rank {rank} (pid {proc.pid}) {describe_exit(rc)}{tail}")
            return exit_status(rc)
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            self._say(f"received {name}; forwarded it to the ranks")
            return 128 + self._signal
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m launch`` and ``bitcoll-run``; returns the exit status."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(cfg)
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in handled}
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        for s in handled:
            signal.signal(s, launcher._on_signal)
    try:
        try:
            launcher.start()
        except OSError as exc:
            launcher._say(f"cannot start the ranks: {exc}")
            launcher._kill(signal.SIGKILL)
            return 1
        return launcher.supervise()
    finally:
        if in_main_thread:
            for s, h in previous.items():
                signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
