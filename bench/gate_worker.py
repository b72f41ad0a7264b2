"""The measuring side of the regression gate (:mod:`gate`): run inside a job, it times pairs
of loops interleaved round by round and prints one JSON line per figure on rank 0.

::

    python -m launch -n 2 bench/gate_worker.py loopback     # bitcoll against gloo, packed
    mpiexec -n 2 python bench/gate_worker.py mpi            # bitcoll over MPI against mpi4py
    python bench/netbed.py --hosts 2 --rate 1gbit bench/gate_worker.py wire

A figure is ``{"figure": name, "ours": us, "ref": us, "ratio": ours / ref}``: the best round of
each side (the least disturbed one) and their ratio, lower is better. For ``wire`` the
reference is not a loop but the bytes this rank sent per call (``"bytes"``), from which the
gate computes the wire bound with the testbed's probed rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
import osu

ROUNDS = 5


def _paired(name: str, ours: tuple[osu.Runtime, Callable[[], object]],
            ref: tuple[osu.Runtime, Callable[[], object]], iters: int, warm: int) -> None:
    best = [float("inf"), float("inf")]
    for r in range(ROUNDS):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            rt, op = (ours, ref)[k]
            best[k] = min(best[k], osu.time_loop(rt, op, iters, warm).avg_us)
    if ours[0].rank == 0:
        print(json.dumps({"figure": name, "ours": best[0], "ref": best[1],
                          "ratio": best[0] / best[1]}), flush=True)


def _iters(nbytes: int) -> tuple[int, int]:
    if nbytes <= 64 << 10:
        return 400, 40
    if nbytes <= 4 << 20:
        return 40, 4
    return 4, 1


def loopback(rt: osu.BitcollRuntime) -> None:
    """bitcoll's float32 all-reduce against gloo's (in place, both), its all-gather of 8
    bytes a rank against its all-reduce of the same 8 bytes (one exchange each on 2 ranks),
    the packed majority all-reduce against bitcoll's own float32 all-reduce of the same
    elements, and the torch backend's ``dist.all_reduce`` against the communicator behind it
    (what the torch layer adds)."""
    import torch
    import torch.distributed as dist

    gloo = osu.open_runtime("gloo", timeout=120.0)
    comm = rt.comm
    try:
        _torch_layer(rt)
        for nbytes, label in ((8, "8B"), (1 << 20, "1M"), (16 << 20, "16M")):
            x = np.zeros(nbytes // 4, np.float32)
            t = torch.zeros(nbytes // 4, dtype=torch.float32)
            _paired(f"allreduce_vs_gloo_{label}", (rt, partial(comm.allreduce, x, out=x)),
                    (gloo, partial(dist.all_reduce, t)), *_iters(nbytes))
        x = np.zeros(2, np.float32)
        gathered = np.zeros(2 * rt.size, np.float32)
        _paired("allgather_vs_allreduce_8B", (rt, partial(comm.allgather, x, out=gathered)),
                (rt, partial(comm.allreduce, x, out=x)), *_iters(8))
        for n, label in ((1 << 14, "16K"), (1 << 20, "1M")):
            v = np.random.default_rng(rt.rank).standard_normal(n).astype(np.float32)
            out = np.empty(n, np.int8)
            dense = np.empty(n, np.float32)
            _paired(f"majority_vs_float32_{label}",
                    (rt, partial(comm.sign_allreduce, v, out=out)),
                    (rt, partial(comm.allreduce, v, out=dense)),
                    *_iters(4 * n))
    finally:
        gloo.close()


def _torch_layer(rt: osu.BitcollRuntime) -> None:
    """``dist.all_reduce`` of 8 B on a group of the "bitcoll" backend (the default group is
    gloo's) against the group's own Communicator called directly on the same memory: what the
    torch layer adds to a call (its checks, work object and any staging). Larger calls are
    left out: at 1 MiB the pair's ratio moved between 0.91 and 1.36 from run to run."""
    import torch
    import torch.distributed as dist

    import bitcoll.torch

    group = dist.new_group(backend="bitcoll")
    inner = bitcoll.torch.communicator_of(group)
    t = torch.zeros(2, dtype=torch.float32)
    x = t.numpy()
    _paired("torch_allreduce_vs_direct_8B", (rt, partial(dist.all_reduce, t, group=group)),
            (rt, partial(inner.allreduce, x, out=x)), *_iters(8))
    dist.destroy_process_group(group)


def mpi(rt: osu.BitcollRuntime) -> None:
    """bitcoll over MPI against mpi4py's ``Allreduce`` of the same float32 vector."""
    from mpi4py import MPI

    ref = osu.open_runtime("mpi4py")
    comm = rt.comm
    try:
        for nbytes, label in ((8, "8B"), (64 << 10, "64K")):
            x = np.zeros(nbytes // 4, np.float32)
            y = np.zeros(nbytes // 4, np.float32)
            _paired(f"mpi_allreduce_vs_mpi4py_{label}",
                    (rt, partial(comm.allreduce, x, out=y)),
                    (ref, partial(MPI.COMM_WORLD.Allreduce, x, y)), *_iters(nbytes))
    finally:
        ref.close()


def wire(rt: osu.BitcollRuntime) -> None:
    """The default majority all-reduce of 64M elements: its best time and the bytes it sent
    per call (against the wire bound), and paired against the best forced algorithm (the
    direct exchange, the bandwidth-optimal pipeline)."""
    comm = rt.comm
    n = 64 << 20
    v = np.random.default_rng(rt.rank).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.int8)
    default = partial(comm.sign_allreduce, v, out=out)
    forced = partial(comm.sign_allreduce, v, out=out, algorithm="direct")
    best = [float("inf"), float("inf")]
    sent = 0.0
    for r in range(ROUNDS):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = osu.time_loop(rt, (default, forced)[k], 2, 1)
            best[k] = min(best[k], t.avg_us)
            if k == 0:
                sent = t.wire_bytes or 0.0
    if rt.rank == 0:
        try:
            from bitcoll.plan import Call, choose

            algo = choose("packed", comm.cost_model, comm.plan_group, Call(count=n))
        except ImportError:  # a tree from before the planner (bench/gate.py --against)
            algo = "?"
        print(json.dumps({"figure": f"majority_64M_p{rt.size}_vs_wire", "ours": best[0],
                          "bytes": sent, "algorithm": algo}), flush=True)
        print(json.dumps({"figure": f"majority_64M_p{rt.size}_default_vs_direct",
                          "ours": best[0], "ref": best[1], "ratio": best[0] / best[1],
                          "algorithm": algo}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("suite", choices=("loopback", "mpi", "wire"))
    args = p.parse_args(argv)
    rt = osu.BitcollRuntime(backend="mpi" if args.suite == "mpi" else "auto", timeout=300.0)
    try:
        {"loopback": loopback, "mpi": mpi, "wire": wire}[args.suite](rt)
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
