"""Data-parallel logistic regression in plain numpy, over bitcoll.

Every rank holds its own shard of a synthetic data set and the same weights. Each step, the
ranks average their gradients with ``comm.allreduce(op="avg")`` (float32, identical bits on
every rank) and take the same gradient step, so the weights stay identical without ever being
sent. Then the same model is trained with Lion Cub's numpy core (``lioncub.DistributedLion``),
which sends a few bits per weight instead of 32.

Run it on 3 local ranks, under any launcher (or alone, as a one-rank world)::

    python -m launch -n 3 examples/numpy_logistic.py
    mpiexec -n 3 python examples/numpy_logistic.py
    torchrun --nproc-per-node 3 examples/numpy_logistic.py
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

import bitcoll
import lioncub

F32 = npt.NDArray[np.float32]
FEATURES = 20
PER_RANK = 512


def shard(rank: int) -> tuple[F32, F32]:
    """This rank's examples: labels from a fixed true weight vector (seed 0), features from
    the rank's own seed."""
    true_w = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)
    x = np.random.default_rng(100 + rank).standard_normal((PER_RANK, FEATURES), np.float32)
    y = (x @ true_w > 0).astype(np.float32)
    return x, y


def loss_and_grad(w: F32, x: F32, y: F32) -> tuple[float, F32]:
    """Mean logistic loss of this shard and its gradient with respect to ``w``."""
    z = x @ w
    p = 1.0 / (1.0 + np.exp(-z))
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    grad = (x.T @ (p - y) / len(y)).astype(np.float32)
    return loss, grad


def main() -> None:
    with bitcoll.init() as comm:
        x, y = shard(comm.rank)

        # 1. plain data parallelism: average the float32 gradients
        w = np.zeros(FEATURES, np.float32)
        first, _ = loss_and_grad(w, x, y)
        for _ in range(100):
            _, g = loss_and_grad(w, x, y)
            w -= 0.5 * comm.allreduce(g, op="avg")
        sgd_loss = comm.allreduce(np.array([loss_and_grad(w, x, y)[0]], np.float32), op="avg")[0]

        # 2. Lion Cub: each rank votes with its own gradient, a few bits per weight
        v = np.zeros(FEATURES, np.float32)
        opt = lioncub.DistributedLion([v], comm, variant="lioncub-l1", lr=0.02)
        for _ in range(100):
            _, g = loss_and_grad(v, x, y)
            opt.step([g])
        opt.check_replicas()  # the same weights on every rank, bit for bit
        lion_loss = comm.allreduce(np.array([loss_and_grad(v, x, y)[0]], np.float32), op="avg")[0]

        everywhere = comm.allgather(np.concatenate([w, v]))
        assert np.array_equal(everywhere.reshape(comm.size, -1),
                              np.tile(np.concatenate([w, v]), (comm.size, 1)))
        assert sgd_loss < 0.5 * first and lion_loss < 0.5 * first, (first, sgd_loss, lion_loss)
        if comm.rank == 0:
            ranks = f"{comm.size} rank" + ("s" if comm.size != 1 else "")
            print(f"{ranks}: loss {first:.3f} -> averaged gradients {sgd_loss:.3f}, "
                  f"lioncub-l1 {lion_loss:.3f}; weights identical on every rank")


if __name__ == "__main__":
    main()
