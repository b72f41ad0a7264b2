"""A training-stack job: bitcoll beside torch.distributed, as a user script would do it.

    python stack_job.py MODE

MODE: ``bitcoll`` (bitcoll only), ``gloo-first`` (init_process_group("gloo") then
bitcoll.init()), ``bitcoll-first`` (the other order), ``store`` (bitcoll.init(store=...) on
torch.distributed's own store). Rank and size for torch come from the torchrun contract, or
from MPICH's PMI_RANK/PMI_SIZE under mpiexec. Prints ``rank R/P backend=B ok`` when every
check passed; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import bitcoll


def _torch_env() -> None:
    """Under mpiexec, give torch.distributed the torchrun contract it reads."""
    if "RANK" not in os.environ and "PMI_RANK" in os.environ:
        os.environ["RANK"] = os.environ["PMI_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["PMI_SIZE"]


def _gloo() -> None:
    import torch.distributed as dist

    _torch_env()
    dist.init_process_group("gloo")


def _check_gloo(rank: int, size: int) -> None:
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [size * (size + 1) / 2] * 3, t


def torch_backend() -> None:
    """``init_process_group("bitcoll")``, then all_reduce (value checked), broadcast from the
    last rank (value checked) and barrier."""
    import datetime

    import torch
    import torch.distributed as dist

    import bitcoll.torch as bt

    timeout = datetime.timedelta(seconds=60)
    if "PMI_RANK" in os.environ and "RANK" not in os.environ:  # mpiexec: docs/torch-backend.md
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        dist.init_process_group(
            "bitcoll", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']}", rank=world.rank, world_size=world.size,
            timeout=timeout)
    else:
        dist.init_process_group("bitcoll", timeout=timeout)
    assert dist.get_backend() == "bitcoll", dist.get_backend()
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [size * (size + 1) / 2] * 5, t
    b = torch.arange(4, dtype=torch.int64) * (rank + 1)
    dist.broadcast(b, src=size - 1)
    assert b.tolist() == [k * size for k in range(4)], b
    dist.barrier()
    backend = bt.communicator_of().backend
    dist.destroy_process_group()
    print(f"rank {rank}/{size} backend={backend} ok", flush=True)


def main(mode: str) -> None:
    if mode == "torch-backend":
        torch_backend()
        return
    if mode == "gloo-first":
        _gloo()
    if mode == "store":
        import datetime

        import torch.distributed as dist

        _torch_env()
        r, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torch's stubs do not re-export TCPStore from torch.distributed, its public home
        store = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), p, is_master=r == 0,
            timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=r, world_size=p)
        comm = bitcoll.init(store=store, timeout=60)
    else:
        comm = bitcoll.init(timeout=60)
    if mode == "bitcoll-first":
        _gloo()
    rank, size = comm.rank, comm.size
    x = np.full(7, rank + 1, np.float32)
    y = comm.allreduce(x)
    assert (y == size * (size + 1) / 2).all(), y
    votes = comm.sign_allreduce(np.where(np.arange(9) % 2, -1.0, 1.0).astype(np.float32))
    assert votes.tolist() == [1, -1] * 4 + [1], votes
    sub = comm.split(rank % 2)
    assert sub is not None
    members = list(range(rank % 2, size, 2))
    z = sub.allreduce(np.full(3, rank, np.int64))
    assert (z == sum(members)).all(), (z, members)
    sub.close()
    if mode != "bitcoll":
        _check_gloo(rank, size)
    comm.barrier()
    comm.close()
    if mode != "bitcoll":
        import torch.distributed as dist

        dist.destroy_process_group()
    print(f"rank {rank}/{size} backend={comm.backend} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bitcoll")
