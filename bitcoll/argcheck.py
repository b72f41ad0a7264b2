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
the collective, its number and the differing fields (its ``fields``, ``collective`` and
``sequence``; the message has the form of every backend's,
:func:`bitcoll.arguments.mismatch_text`).

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

from .arguments import FIELD_NAMES, field_names, mismatch_text
from .errors import ProtocolError
from .transport.base import NativeCollectives

__all__ = ["AGREED", "FIELD_NAMES", "check", "digest_of", "mismatch"]

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
             lo: npt.NDArray[np.int64]) -> tuple[str, tuple[str, ...]]:
    """The message of a mismatch and what differs (:attr:`ProtocolError.fields`), from the
    extremes over the ranks of the lanes ``(seq, digest of name, digest of each field)``."""
    labels = field_names(name, len(fields))
    if (hi == lo).all():
        differ: tuple[str, ...] = ()
        detail = f" (this rank: {fields})"
    elif hi[0] != lo[0] or hi[1] != lo[1]:
        differ = ("collective",)
        detail = f" (this rank: {name} #{seq})"
    else:
        differ = tuple(labels[i] for i in range(len(fields[:MAX_FIELDS]))
                       if hi[2 + i] != lo[2 + i])
        mine = ", ".join(f"{labels[i]} {fields[i]}" for i in range(len(fields)))
        detail = f" (this rank: {mine})"
    return mismatch_text(name, seq, differ, detail), differ


def mismatch(nt: NativeCollectives, rank: int, seq: int, deadline: float, name: str,
             fields: tuple[object, ...]) -> NoReturn:
    """After records that disagree (every rank sees that): find out what differs with one
    more fixed-size collective (``native_extremes`` of the sequence number, the name and
    each field) and raise the same ProtocolError on every rank, naming it."""
    lanes = (seq, digest_of(name), *(digest_of(f) for f in fields[:MAX_FIELDS]))
    hi, lo = nt.native_extremes(lanes, deadline)
    text, differ = describe(name, seq, fields, hi, lo)
    exc = ProtocolError(text, rank=rank, sequence=seq, collective=name, fields=differ)
    AGREED.add(exc)
    raise exc
