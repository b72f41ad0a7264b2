"""lioncub.torch_hooks for FSDP2: Lion Cub's vote as FSDP's custom reduce-scatter.

FSDP2 (``fully_shard`` on every Linear and on the root, over gloo) with
:class:`LionCubFSDPState` installed and :class:`LionCubStep` over the sharded parameters
must give, after every step, bit for bit the parameters and momenta of
``lioncub.torch.DistributedLion`` on an unsharded copy of the model with the same local
gradients: several variants, schedules and levels, 2 and 3 ranks, parameters whose first
dimension does not divide by the world size (padded chunks, a rank with an empty shard).
Differences are collected and asserted after the last collective.
"""

from __future__ import annotations

import copy
import datetime
import traceback
from typing import Any

import numpy as np
import pytest
import torch
from multiproc import run_world

import lioncub.torch as lt
from bitcoll.errors import UsageError
from lioncub.torch_hooks import LionCubFSDPState, LionCubStep

STEPS = 3

#: (variant, options) per world size.
CASES: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [("lioncub-l1", {"bucket_size": 64, "momentum_sync": "exp:1"}),
        ("lioncub-mavo", {"tie": "negative"})],
    3: [("lioncub-l1", {"levels": 3, "bucket_size": 128}), ("global", {})],
}


def _model(seed: int) -> torch.nn.Module:
    """Weights 9x7, 5x9, 1x5 and biases 9, 5, 1: first dimensions that 2 and 3 do not all
    divide, and a 1-row weight (empty shards on every rank but one)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(12, 7, generator=gen)
    y = torch.randn(12, 1, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def check_fsdp(comm: Any, problems: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    r = comm.rank
    world = dist.group.WORLD
    assert world is not None
    mesh = DeviceMesh.from_group(world, "cpu")
    for variant, options in CASES[comm.size]:
        label = f"{variant} {options}"
        plain = _model(seed=7)
        sharded = copy.deepcopy(plain)
        for layer in sharded.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        opt = LionCubStep(sharded.named_parameters(), lr=0.01, weight_decay=0.5)
        state = LionCubFSDPState(opt, comm, variant, **options)
        if state.install(sharded) != 4:
            problems.append(f"{label}: install did not find the 4 FSDP modules")
        ref = lt.DistributedLion(plain.named_parameters(), comm, variant, lr=0.01,
                                 weight_decay=0.5, **options)
        for t in range(STEPS):
            if t == 2:  # a schedule step changes the learning rate of both
                opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.003
            opt.zero_grad(set_to_none=True)
            _loss(sharded, r, t).backward()  # type: ignore[no-untyped-call]
            opt.step()
            plain.zero_grad(set_to_none=True)
            _loss(plain, r, t).backward()  # type: ignore[no-untyped-call]
            ref.step()
            for (name, a), b in zip(sharded.named_parameters(), plain.parameters(),
                                    strict=True):
                full = a.full_tensor()  # type: ignore[attr-defined]  # a DTensor
                if not torch.equal(full, b):
                    problems.append(f"{label}: {name} differs at step {t}: "
                                    f"{(full - b).abs().max().item()}")
            for i, (m1, m2) in enumerate(zip(state.core.momenta, ref.core.momenta,
                                             strict=True)):
                if not np.array_equal(m1, m2):
                    problems.append(f"{label}: momentum {i} differs at step {t}")
            if any(torch.equal(a.full_tensor(), b)  # type: ignore[attr-defined]
                   for a, b in zip(sharded.parameters(), _model(seed=7).parameters(),
                                   strict=True)):
                problems.append(f"{label}: a parameter did not change")
        try:
            state.check_replicas()
            problems.append(f"{label}: check_replicas under FSDP did not refuse")
        except UsageError:
            pass
        state.close()


def target(comm: Any, store: str) -> list[str]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=comm.rank,
                            world_size=comm.size, timeout=datetime.timedelta(seconds=60))
    problems: list[str] = []
    try:
        check_fsdp(comm, problems)
    except Exception:  # recorded; a failed collective fails the later checks too
        problems.append(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    return problems


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
def test_fsdp_vote_bitwise_like_distributed_lion(size: int, tmp_path: Any) -> None:
    results = run_world(size, target, str(tmp_path / "store"), timeout=240, comm_timeout=60)
    failures = {r: probs for r, probs in enumerate(results) if probs}
    assert not failures, "\n".join(f"rank {r}: {p}" for r, p in failures.items())
