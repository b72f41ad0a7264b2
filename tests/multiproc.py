"""Run a function on N real ranks (separate processes) over the TCP backend.

``run_world(size, target, *args)`` starts ``size`` processes, forked by the session's fork
server (:func:`tcp_world.forkserver`: numpy, bitcoll and lioncub are imported once, so a rank
starts in milliseconds rather than seconds); each takes the caller's environment and working
directory as they are at the call (as a spawned process would), sets the launcher's
environment (:func:`tcp_env`), creates ``bitcoll.init("tcp")`` and returns
``target(comm, *args)``. ``target`` must be a module-level (importable) function and
its result picklable. Any failing rank makes ``run_world`` raise AssertionError carrying every
failing rank's traceback; ranks still running after ``timeout`` are killed.

``start(target, *args)`` starts one such process running ``target(*args)`` (for tests that
drive their ranks themselves); ``context(module)`` is the multiprocessing context to make its
queues and events with.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

from tcp_world import forkserver, free_port

__all__ = ["context", "free_port", "run_world", "start", "tcp_env"]


def tcp_env(rank: int, size: int, port: int) -> dict[str, str]:
    """The environment ``bitcoll.init("tcp")`` reads: the torchrun contract on 127.0.0.1,
    with bitcoll's own store on ``port`` (``BITCOLL_MASTER_PORT``)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "BITCOLL_MASTER_PORT": str(port)}


def context(module: str) -> Any:
    """The multiprocessing context of :func:`start` and :func:`run_world` (the fork server,
    ``module`` preloaded if the server is not running yet): make queues and events with it."""
    return forkserver(module)


def _as_spawned(environ: dict[str, str], cwd: str, target: Callable[..., Any],
                args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    target(*args)


def start(target: Callable[..., Any], *args: Any, daemon: bool = True) -> Any:
    """Start ``target(*args)`` (a module-level function) in a process forked by the fork
    server, with the caller's environment and working directory; return the started
    ``multiprocessing`` process."""
    proc = context(target.__module__).Process(
        target=_as_spawned, args=(dict(os.environ), os.getcwd(), target, args), daemon=daemon)
    proc.start()
    return proc


def _child(rank: int, size: int, port: int, comm_timeout: float, target: Callable[..., Any],
           args: tuple[Any, ...], results: Any, comm_kwargs: dict[str, Any],
           extra_env: dict[str, str]) -> None:
    os.environ.update(tcp_env(rank, size, port))
    os.environ.update(extra_env)
    os.environ["NUMBA_NUM_THREADS"] = "1"
    try:
        import bitcoll

        comm = bitcoll.init("tcp", timeout=comm_timeout, **comm_kwargs)
        try:
            out = target(comm, *args)
        finally:
            comm.close()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_world(size: int, target: Callable[..., Any], *args: Any, timeout: float = 120.0,
              comm_timeout: float = 120.0, port: int | None = None,
              rank_env: dict[int, dict[str, str]] | None = None,
              **comm_kwargs: Any) -> list[Any]:
    """Run ``target(comm, *args)`` on ``size`` TCP ranks; return the results in rank order.
    ``port``: bitcoll's store port (default: a free one); ``rank_env``: extra environment
    variables of some ranks."""
    results = context(target.__module__).Queue()
    port = free_port() if port is None else port
    procs = [start(_child, r, size, port, comm_timeout, target, args, results, comm_kwargs,
                   (rank_env or {}).get(r, {}))
             for r in range(size)]
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(size)) - set(got))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s") \
                    from None
            got[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: v for r, (ok, v) in sorted(got.items()) if not ok}
    if failed:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in failed.items()))
    return [got[r][1] for r in range(size)]
