"""What the fork server of the multi-process tests (:func:`tcp_world.forkserver`) imports
before it forks any rank: numpy, bitcoll, lioncub and the test helpers, the numba kernels
the collective sweeps call, loaded from numba's disk cache (:func:`sweeps.warm_kernels`), and
torch where it is installed.

A forked rank starts with all of it in memory. Without this, every rank of every world loads
numba and its kernels itself: about 1.5 s of CPU per rank, on two cores shared by all ranks.
The warm-up runs thread worlds in the server and joins them before the first fork; the kernels
it calls are serial (numba's thread pool, which must not be forked once started, stays
unused: ranks run with ``NUMBA_NUM_THREADS=1``). A warm-up that fails is left to the ranks,
which then report the failure with their own tracebacks.
"""

from __future__ import annotations

import contextlib

import numpy  # noqa: F401
import tcp_world  # noqa: F401
from multiproc import tcp_env  # noqa: F401
from sweeps import warm_kernels

import bitcoll.transport.tcp  # noqa: F401
import lioncub  # noqa: F401

with contextlib.suppress(Exception):
    warm_kernels(timeout=120.0)

# torch where it is installed (the ranks of the torch front ends', hooks' and "bitcoll"
# backend's tests would each import it: over 1 s of CPU per rank), with the part
# that torch.optim loads at an optimizer's first use (torch._dynamo, about 1 s more). Imports
# only: torch starts its thread pools at a first operation, which the server never makes. A
# failed import (torch not installed, or broken) is left to the ranks, as the warm-up is.
with contextlib.suppress(Exception):
    import torch._dynamo
    import torch.distributed  # noqa: F401
