"""A small JAX training loop, data parallel over bitcoll.

JAX computes each rank's gradient; bitcoll takes the JAX CPU array as it is (through DLPack,
without a copy) and returns the average as a numpy array, which ``jnp.asarray`` hands back to
JAX. Every rank fits the same linear model to its own shard of noisy data, and the weights
stay identical on every rank.

    python -m launch -n 2 examples/jax_training.py
    mpiexec -n 2 python examples/jax_training.py

Needs ``jax`` (the project's ``examples`` extra: ``pip install -e .[examples]``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import bitcoll

FEATURES = 8


def loss_fn(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ w - y) ** 2)


def main() -> None:
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    with bitcoll.init() as comm:
        rng = np.random.default_rng(comm.rank)
        true_w = np.arange(1, FEATURES + 1, dtype=np.float32)
        x_np = rng.standard_normal((256, FEATURES)).astype(np.float32)
        x = jnp.asarray(x_np)
        y = jnp.asarray(x_np @ true_w + 0.01 * rng.standard_normal(256).astype(np.float32))
        w = jnp.zeros(FEATURES, jnp.float32)
        for _ in range(200):
            loss, g = grad_fn(w, x, y)
            g_avg = comm.allreduce(g, op="avg")  # a JAX array in, a numpy array out
            w = w - 0.1 * jnp.asarray(g_avg)
        w_np = np.asarray(w)
        rows = comm.allgather(w_np).reshape(comm.size, FEATURES)
        assert np.array_equal(rows, np.tile(w_np, (comm.size, 1))), "replicas differ"
        err = float(np.max(np.abs(w_np - true_w)))
        assert err < 0.05, err
        if comm.rank == 0:
            ranks = f"{comm.size} rank" + ("s" if comm.size != 1 else "")
            print(f"{ranks}: loss {float(loss):.5f}, max weight error {err:.4f}; "
                  "weights identical on every rank")


if __name__ == "__main__":
    main()
