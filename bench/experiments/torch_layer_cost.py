"""Where the torch.distributed layer's time goes: ``dist.all_reduce`` of a float32 tensor on
the "bitcoll" backend, timed around the call (outer) and around the Communicator's own
``allreduce`` inside it (inner), then the Communicator called directly on a numpy view of
the same tensor (direct), in blocks alternating torch / direct; rank 0 prints the medians
(microseconds per call, the first block of each left out)::

    python -m launch -n 2 bench/experiments/torch_layer_cost.py 8,65536,1048576,8388608

outer - inner: the torch layer outside the collective (torch's wrappers, the backend's
checks, staging and Work); inner - direct: what the collective itself costs more when
called from inside the torch layer.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import bitcoll.torch  # noqa: F401  (registers the backend)
from bitcoll.torch import communicator_of


def main(argv: list[str]) -> int:
    sizes = [int(s) for s in (argv[0] if argv else "8,65536,1048576").split(",")]
    blocks, per_block = 7, 100
    dist.init_process_group("bitcoll")
    comm = communicator_of()
    plain = comm.allreduce
    inner: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - t0)

    def block(fn: Callable[[], object], into: list[float]) -> None:
        dist.barrier()
        for _ in range(per_block):
            t0 = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t0)

    try:
        if dist.get_rank() == 0:
            print(f"# {dist.get_world_size()} ranks, torch {torch.__version__}; median us per "
                  "call over blocks 2-7 of 100 calls")
            print("# bytes        outer      inner     direct   outer-inner  inner-direct")
        for nbytes in sizes:
            t = torch.zeros(max(1, nbytes // 4))
            a = t.numpy()
            outer: list[float] = []
            direct: list[float] = []
            inner.clear()
            for _ in range(blocks):
                comm.allreduce = timed  # type: ignore[method-assign]
                block(functools.partial(dist.all_reduce, t), outer)
                comm.allreduce = plain  # type: ignore[method-assign]
                block(functools.partial(plain, a, out=a), direct)
            o, i, d = (float(np.median(v[per_block:])) * 1e6 for v in (outer, inner, direct))
            if dist.get_rank() == 0:
                print(f"{nbytes:<10d} {o:10.0f} {i:10.0f} {d:10.0f} {o - i:12.0f} {i - d:13.0f}",
                      flush=True)
    finally:
        comm.allreduce = plain  # type: ignore[method-assign]
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
