"""The argument check of collectives over MPI: every rank called the same collective, as the
same number in its sequence, with the same arguments.

MPI's own collectives carry no frame headers, and ranks whose arguments differ may choose
different algorithms (lengths on both sides of an automatic threshold, a forced algorithm,
another collective altogether): without a check they would wait for each other until the
deadline instead of failing at once. So before (or as) every collective over MPI, one
fixed-size MPI all-gather exchanges every rank's record (sequence number, signature and an
optional payload, :meth:`~bitcoll.transport.base.NativeCollectives.exchange_records`); it
cannot itself mismatch. When the records disagree, every rank sees it; one more fixed-size
collective (the extremes of the sequence number, the collective's name and each field) finds
what differs, and every rank raises the same :class:`~bitcoll.errors.ProtocolError` naming
the collective, its number and the differing fields.

Errors that every rank detects from the same exchanged data are registered in
:data:`AGREED`: each rank raises its own, so no abort notice is sent.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from .errors import ProtocolError
from .transport.base import NativeCollectives

__all__ = ["AGREED", "FIELD_NAMES", "check", "digest_of", "mismatch"]

_PACKED_VALUES = ("op", "vote source", "levels", "tie rule", "element type", "element count",
                  "algorithm", "all-reduce")
_PACKED_STREAMS = ("op", "levels", "tie rule", "input", "element count", "algorithm",
                   "all-reduce")

#: What the fields of each collective's signature are, for mismatch messages.
FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "allreduce": ("op", "element type", "element count", "algorithm"),
    "reduce_scatter": ("op", "element type", "element count", "algorithm"),
    "allgather": ("element type", "element count", "algorithm"),
    "broadcast": ("element type", "element count", "algorithm", "root"),
    "alltoall": ("element type", "element count", "algorithm"),
    "barrier": ("algorithm",),
    **{name: _PACKED_VALUES for name in ("sign_allreduce", "sign_reduce_scatter",
                                         "quantized_allreduce", "quantized_reduce_scatter")},
    **{name: _PACKED_STREAMS for name in ("packed_sign_allreduce", "packed_sign_reduce_scatter",
                                          "packed_quantized_allreduce",
                                          "packed_quantized_reduce_scatter")},
}

#: Most fields compared one by one (the lanes of the second collective).
MAX_FIELDS = 14

#: Errors every rank detects from the same exchanged data (so every rank raises its own);
#: the communicator is then unusable on every rank without an abort notice.
AGREED: weakref.WeakSet[BaseException] = weakref.WeakSet()


def digest_of(field: object) -> int:
    """A signature field as one int64 lane, the same in every process: an integer itself
    (when it fits), anything else a CRC-32 of its text."""
    if type(field) is int and -(1 << 62) < field < 1 << 62:
        return field
    return _text_digest(field if type(field) is str else repr(field))


@functools.lru_cache(maxsize=256)
def _text_digest(text: str) -> int:
    return zlib.crc32(text.encode())


def check(nt: NativeCollectives, rank: int, seq: int, sig: int, payload: memoryview | None,
          deadline: float, name: str, fields: tuple[object, ...]) -> npt.NDArray[Any]:
    """The check of collective ``name`` number ``seq`` (signature ``sig``, arguments
    ``fields``) on this ``rank``, carrying ``payload`` (or None). Returns the records'
    payloads (row r: rank r's), valid until the next collective; raises the agreed
    ProtocolError (:func:`mismatch`) on every rank when the records disagree."""
    agree, payloads = nt.exchange_records(seq, sig, payload, deadline)
    if not agree:
        mismatch(nt, rank, seq, deadline, name, fields)
    return payloads


def describe(name: str, seq: int, fields: tuple[object, ...], hi: npt.NDArray[np.int64],
             lo: npt.NDArray[np.int64]) -> str:
    """The message of a mismatch, from the extremes over the ranks of the lanes ``(seq,
    digest of name, digest of each field)``."""
    names = FIELD_NAMES.get(name, ())

    def label(i: int) -> str:
        return names[i] if i < len(names) else f"argument {i + 1}"

    if (hi == lo).all():
        what = f"different arguments (this rank: {fields})"
    elif hi[0] != lo[0] or hi[1] != lo[1]:
        what = f"different collectives or a different order of them (this rank: {name} #{seq})"
    else:
        differ = [label(i) for i in range(len(fields[:MAX_FIELDS])) if hi[2 + i] != lo[2 + i]]
        mine = ", ".join(f"{label(i)} {fields[i]}" for i in range(len(fields)))
        what = f"different {' and '.join(differ)} (this rank: {mine})"
    return f"{name} #{seq}: the ranks called it with {what}"


def mismatch(nt: NativeCollectives, rank: int, seq: int, deadline: float, name: str,
             fields: tuple[object, ...]) -> NoReturn:
    """After records that disagree (every rank sees that): find out what differs with one
    more fixed-size collective (``native_extremes`` of the sequence number, the name and
    each field) and raise the same ProtocolError on every rank, naming it."""
    lanes = (seq, digest_of(name), *(digest_of(f) for f in fields[:MAX_FIELDS]))
    hi, lo = nt.native_extremes(lanes, deadline)
    exc = ProtocolError(describe(name, seq, fields, hi, lo), rank=rank, sequence=seq)
    AGREED.add(exc)
    raise exc
