"""``DistributedLion(stale=True)``: the update of step t is applied at step t + 1.

With gradients that do not depend on the parameters (seeded), the stale optimizer applies
exactly the plain optimizer's updates one step later: after step t its parameters are the
plain optimizer's after step t - 1, and after ``flush()`` the plain optimizer's after the last
step, bit for bit, for every variant, momentum schedule and world size."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads

import lioncub
from bitcoll.errors import UsageError

SHAPES: list[tuple[int, ...]] = [(12, 9), (9,), (0, 3), (41,), (7,)]
STEPS = 5
HYPER: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1}


def _params() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _grads(rank: int, t: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng([rank, t])
    gs: list[np.ndarray | None] = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    if rank == 1 and t % 2:
        gs[3] = None  # a missing gradient on one rank
    return gs


def _compare(comm: Any, variant: str, sync: str | None) -> list[str]:
    kw: dict[str, Any] = dict(HYPER, variant=variant, bucket_size=4 * 40, momentum_sync=sync)
    plain_params, stale_params = _params(), _params()
    plain = lioncub.DistributedLion(plain_params, comm, **kw)
    stale = lioncub.DistributedLion(stale_params, comm, stale=True, **kw)
    problems = []
    before = [p.copy() for p in plain_params]
    for t in range(STEPS):
        stale.step(_grads(comm.rank, t))
        # applied so far: the updates of steps 0 .. t-1, as the plain optimizer before step t
        if any(not np.array_equal(a, b) for a, b in zip(stale_params, before, strict=True)):
            problems.append(f"{variant}/{sync}: after step {t}")
        plain.step(_grads(comm.rank, t))
        before = [p.copy() for p in plain_params]
    with pytest.raises(UsageError, match="flush"):
        stale.state_dict()
    stale.flush()
    stale.flush()  # nothing in flight: a no-op
    if any(not np.array_equal(a, b) for a, b in zip(stale_params, plain_params, strict=True)):
        problems.append(f"{variant}/{sync}: after flush")
    if stale.step_count != plain.step_count:
        problems.append(f"{variant}/{sync}: {stale.step_count} steps, not {plain.step_count}")
    mine, theirs = stale.state_dict(), plain.state_dict()
    if any(not np.array_equal(a, b)
           for a, b in zip(mine["momentum"], theirs["momentum"], strict=True)):
        problems.append(f"{variant}/{sync}: momenta differ")
    stale.check_replicas()
    return problems


def _all_variants(comm: Any) -> list[str]:
    problems: list[str] = []
    for variant in lioncub.VARIANTS:
        problems += _compare(comm, variant, None)
    problems += _compare(comm, "lioncub-l1", "every:2")
    return problems


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_stale_applies_the_plain_updates_one_step_later(p: int) -> None:
    for problems in run_threads(p, _all_variants, timeout=120.0):
        assert problems == []


def test_stale_refuses_ready_and_bad_values() -> None:
    def body(comm: Any) -> None:
        params = _params()
        opt = lioncub.DistributedLion(params, comm, stale=True)
        with pytest.raises(UsageError, match="stale=True"):
            opt.ready(0, np.zeros(SHAPES[0], np.float32))
        with raises_usage("stale"):
            lioncub.DistributedLion(_params(), comm, stale=1)  # type: ignore[arg-type]

    run_threads(2, body)


def test_torch_front_end_passes_stale_through() -> None:
    """``lioncub.torch.DistributedLion(stale=True)``: the numpy core's stale mode (the update
    of step t applied at step t + 1, flush() applies the last); refused with the torch
    engine or with overlap."""
    torch = pytest.importorskip("torch")
    from lioncub.torch import DistributedLion as TorchLion

    def body(comm: Any) -> None:
        # not the global generator: the ranks are threads, and with one generator a rank
        # could draw the other's numbers (the construction's broadcast then moves them)
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(33, generator=gen))
        start = w.detach().clone()
        opt = TorchLion([w], comm, lr=0.1, stale=True)
        w.grad = torch.full((33,), float(comm.rank + 1))
        opt.step()
        assert torch.equal(w.detach(), start)  # nothing applied yet
        opt.flush()
        assert torch.equal(w.detach(), start - 0.1)  # every rank votes +1
        for bad in ({"overlap": True}, {"backend": "torch"}):
            with raises_usage("stale"):
                TorchLion([torch.nn.Parameter(torch.randn(3))], comm, stale=True, **bad)

    run_threads(2, body)
