"""Bucket layout: how parameter tensors are packed into flat buffers, one collective each.

Parameters are taken in the order given and appended to the current bucket until adding the
next one would exceed ``bucket_elems`` elements; a tensor is never split, so a tensor larger
than a bucket forms a bucket of its own (per-tensor quantization scales need the whole tensor).
Empty tensors take no place in any bucket (they have nothing to update).

The layout depends only on the parameters' sizes, their order and the bucket size, never on
gradients, so it is the same on every rank whose model is the same. :func:`fingerprint` digests
it so ranks can check that they agree before the first collective.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from bitcoll.errors import UsageError

__all__ = ["Slot", "Bucket", "make_buckets", "fingerprint"]


@dataclass(frozen=True)
class Slot:
    """Parameter ``index`` occupies elements ``[offset, offset + size)`` of its bucket."""

    index: int
    offset: int
    size: int

    @property
    def stop(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: ``slots`` in order, ``size`` elements in total."""

    index: int
    slots: tuple[Slot, ...]
    size: int


def make_buckets(sizes: Sequence[int], bucket_elems: int) -> list[Bucket]:
    """Pack tensors of the given element counts into buckets of at most ``bucket_elems``
    elements (a larger tensor gets a bucket of its own). Raises UsageError for
    ``bucket_elems < 1`` or a negative size."""
    if isinstance(bucket_elems, bool) or not isinstance(bucket_elems, int) or bucket_elems < 1:
        raise UsageError(f"bucket size must hold at least one element, got {bucket_elems!r}",
                         argument="bucket_size")
    buckets: list[Bucket] = []
    current: list[Slot] = []
    fill = 0

    def close() -> None:
        nonlocal current, fill
        if current:
            buckets.append(Bucket(len(buckets), tuple(current), fill))
        current, fill = [], 0

    for index, size in enumerate(sizes):
        if size < 0:
            raise UsageError(f"tensor {index} has a negative size {size}",
                             argument="sizes", index=index)
        if size == 0:
            continue
        if current and fill + size > bucket_elems:
            close()
        current.append(Slot(index, fill, size))
        fill += size
    close()
    return buckets


def fingerprint(shapes: Sequence[tuple[int, ...]], buckets: Sequence[Bucket],
                *extra: object) -> int:
    """A 31-bit digest of the shapes, the layout and ``extra`` (variant, levels, ...)."""
    desc = repr((tuple(shapes), [(b.size, [(s.index, s.offset) for s in b.slots])
                                 for b in buckets], extra))
    return zlib.crc32(desc.encode()) & 0x7FFFFFFF
