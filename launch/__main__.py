"""bitcoll-run: start the ranks of a TCP job on this node (torchrun-style).

Usage::

    python -m launch [options] script.py [script args...]
    python -m launch [options] -m package.module [module args...]
    bitcoll-run [options] script.py [script args...]

Runs ``--nproc-per-node`` copies of the script (or module, as ``python -m`` would) with the
interpreter running the launcher (``sys.executable``), each with its rank in the environment,
and waits for them. The first argument that is not one of the launcher's options is the
script (with ``-m``: the module); it and everything after it go to the ranks untouched, so
the script's options may share names with the launcher's. ``--`` before the script name ends
the launcher's options (for a script whose name starts with ``-``).

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
    TCP port on ``--master-addr`` for torch.distributed (``MASTER_PORT``); bitcoll's own store
    then listens on ``PORT + 1`` (``BITCOLL_MASTER_PORT``, see below). Default: ports the
    launcher finds free when ``--nnodes`` is 1; required otherwise.
``--grace-period SECONDS``
    how long ranks get to exit after SIGTERM before SIGKILL (default 5).
``-m``, ``--module``
    the first argument after the options is a module to run as ``python -m`` does.
``--no-prefix``
    copy the ranks' output lines without the ``[rank R]`` prefix.
``--max-restarts N``
    an elastic job (:mod:`launch.store_host`): the launcher serves the rendezvous store, a
    rank that dies does not stop the others, and dead ranks are started again (at most N
    times in all) to rejoin through :class:`bitcoll.elastic.ElasticGroup`.
``--output-ranks RANKS``
    show only these global ranks' output: a comma list of ranks and ranges, e.g. ``0`` or
    ``0,2`` or ``0-3,8``. The other ranks' stdout and stderr go to ``/dev/null``, so they never
    block on a full pipe; the launcher's own ``launch:`` messages are always shown.

Environment contract
--------------------
Each rank's process inherits the launcher's environment plus:

=================== ===========================================================================
RANK                global rank, ``node_rank * nproc_per_node + local_rank``
WORLD_SIZE          ``nnodes * nproc_per_node``
LOCAL_RANK          index of the rank on this node, ``[0, nproc_per_node)``
LOCAL_WORLD_SIZE    ``nproc_per_node``
GROUP_RANK          ``--node-rank`` (torchrun's name): bitcoll's ``comm.host_index`` and
                    ``comm.local_rank`` come from it
GROUP_WORLD_SIZE    ``--nnodes``
MASTER_ADDR         ``--master-addr``
MASTER_PORT         ``--master-port``, or a free port chosen by the launcher (single node);
                    torch.distributed's ``init_process_group`` binds it on rank 0
BITCOLL_MASTER_PORT port of bitcoll's own rendezvous store on ``MASTER_ADDR``, never equal
                    to ``MASTER_PORT`` so that torch.distributed and bitcoll can both run
                    in one script: the launcher's ``BITCOLL_MASTER_PORT`` if it has one
                    (then the same on every node), else ``--master-port + 1`` (an error
                    when that exceeds 65535), else (single node, no ``--master-port``) a
                    second free port
BITCOLL_SECRET      the job's shared secret, which bitcoll's ranks use to authenticate each
                    other. Single node: unless the launcher's environment already has one,
                    a fresh random one per job (``secrets.token_hex(32)``). Several nodes:
                    passed through as set in the launcher's environment (set the same value
                    on every node); if unset it stays unset and bitcoll falls back to a
                    secret file that only works when all nodes share one machine and user.
                    The launcher never prints it
PYTHONUNBUFFERED    ``1`` unless already set, so output appears as it is printed
=================== ===========================================================================

``bitcoll.init()`` reads these and connects the ranks over TCP. The ranks' standard input is
``/dev/null``; each rank runs in its own process group.

Output
------
Every line a rank writes to stdout (stderr) is written to the launcher's stdout (stderr)
prefixed with ``[rank R]`` and a space (none with ``--no-prefix``), one whole line at a time, so
lines of different ranks never mix. ``--output-ranks`` selects whose lines are shown. The
launcher's own messages start with ``launch:`` and go to stderr.

Identical stderr of several ranks is shown once: the lines of the first rank that writes to
stderr are shown as they come; another rank's lines are held back while they repeat that
rank's, line for line, and dropped if the rank's stderr ends that way (the launcher then says
``launch: ranks 1, 2, 3 wrote the same lines to stderr as the rank shown above (shown once)``).
So a mistyped option of the script prints its usage message once, not once per rank. A line
that differs, or a hold of more than 5 s or 1000 lines, shows the held lines after all, in
order (a traceback that differs only in its last line is shown whole for every rank).

Failure handling and exit status
--------------------------------
* All ranks exit 0: the launcher exits 0.
* A rank exits with a non-zero status or is killed by a signal: the launcher sends SIGTERM to
  the process groups of the ranks still running (after a rank killed by a signal, only once
  they have had up to 2 s to exit on their own and print their own errors, e.g. bitcoll's
  ``PeerLostError`` naming the lost rank), SIGKILL after the grace period, reports the
  rank that failed first *in time* (not the lowest-numbered one: the others often fail a few
  milliseconds later because it did), e.g. ``launch: rank 2 (pid 1234) was killed by
  SIGKILL; terminated the other ranks``, and exits with that rank's status (``128 + signal
  number`` for a signal).
* SIGINT or SIGTERM sent to the launcher is forwarded to every rank (a second one sends
  SIGKILL, as does the end of the grace period); the launcher then waits for the ranks as
  above and exits with the first failing rank's status, or ``128 + signal number`` if every
  rank exited 0.
* Bad options (or a bad ``BITCOLL_MASTER_PORT``): exit status 2 with a usage message; a rank
  that cannot be started: 1.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import IO

from .supervise import Supervisor, describe_exit, exit_status

__all__ = ["main", "parse_args", "parse_ranks", "LaunchConfig", "JobEnv", "job_env",
           "child_env", "exit_status", "describe_exit", "free_ports", "Launcher"]

PROG = "bitcoll-run"
DEFAULT_GRACE = 5.0
SECRET_ENV = "BITCOLL_SECRET"
#: Identical stderr of several ranks is shown once (:class:`_Echoes`): how long, and how many
#: lines, a rank's lines may be held back while they repeat another rank's.
ECHO_SECONDS = 5.0
ECHO_LINES = 1000
#: After a rank is killed by a signal, how long the others get to exit on their own (and print
#: their own errors) before they are sent SIGTERM.
REPORT_SECONDS = 2.0
BITCOLL_PORT_ENV = "BITCOLL_MASTER_PORT"


@dataclass
class LaunchConfig:
    """The parsed command line."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    #: bitcoll's store port when fixed before start (environment or ``master_port + 1``);
    #: None: the launcher picks a free one.
    bitcoll_master_port: int | None = None
    grace_period: float = DEFAULT_GRACE
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)
    prefix: bool = True
    #: Global ranks whose output is shown; None: every rank's.
    output_ranks: frozenset[int] | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def rank(self, local_rank: int) -> int:
        """The global rank of local rank ``local_rank`` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank

    def shows(self, rank: int) -> bool:
        """Whether global rank ``rank``'s output is copied to the launcher's."""
        return self.output_ranks is None or rank in self.output_ranks

    def command(self) -> list[str]:
        """The command line of one rank."""
        if self.module is not None:
            return [sys.executable, "-m", self.module, *self.args]
        assert self.script is not None
        return [sys.executable, self.script, *self.args]


def parse_ranks(spec: str) -> frozenset[int]:
    """``"0,2"``, ``"0-3,8"`` to a set of ranks; ValueError for anything else."""
    out: set[int] = set()
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if m is None:
            raise ValueError(f"expected ranks like 0,2 or 0-3, got {spec!r}")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        if hi < lo:
            raise ValueError(f"empty rank range {item.strip()!r} in {spec!r}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def _manual() -> str:
    """The module docstring from the environment contract on, as plain text for --help."""
    doc = __doc__ or ""
    start = doc.find("Environment contract")
    return doc[start:].replace("``", "") if start >= 0 else ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} [options] (script.py | -m module) [args...]",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Start the ranks of a bitcoll TCP job on this node. Everything from the "
                    "script (or -m module) on is passed to the ranks untouched.",
        epilog=_manual())
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, metavar="N",
                   help="ranks to start on this node")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes in the job")
    p.add_argument("--node-rank", type=int, default=0, metavar="K", help="this node's index")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                   help="address of rank 0's node (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="torch.distributed's port (MASTER_PORT); bitcoll's store uses PORT + 1 "
                        "(default: free ports when --nnodes is 1)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run a library module as a script, like python -m")
    p.add_argument("--no-prefix", action="store_true",
                   help="copy the ranks' output without the '[rank R] ' prefix")
    p.add_argument("--output-ranks", default=None, metavar="RANKS",
                   help="show only these ranks' output, e.g. 0 or 0,2 or 0-3 (the others' "
                        "output is discarded; launch: messages are always shown)")
    p.add_argument("target", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse the launcher's command line (without the program name); ``environ`` (default
    ``os.environ``) supplies ``BITCOLL_MASTER_PORT`` when set.

    Exits with status 2 and a usage message (argparse convention) on invalid options.
    """
    env = os.environ if environ is None else environ
    parser = _parser()
    ns = parser.parse_args(list(argv))
    target: list[str] = ns.target
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        parser.error("-m needs a module name" if ns.module else "no script or -m module given")
    module: str | None = None
    script: str | None = None
    if ns.module:
        module = target[0]
        if not module or module.startswith("-"):
            parser.error(f"-m needs a module name, got {module!r}")
    else:
        script = target[0]
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
    bitcoll_port: int | None = None
    if env.get(BITCOLL_PORT_ENV) is not None:
        text = env[BITCOLL_PORT_ENV]
        if not text.strip().isdigit() or not 0 < int(text) < 65536:
            parser.error(f"{BITCOLL_PORT_ENV} must be a port in 1..65535, got {text!r}")
        bitcoll_port = int(text)
        if bitcoll_port == ns.master_port:
            parser.error(f"{BITCOLL_PORT_ENV} ({bitcoll_port}) must differ from --master-port")
    elif ns.master_port is not None:
        bitcoll_port = ns.master_port + 1
        if bitcoll_port > 65535:
            parser.error(f"--master-port {ns.master_port} leaves no port for bitcoll's store "
                         f"({BITCOLL_PORT_ENV} = --master-port + 1 = {bitcoll_port} > 65535): "
                         f"choose a lower port or set {BITCOLL_PORT_ENV}")
    world = ns.nnodes * ns.nproc_per_node
    output_ranks: frozenset[int] | None = None
    if ns.output_ranks is not None:
        try:
            output_ranks = parse_ranks(ns.output_ranks)
        except ValueError as exc:
            parser.error(f"--output-ranks: {exc}")
        outside = sorted(r for r in output_ranks if r >= world)
        if outside:
            parser.error(f"--output-ranks: ranks {outside} are outside the world of {world}")
    return LaunchConfig(nproc_per_node=ns.nproc_per_node, nnodes=ns.nnodes,
                        node_rank=ns.node_rank, master_addr=ns.master_addr,
                        master_port=ns.master_port, bitcoll_master_port=bitcoll_port,
                        grace_period=ns.grace_period, module=module, script=script,
                        args=target[1:], prefix=not ns.no_prefix, output_ranks=output_ranks)


