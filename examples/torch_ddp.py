"""torch DistributedDataParallel with Lion Cub doing the communication.

Plain DDP averages the gradients in ``backward()``, so every rank would vote alike and Lion
Cub would become Global Lion plus a float32 all-reduce. With
``lioncub.torch.no_allreduce_hook`` each rank keeps its own gradient and the optimizer sends
a few bits per parameter instead. torch.distributed and bitcoll meet side by side: gloo on
``MASTER_PORT``, bitcoll's own store beside it.

    python -m launch -n 2 examples/torch_ddp.py
    torchrun --nproc-per-node 2 examples/torch_ddp.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bitcoll
import lioncub.torch


def main() -> None:
    dist.init_process_group("gloo")                   # MASTER_ADDR:MASTER_PORT
    comm = bitcoll.init()                             # bitcoll's own store beside it
    torch.manual_seed(comm.rank)                      # different weights: rank 0's are broadcast
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model)                                  # copies rank 0's weights
    ddp.register_comm_hook(state=None, hook=lioncub.torch.no_allreduce_hook)
    opt = lioncub.torch.DistributedLion(model.named_parameters(), comm, lr=1e-3)
    losses = []
    for _ in range(60):
        x = torch.randn(32, 16)                       # this rank's own batch
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # (unannotated in torch)
        opt.step()                                    # local gradients -> votes -> one update
        losses.append(loss.item())
    opt.check_replicas()                              # UsageError on every rank if they differ
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first, (first, last)
    print(f"rank {comm.rank}: loss {first:.3f} -> {last:.3f}, replicas identical")
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
