"""Direct all-to-all: block ``j`` of rank ``r``'s input goes to rank ``j`` and lands as block
``r`` of its output; all ``p - 1`` sends and receives are in flight at once (pairwise order
``r + k`` / ``r - k`` so that no rank is everyone's first target)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .context import OpContext

__all__ = ["alltoall_direct"]


def alltoall_direct(ctx: OpContext, send: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
    """``send`` and ``out`` have ``p * m`` elements; out block j = rank j's block r."""
    p, r = ctx.size, ctx.rank
    m = send.size // p
    np.copyto(out[r * m:(r + 1) * m], send[r * m:(r + 1) * m])
    reqs = []
    for k in range(1, p):
        src = (r - k) % p
        reqs.append(ctx.irecv(src, out[src * m:(src + 1) * m]))
    for k in range(1, p):
        dst = (r + k) % p
        reqs.append(ctx.isend(dst, send[dst * m:(dst + 1) * m]))
    ctx.wait(*reqs)
