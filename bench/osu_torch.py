"""OSU-style torch.distributed benchmark: the "bitcoll" backend against gloo, side by side.

Run on every rank of a job (env:// init)::

    python -m launch -n 4 bench/osu_torch.py --sizes 8:256M --out results/torch_backend/x.txt

The default process group is the bitcoll backend (:mod:`bitcoll.torch`); a gloo group over
the same ranks is made with ``new_group(backend="gloo")``. For every collective and size both
run the same torch call (``dist.all_reduce(t, group=g)`` and friends) on the same tensors;
the backends alternate within each round (which goes first alternates too), and each round
is warm-up calls, a barrier, then a timed loop. A round's latency is the slowest rank's loop
time per call; the table shows the best round of each backend (``--rounds``, default 3).

Collectives (``--ops``): ``all_reduce`` (float32 sum, in place), ``all_gather``
(``all_gather_into_tensor``: the size is the output), ``reduce_scatter``
(``reduce_scatter_tensor``: the size is the input), ``broadcast`` (root 0) and
``all_to_all`` (``all_to_all_single``, equal splits). Sizes are bytes of float32 data
(``8:256M``: powers of two; a size below 4 bytes per rank where the op splits it is skipped).

Output (rank 0; ``--out`` also writes it to a file): OSU-format tables, ``#`` comment lines
(the command, the ranks, versions; the last one names the columns), then one row per size:
``Size  bitcoll(us)  gloo(us)  speedup  bitcoll-direct(us)``: speedup is gloo's latency over
the bitcoll backend's; the last column is the same collective called on the bitcoll
Communicator behind the group directly (numpy arrays), so the torch layer's own cost is the
difference between the first and the last column.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from osu import Schedule, display_command, sizes_arg

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def _op(name: str, nbytes: int, p: int, group: Any) -> Callable[[], object] | None:
    """A zero-argument call of collective ``name`` on ``nbytes`` of float32 over ``group``
    (None where the size does not split into whole elements per rank)."""
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    if name == "all_reduce":
        t = torch.zeros(n)
        return lambda: dist.all_reduce(t, group=group)
    if name == "broadcast":
        t = torch.zeros(n)
        return lambda: dist.broadcast(t, 0, group=group)
    if n % p or n == 0:
        return None
    if name == "all_gather":
        out, x = torch.zeros(n), torch.zeros(n // p)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if name == "reduce_scatter":
        x, out = torch.zeros(n), torch.zeros(n // p)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    x, out = torch.zeros(n), torch.zeros(n)
    return lambda: dist.all_to_all_single(out, x, group=group)


def _raw_op(name: str, nbytes: int, p: int) -> Callable[[], object] | None:
    """The same collective as :func:`_op` called on the bitcoll Communicator behind the
    default group directly (numpy arrays, no torch layer): the backend's own cost is the
    difference."""
    import numpy as np

    from bitcoll.torch import communicator_of

    comm = communicator_of()
    n = nbytes // 4
    if name == "all_reduce":
        t = np.zeros(n, np.float32)
        return lambda: comm.allreduce(t, out=t)
    if name == "broadcast":
        t = np.zeros(n, np.float32)
        return lambda: comm.broadcast(t, 0)
    if n % p or n == 0:
        return None
    if name == "all_gather":
        out, x = np.zeros(n, np.float32), np.zeros(n // p, np.float32)
        return lambda: comm.allgather(x, out=out)
    if name == "reduce_scatter":
        x, out = np.zeros(n, np.float32), np.zeros(n // p, np.float32)
        return lambda: comm.reduce_scatter(x, out=out)
    x, out = np.zeros(n, np.float32), np.zeros(n, np.float32)
    return lambda: comm.alltoall(x, out=out)


def _revision() -> str:
    """The repository's commit (short), or "unknown" outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _round(op: Callable[[], object], group: Any, iters: int, warmup: int) -> float:
    """Seconds per call of the slowest rank in one timed loop."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        op()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--sizes", type=sizes_arg, default=sizes_arg("8:256M"),
                        help="message sizes in bytes (default 8:256M)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma list of collectives (default {','.join(OPS)})")
    parser.add_argument("-i", "--iterations", type=int, default=100)
    parser.add_argument("-x", "--warmup", type=int, default=10)
    parser.add_argument("--iter-bytes", type=sizes_arg, default=[256 << 20],
                        help="bytes a size's timed loop moves at most (default 256M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    parser.add_argument("--testbed", default=None, metavar="OPTIONS",
                        help="the bench/netbed.py options this job runs under, e.g. "
                             "'--hosts 4 --rate 1gbit' (only recorded: the header's command "
                             "then starts with python bench/netbed.py OPTIONS)")
    parser.add_argument("--no-direct", action="store_true",
                        help="leave out the bitcoll-direct column (saves a third of the time "
                             "on slow links; the column then shows nan)")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        parser.error(f"unknown collectives {bad}; choose from {', '.join(OPS)}")

    import torch
    import torch.distributed as dist

    import bitcoll.torch  # noqa: F401  (registers "bitcoll")

    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("bitcoll", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    groups = {"bitcoll": dist.group.WORLD, "gloo": gloo}
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = Schedule(args.iterations, args.warmup, 3, args.iter_bytes[0])
    lines: list[str] = []

    def emit(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
            lines.append(line)

    cmd = " ".join(shlex.quote(a) for a in display_command([sys.executable, *sys.argv]))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if args.testbed:
        cmd = cmd.replace("python ", f"python bench/netbed.py {args.testbed} ", 1)
    elif local and os.environ.get("TORCHELASTIC_RUN_ID"):
        cmd = cmd.replace("python ", f"torchrun --nproc-per-node {local} ", 1)
    elif local:
        cmd = cmd.replace("python ", f"python -m launch -n {local} ", 1)
    settings = [f"{k}={os.environ[k]}" for k in ("NUMBA_NUM_THREADS", "THP_MEM_ALLOC_ENABLE",
                                                 "BITCOLL_SHM", "BITCOLL_TORCH_TRANSPORT")
                if k in os.environ]
    cmd = " ".join([*settings, cmd])
    emit("# OSU-style torch.distributed benchmark: bitcoll backend against gloo")
    emit(f"# command: {cmd}")
    emit(f"# ranks: {p}, host {platform.node()}, torch {torch.__version__}, bitcoll "
         f"{_revision()}, started {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
         f" UTC, load average {os.getloadavg()[0]:.1f}")
    for name in ops:
        emit("#")
        emit(f"# collective: {name} (float32{', sum' if 'reduce' in name else ''}), best "
             f"of {args.rounds} rounds, slowest rank's latency per call")
        emit("# Size  bitcoll(us)  gloo(us)  speedup  bitcoll-direct(us)")
        for nbytes in args.sizes:
            calls = {b: _op(name, nbytes, p, g) for b, g in groups.items()}
            if not args.no_direct:
                calls["direct"] = _raw_op(name, nbytes, p)
            if any(c is None for c in calls.values()):
                continue
            iters, warm = schedule.for_bytes(nbytes)
            best = {b: float("inf") for b in calls}
            for r in range(args.rounds):
                order = list(calls) if r % 2 == 0 else list(calls)[::-1]
                for b in order:
                    op = calls[b]
                    assert op is not None
                    best[b] = min(best[b], _round(op, groups.get(b, dist.group.WORLD), iters,
                                                  warm))
            us = {b: best[b] * 1e6 for b in calls}
            us.setdefault("direct", float("nan"))
            emit(f"{nbytes:<12d}{us['bitcoll']:>14.2f}{us['gloo']:>14.2f}"
                 f"{us['gloo'] / us['bitcoll']:>10.2f}{us['direct']:>14.2f}")
            del calls
    dist.destroy_process_group()
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
