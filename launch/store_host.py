"""``python -m launch --max-restarts N``: an elastic job whose store lives in the launcher.

With ``--max-restarts N`` (N >= 0) the launcher does three things differently:

* **It serves the rendezvous store** (bitcoll's authenticated store,
  :class:`bitcoll.transport.rendezvous.store.StoreServer`) itself, on ``--master-addr`` and the port
  bitcoll's store would use (``BITCOLL_MASTER_PORT``), and tells the ranks where it is in
  ``BITCOLL_ELASTIC_STORE=host:port``. No rank hosts anything, so any rank, rank 0 included,
  may die: :class:`bitcoll.elastic.ElasticGroup` (``from_env``) connects to it.
* **A rank that dies does not stop the others.** The survivors agree on a new epoch through
  the store (:mod:`bitcoll.elastic`).
* **A dead rank is started again**, at most ``N`` times over the whole job, with the same
  environment plus ``BITCOLL_RESTART_COUNT`` (how many restarts the job had before it). The
  new process finds the job running and joins it at the next step boundary.

The job ends when every process has exited; its status is 0 when the last process of every
rank exited 0, else the first failure's (``128 + signal`` for a signal). SIGINT/SIGTERM are
forwarded to the ranks and end the restarts.

What is still a single point of failure: **the launcher's host** (node 0's launcher with
``--nnodes > 1``). It holds the store, and the store is the only place where the survivors
can meet without trusting each other's view: a replicated store would need a consensus
protocol of its own (three or more hosts) for a gain that only matters when the launcher's
host fails, and the job is lost then anyway when the store's host was also a compute host.
Its load is tiny (a heartbeat per rank every 100 ms, a few keys per transition), so it can
run on a small reliable machine apart from the preemptible ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from .supervise import describe_exit, exit_status

if TYPE_CHECKING:
    from .__main__ import LaunchConfig

__all__ = ["pop_max_restarts", "run_elastic", "ENV_ELASTIC_STORE", "ENV_RESTART_COUNT"]

ENV_ELASTIC_STORE = "BITCOLL_ELASTIC_STORE"
ENV_RESTART_COUNT = "BITCOLL_RESTART_COUNT"
#: ``--max-restarts`` from the environment when the option is not given (for wrappers that
#: start the launcher themselves, e.g. bench/netbed.py).
ENV_MAX_RESTARTS = "BITCOLL_MAX_RESTARTS"
#: Launcher options that take a value (the scan for --max-restarts skips their values).
_VALUED = ("-n", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
           "--master-port", "--grace-period", "--output-ranks")


def pop_max_restarts(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Take ``--max-restarts N`` (or ``--max-restarts=N``) out of the launcher's own options
    (before the script), else ``BITCOLL_MAX_RESTARTS`` from the environment; return ``(N or
    None, the other arguments)``. Exits with status 2
    for a value that is not an integer >= 0."""
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a in ("-m", "--module"):
            break
        value: str | None = None
        if a == "--max-restarts":
            if i + 1 >= len(args):
                _usage("--max-restarts needs a value")
            value = args[i + 1]
            del args[i:i + 2]
        elif a.startswith("--max-restarts="):
            value = a.split("=", 1)[1]
            del args[i]
        if value is not None:
            if not value.isdigit():
                _usage(f"--max-restarts must be an integer >= 0, got {value!r}")
            return int(value), args
        i += 2 if a in _VALUED else 1
    env = os.environ.get(ENV_MAX_RESTARTS, "")
    if env:
        if not env.isdigit():
            _usage(f"{ENV_MAX_RESTARTS} must be an integer >= 0, got {env!r}")
        return int(env), args
    return None, args


def _usage(msg: str) -> None:
    sys.stderr.write(f"bitcoll-run: error: {msg}\n")
    sys.exit(2)


def run_elastic(cfg: LaunchConfig, max_restarts: int) -> int:
    """Run the ranks of this node as an elastic job (see the module docstring); return the
    exit status."""
    from bitcoll.transport.rendezvous.store import StoreServer

    from .__main__ import SECRET_ENV, _Output, child_env, job_env

    job = job_env(cfg)
    secret = job.secret or os.environ.get(SECRET_ENV)
    if not secret:
        _usage(f"--max-restarts with --nnodes > 1 needs {SECRET_ENV} set to the same value on "
               "every node")
    assert secret is not None
    server = None
    if cfg.node_rank == 0:
        server = StoreServer(cfg.master_addr, job.bitcoll_master_port,
                             secret=secret.encode("utf-8"))
    where = f"{cfg.master_addr}:{job.bitcoll_master_port}"
    lock = threading.Lock()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    stop: list[int] = []

    def say(msg: str) -> None:
        with lock:
            sys.stderr.write(f"launch: {msg}\n")
            sys.stderr.flush()

    def spawn(local: int, restarts: int) -> subprocess.Popen[bytes]:
        env = child_env(cfg, local, job)
        env[ENV_ELASTIC_STORE] = where
        env[ENV_RESTART_COUNT] = str(restarts)
        if job.secret is not None:
            env[SECRET_ENV] = job.secret
        rank = cfg.rank(local)
        shown = cfg.shows(rank)
        stream = subprocess.PIPE if shown else subprocess.DEVNULL
        proc = subprocess.Popen(cfg.command(), env=env, stdin=subprocess.DEVNULL,
                                stdout=stream, stderr=stream, start_new_session=True)
        if shown:
            prefix = f"[rank {rank}] ".encode() if cfg.prefix else b""
            assert proc.stdout is not None and proc.stderr is not None
            _Output(proc.stdout, out, prefix, lock)
            _Output(proc.stderr, err, prefix, lock)
        return proc

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL if len(stop) > 1 else signum)

    procs: list[subprocess.Popen[bytes]] = []
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs = [spawn(local, 0) for local in range(cfg.nproc_per_node)]
        restarts = 0
        failed: int | None = None
        while any(p.poll() is None for p in procs):
            time.sleep(0.05)
            for local, p in enumerate(procs):
                rc = p.poll()
                if rc is None or rc == 0 or getattr(p, "_restarted", False):
                    continue
                p._restarted = True  # type: ignore[attr-defined]
                rank = cfg.rank(local)
                if restarts < max_restarts and not stop:
                    restarts += 1
                    say(f"rank {rank} (pid {p.pid}) {describe_exit(rc)}; restart "
                        f"{restarts} of {max_restarts}")
                    procs[local] = spawn(local, restarts)
                elif failed is None:
                    failed = rc
                    say(f"rank {rank} (pid {p.pid}) {describe_exit(rc)}; no restart left")
        statuses = [p.returncode for p in procs]
        if failed is None:
            bad = [rc for rc in statuses if rc]
            failed = bad[0] if bad else None
        if failed is not None:
            return exit_status(failed)
        return 128 + stop[0] if stop else 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if server is not None:
            server.close()
