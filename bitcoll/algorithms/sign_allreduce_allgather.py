"""The all-gather baseline (what Distributed Lion does): every rank gathers every rank's
packed contribution (ring all-gather of byte blocks) and aggregates locally. Each rank sends
``(p - 1) * n * w_in / 8`` bytes: it grows with ``p``. Kept as the benchmark baseline."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .. import kernels
from ..partition import block
from .context import OpContext
from .ring import ring_pass
from .votes import VoteCodec

__all__ = ["packed_allgather"]

Array = npt.NDArray[Any]


def packed_allgather(ctx: OpContext, codec: VoteCodec, x: Array, out: Array,
                     gather: bool, n: int | None = None) -> None:
    """Same contract as :func:`~bitcoll.algorithms.sign_allreduce_direct.packed_direct`."""
    p, r = ctx.size, ctx.rank
    n = x.size if n is None else n
    nb = kernels.packed_nbytes(n, codec.w_in)
    rows = np.empty((p, nb), np.uint8)
    codec.encode(x, 0, n, rows[r])
    ring_pass(ctx, rows.reshape(-1), [j * nb for j in range(p + 1)], b0=r, steps=p - 1,
              reduce=None)
    lo, hi = (0, n) if gather else block(n, p, r)
    start = lo - lo % 8  # aggregate from a byte boundary, then drop the leading elements
    sub = np.ascontiguousarray(rows[:, start * codec.w_in // 8:
                                    kernels.packed_nbytes(hi, codec.w_in)])
    m = hi - start
    res = np.empty(kernels.packed_nbytes(m, codec.w_out), np.uint8)
    codec.combine(sub, m, start, res)
    if lo > start:  # drop the leading elements: move the rest to bit 0
        res = kernels.extract_bits(res, (lo - start) * codec.w_out, (hi - lo) * codec.w_out)
    codec.decode(res, out, 0, hi - lo)