def free_ports(host: str, count: int = 1, exclude: Sequence[int] = ()) -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now (none in
    ``exclude``)."""
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    with ExitStack() as held:  # keep every socket bound until all ports are picked
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            s.bind(sockaddr)
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports


@dataclass(frozen=True)
class JobEnv:
    """What the ranks of this node share beyond the command line: the two rendezvous ports
    and, when the launcher generated one, the job's secret (None: ``BITCOLL_SECRET`` is left
    as the launcher's environment has it)."""

    master_port: int
    bitcoll_master_port: int
    secret: str | None = field(default=None, repr=False)


def job_env(cfg: LaunchConfig, environ: Mapping[str, str] | None = None) -> JobEnv:
    """Pick the ports (free ones where the command line and ``environ`` leave them open) and
    generate the secret of a single-node job without ``BITCOLL_SECRET`` (see the module
    docstring)."""
    env = os.environ if environ is None else environ
    master, bitcoll = cfg.master_port, cfg.bitcoll_master_port
    if master is None:
        master = free_ports(cfg.master_addr, 1, exclude=[] if bitcoll is None else [bitcoll])[0]
    if bitcoll is None:
        bitcoll = free_ports(cfg.master_addr, 1, exclude=[master])[0]
    secret = secrets.token_hex(32) if cfg.nnodes == 1 and SECRET_ENV not in env else None
    return JobEnv(master, bitcoll, secret)


