"""A collective call's arguments as the ranks compare them: its signature, its argument map
and the names of its fields.

Every collective call has a name and a tuple of *fields* (the arguments that must agree on
every rank: op, element type, element count, algorithm, ...; :data:`FIELD_NAMES`). Its
:func:`call_signature` is one integer that the ranks compare:

* bits 0-31: a CRC-32 of the name and every field (the *signature*: any difference in any
  field changes it, up to CRC-32 collisions);
* bits 32-59: the *argument map*, :data:`MAP_SLOTS` digests of :data:`MAP_BITS` bits, slot 0
  of the name and slot ``i`` of field ``i - 1``.

The TCP, shared-memory and MPI transports carry the signature and the argument map in every
frame header (:class:`bitcoll.transport.wire.FrameHeader`); over MPI the whole value travels in
the argument check's record (:mod:`bitcoll.argcheck`). A rank that receives a frame whose
signature differs from its own learns from the two argument maps which fields differ
(:func:`differing_slots`): a differing slot is a certain difference, and a difference hides
from its slot with probability ``2**-MAP_BITS`` (then the error says the arguments differ
without naming them). The signature alone decides whether the calls match.

No imports from the rest of bitcoll: the errors (:mod:`bitcoll.errors`) name fields with it.
"""

from __future__ import annotations

import functools
import zlib
from typing import Final

__all__ = ["FIELD_NAMES", "MAP_BITS", "MAP_SLOTS", "argument_map", "call_signature",
           "differing_slots", "field_names", "mismatch_text", "slot_fields", "split"]

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

#: Bits of one slot's digest in the argument map.
MAP_BITS: Final = 4
#: Slots of the argument map: the name and the first ``MAP_SLOTS - 1`` fields.
MAP_SLOTS: Final = 7
_SLOT_MASK: Final = (1 << MAP_BITS) - 1
_SIG_MASK: Final = 0xFFFFFFFF


def _text(value: object) -> bytes:
    # The type is part of the text: 1, 1.0 and True are equal with different reprs anyway.
    return repr(value).encode()


def argument_map(name: str, fields: tuple[object, ...]) -> int:
    """The argument map of call ``name`` with ``fields`` (module docstring): at most
    ``MAP_SLOTS * MAP_BITS`` bits."""
    m = 0
    for i, value in enumerate((name, *fields[:MAP_SLOTS - 1])):
        m |= (zlib.crc32(_text(value)) & _SLOT_MASK) << (MAP_BITS * i)
    return m


def call_signature(name: str, fields: tuple[object, ...]) -> int:
    """The signature (bits 0-31) and argument map (bits 32 and up) of call ``name`` with
    ``fields``, as one non-negative integer below ``2**60``. The same in every process."""
    try:
        return _cached(name, fields, tuple(map(type, fields)))
    except TypeError:  # an unhashable field
        return _compute(name, fields)


@functools.lru_cache(maxsize=1024)
def _cached(name: str, fields: tuple[object, ...], types: tuple[type, ...]) -> int:
    # ``types`` keys the cache: 1, 1.0 and True are equal keys with different reprs.
    return _compute(name, fields)


def _compute(name: str, fields: tuple[object, ...]) -> int:
    return zlib.crc32(_text((name, *fields))) | argument_map(name, fields) << 32


def split(value: int) -> tuple[int, int]:
    """``(signature, argument map)`` of a :func:`call_signature` value."""
    return value & _SIG_MASK, value >> 32


def differing_slots(a: int, b: int) -> tuple[int, ...]:
    """The slots (0: the name, ``i``: field ``i - 1``) whose digests differ between argument
    maps ``a`` and ``b``, in order."""
    diff = a ^ b
    return tuple(i for i in range(MAP_SLOTS) if diff >> (MAP_BITS * i) & _SLOT_MASK)


def field_names(name: str | None, count: int | None = None) -> tuple[str, ...]:
    """The names of the fields of collective ``name`` (``argument i`` where unknown, for
    ``count`` fields when given)."""
    known = FIELD_NAMES.get(name or "", ())
    n = len(known) if count is None else count
    return tuple(known[i] if i < len(known) else f"argument {i + 1}" for i in range(n))


def mismatch_text(collective: str, sequence: int, fields: tuple[str, ...],
                  detail: str = "") -> str:
    """The message of a mismatch, the same on every backend: ``"<collective> #<sequence>: the
    ranks called it with different <fields>"`` (``fields`` joined by "and"; "arguments"
    when empty), or ``"... called different collectives or a different order of them"``
    when ``fields`` is ``("collective",)``; then ``detail`` (e.g. this rank's arguments)."""
    if fields == ("collective",):
        what = "called different collectives or a different order of them"
    else:
        what = f"called it with different {' and '.join(fields) if fields else 'arguments'}"
    return f"{collective} #{sequence}: the ranks {what}{detail}"


def slot_fields(collective: str | None, slots: tuple[int, ...]) -> tuple[str, ...]:
    """What differs, from the differing slots of two argument maps: ``("collective",)`` when
    the name's slot differs, else the names of the differing fields (empty: unknown)."""
    if 0 in slots:
        return ("collective",)
    if not slots:
        return ()
    names = field_names(collective, max(slots))
    return tuple(names[i - 1] for i in slots)
