"""A fault-tolerant Lion Cub training loop in numpy: a job that survives a killed rank.

Run::

    python -m launch -n 3 --max-restarts 1 examples/elastic_numpy.py --steps 60 --kill-at 20

Three ranks fit a linear model ``y = X w`` (least squares, 1025 weights) with
``lioncub-l1`` through :class:`lioncub.elastic.ElasticLion`. With ``--kill-at K`` the first
incarnation of rank 1 kills itself (SIGKILL) inside step K: the two survivors agree on a new
epoch and go on at once, the launcher starts rank 1 again, and the replacement joins at a
step boundary, receiving the weights, the averaged momenta and the counters from the
survivors (the loop goes on past ``--steps`` until it is in). Every rank prints one line at
the end; rank 0's carries the validation loss and a
checksum of the weights, the same on every rank (``finish`` checks the replicas).

The data of a step depends only on the step number and the epoch's rank and size, so a
rerun with the same seed and no fault gives the reference curve.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import zlib

import numpy as np

from bitcoll.elastic import ElasticGroup, JobFinished
from bitcoll.errors import CommError
from lioncub.distributed import DistributedLion
from lioncub.elastic import ElasticLion

N = 1025  # weights
BATCH = 64  # rows per rank and step


def truth(seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal(N).astype(np.float32)


def batch(seed: int, step: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``rank`` (of ``size``) at ``step``: each step draws ``BATCH * size`` rows
    and the ranks take equal shares."""
    rng = np.random.default_rng([seed, 1, step])
    x = rng.standard_normal((BATCH * size, N)).astype(np.float32)
    y = x @ truth(seed) + np.float32(0.1) * rng.standard_normal(BATCH * size).astype(np.float32)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[rows], y[rows]


def loss(w: np.ndarray, seed: int) -> float:
    # a fixed validation set of 256 rows
    x = np.concatenate([batch(seed, 1 << 30, r, 4)[0] for r in range(4)])
    y = np.concatenate([batch(seed, 1 << 30, r, 4)[1] for r in range(4)])
    return float(np.mean((x @ w - y) ** 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-at", type=int, default=-1,
                    help="the first incarnation of rank 1 dies in this step (-1: never)")
    ap.add_argument("--timeout", type=float, default=30.0, help="collective deadline (s)")
    ap.add_argument("--dead-after", type=float, default=0.5,
                    help="a member whose heartbeat is still this long is taken for gone (s)")
    a = ap.parse_args()
    try:
        group = ElasticGroup.from_env(timeout=a.timeout, dead_after=a.dead_after,
                                      join_check=0.05)
    except JobFinished:  # restarted after the others finished
        return
    w = np.zeros(N, np.float32)

    def make(comm, **kw):  # type: ignore[no-untyped-def]
        return DistributedLion([w], comm, variant="lioncub-l1", lr=0.02, **kw)

    opt = ElasticLion(group, [w], make)
    victim = os.environ.get("RANK") == "1" and os.environ.get("BITCOLL_RESTART_COUNT") == "0"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    start = time.monotonic()

    def agree(done: bool) -> bool:
        """True when every rank is done (a collective of our own: on a failure, recover)."""
        while True:
            flag = np.array([int(done)], np.int64)
            try:
                opt.group.comm.allreduce(flag, op="min", out=flag)
                return bool(flag[0])
            except CommError:
                opt.recover()

    # with a fault, go on past --steps until the replacement is in (at most 120 s)
    while not agree(opt.step_count >= a.steps and (
            a.kill_at < 0 or opt.epoch.size == world or time.monotonic() - start > 120)):
        e = opt.epoch
        x, y = batch(a.seed, opt.step_count, e.rank, e.size)
        grad = (2.0 / BATCH) * x.T @ (x @ w - y)
        if victim and opt.step_count == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step([grad.astype(np.float32)])
    opt.finish()
    e = opt.epoch
    print(f"rank {e.rank} of {e.size}: {opt.step_count} steps, epoch {e.number}, "
          f"lost {opt.lost_steps}, loss {loss(w, a.seed):.4f}, "
          f"crc {zlib.crc32(w.tobytes())}", flush=True)
    group.close()


if __name__ == "__main__":
    main()
