"""Ring all-gather: rank ``r``'s contribution is block ``r`` of the output; ``p - 1`` ring steps
move every block round the ring, segment by segment. Each rank sends ``(p - 1) / p`` of the
output plus one header per segment."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from .context import OpContext
from .ring import ring_pass, stream_passes

__all__ = ["allgather_ring"]


def allgather_ring(ctx: OpContext, out: npt.NDArray[Any], bounds: list[int]) -> None:
    """``out`` (1-D) holds this rank's block at ``bounds[r]:bounds[r+1]`` on entry and every
    rank's block on exit (one stream where the context can: see :func:`stream_passes`)."""
    if not stream_passes(ctx, out, bounds, None):
        ring_pass(ctx, out, bounds, b0=ctx.rank, steps=ctx.size - 1, reduce=None)