def child_env(cfg: LaunchConfig, local_rank: int, job: JobEnv,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of local rank ``local_rank`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(cfg.rank(local_rank)),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "GROUP_RANK": str(cfg.node_rank),
        "GROUP_WORLD_SIZE": str(cfg.nnodes),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(job.master_port),
        BITCOLL_PORT_ENV: str(job.bitcoll_master_port),
    })
    if job.secret is not None:
        env[SECRET_ENV] = job.secret
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _write(dst: IO[bytes], data: bytes) -> None:
    try:
        dst.write(data)
        dst.flush()
    except (OSError, ValueError):
        pass  # our own output is gone (closed pipe): keep draining the children


class _Held:
    """A rank's stderr lines held back by :class:`_Echoes`."""

    __slots__ = ("ended", "lines", "matched", "prefix", "since")

    def __init__(self, prefix: bytes, since: float) -> None:
        self.prefix = prefix
        self.lines: list[bytes] = []
        self.matched = 0  # how many of ``lines`` equal the leader's at the same positions
        self.since = since
        self.ended = False


class _Echoes:
    """Shows identical stderr of several ranks once (every rank's usage message after a
    mistyped option of the script).

    The first rank to write to stderr *leads*: its lines are shown as they come. Another rank's
    lines are held back while they equal the leader's lines at the same positions (or the
    leader has not written that many yet). When such a rank's stream ends with every line
    matched, its lines are dropped and counted (:meth:`summary`). A line that differs, the
    leader's stream ending with fewer lines, :data:`ECHO_LINES` held lines or a hold older than
    :data:`ECHO_SECONDS` releases a rank: its held lines are shown, in order, and from then
    on its lines as they come. All methods take ``lock`` (the one every output writes under).
    """

    def __init__(self, dst: IO[bytes], lock: threading.Lock) -> None:
        self._dst = dst
        self._cond = threading.Condition(lock)
        self._leader: int | None = None
        self._leader_done = False
        self._lines: list[bytes] = []
        self._held: dict[int, _Held] = {}
        self._free: set[int] = set()
        self.echoed: dict[int, int] = {}  # rank -> lines dropped
        self._open = True
        threading.Thread(target=self._expire, daemon=True).start()

    def write(self, rank: int, prefix: bytes, line: bytes) -> None:
        with self._cond:
            if self._leader is None:
                self._leader = rank
            if rank == self._leader:
                self._lines.append(line)
                _write(self._dst, prefix + line)
                for r in list(self._held):
                    self._settle(r)
            elif rank in self._free:
                _write(self._dst, prefix + line)
            else:
                held = self._held.get(rank)
                if held is None:
                    held = self._held[rank] = _Held(prefix, time.monotonic())
                    self._cond.notify()
                held.lines.append(line)
                self._settle(rank)

    def end(self, rank: int) -> None:
        """``rank``'s stream ended."""
        with self._cond:
            if rank == self._leader:
                self._leader_done = True
                for r in list(self._held):
                    self._settle(r)
            elif rank in self._held:
                self._held[rank].ended = True
                self._settle(rank)

    def _settle(self, rank: int) -> None:
        held = self._held[rank]
        lines = self._lines
        while held.matched < len(held.lines) and held.matched < len(lines):
            if held.lines[held.matched] != lines[held.matched]:
                self._release(rank)
                return
            held.matched += 1
        if held.matched < len(held.lines):  # ahead of the leader
            if self._leader_done or len(held.lines) >= ECHO_LINES:
                self._release(rank)
        elif held.ended:
            self.echoed[rank] = len(held.lines)
            del self._held[rank]

    def _release(self, rank: int) -> None:
        held = self._held.pop(rank)
        self._free.add(rank)
        _write(self._dst, b"".join(held.prefix + line for line in held.lines))

    def _expire(self) -> None:
        with self._cond:
            while self._open:
                now = time.monotonic()
                for r, held in list(self._held.items()):
                    if now - held.since >= ECHO_SECONDS:
                        self._release(r)
                due = [h.since + ECHO_SECONDS for h in self._held.values()]
                self._cond.wait(None if not due else max(0.0, min(due) - now))

    def close(self) -> None:
        """Release whatever is still held (streams that never ended) and stop the timer."""
        with self._cond:
            for r in list(self._held):
                held = self._held[r]
                if held.ended and held.matched == len(held.lines):
                    self.echoed[r] = len(held.lines)
                    del self._held[r]
                else:
                    self._release(r)
            self._open = False
            self._cond.notify()


class _Output:
    """Copies one rank's stream to ours, line by line, after ``prefix`` (through ``echoes``
    when given: stderr)."""

    def __init__(self, src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock,
                 rank: int = 0, echoes: _Echoes | None = None):
        self._src, self._dst, self._prefix, self._lock = src, dst, prefix, lock
        self._rank, self._echoes = rank, echoes
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for line in iter(lambda: self._src.readline(1 << 16), b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if self._echoes is not None:
                    self._echoes.write(self._rank, self._prefix, line)
                    continue
                with self._lock:
                    _write(self._dst, self._prefix + line)
        finally:
            if self._echoes is not None:
                self._echoes.end(self._rank)
            self._src.close()


class Launcher:
    """Starts the ranks of one node; a :class:`~launch.supervise.Supervisor` watches them."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.supervisor = Supervisor(cfg.grace_period, group=True,
                                     report_window=REPORT_SECONDS)
        self.outputs: list[_Output] = []
        self._lock = threading.Lock()
        self.echoes: _Echoes | None = None

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return self.supervisor.procs

    def say(self, msg: str) -> None:
        """Print ``launch: msg`` on stderr."""
        with self._lock:
            try:
                sys.stderr.write(f"launch: {msg}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def start(self) -> None:
        """Start every rank (stops early when a signal arrives meanwhile). Raises OSError
        when a rank cannot be started."""
        cfg = self.cfg
        job = job_env(cfg)
        out, err = sys.stdout.buffer, sys.stderr.buffer
        self.echoes = _Echoes(err, self._lock)
        for local in range(cfg.nproc_per_node):
            if self.supervisor.signal is not None:
                break
            rank = cfg.rank(local)
            shown = cfg.shows(rank)
            stream = subprocess.PIPE if shown else subprocess.DEVNULL
            proc = subprocess.Popen(cfg.command(), env=child_env(cfg, local, job),
                                    stdin=subprocess.DEVNULL, stdout=stream, stderr=stream,
                                    start_new_session=True)
            self.supervisor.add(proc)
            if shown:
                prefix = f"[rank {rank}] ".encode() if cfg.prefix else b""
                assert proc.stdout is not None and proc.stderr is not None
                self.outputs.append(_Output(proc.stdout, out, prefix, self._lock))
                self.outputs.append(_Output(proc.stderr, err, prefix, self._lock, rank,
                                            self.echoes))

    def abandon(self) -> None:
        """Kill and reap the ranks started so far (after a failed :meth:`start`)."""
        self.supervisor.send(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def supervise(self) -> int:
        """Wait for the ranks; stop them all on the first failure; return the exit status."""
        outcome = self.supervisor.wait()
        for o in self.outputs:
            o.thread.join(5.0)
        if self.echoes is not None:
            self.echoes.close()
            echoed = sorted(self.echoes.echoed)
            if echoed:
                self.say(f"{'rank' if len(echoed) == 1 else 'ranks'} "
                         f"{', '.join(str(r) for r in echoed)} wrote the same lines to stderr "
                         "as the rank shown above (shown once)")
        if outcome.failed is not None:
            local, rc = outcome.failed
            tail = "; terminated the other ranks" if outcome.stopped else ""
            self.say(f"rank {self.cfg.rank(local)} (pid {self.procs[local].pid}) "
                     f"{describe_exit(rc)}{tail}")
        elif outcome.signal is not None:
            name = signal.Signals(outcome.signal).name
            self.say(f"received {name}; forwarded it to the ranks")
        return outcome.status()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m launch`` and ``bitcoll-run``; returns the exit status."""
    from .store_host import pop_max_restarts, run_elastic

    restarts, args = pop_max_restarts(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(args)
    if restarts is not None:  # elastic: the launcher serves the store (launch.store_host)
        return run_elastic(cfg, restarts)
    launcher = Launcher(cfg)
    with launcher.supervisor.handle_signals():
        try:
            launcher.start()
        except OSError as exc:
            launcher.say(f"cannot start the ranks: {exc}")
            launcher.abandon()
            return 1
        return launcher.supervise()


if __name__ == "__main__":
    sys.exit(main())
