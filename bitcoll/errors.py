"""The bitcoll exception hierarchy.

Every error bitcoll raises derives from :class:`BitcollError`::

    BitcollError
    ├── UsageError (ValueError)          bad arguments: dtype, shape, op, out, levels, NaN votes
    └── CommError                         the collective could not complete
        ├── CommTimeoutError (TimeoutError)   a deadline passed
        ├── PeerLostError (ConnectionError)   a peer disappeared or aborted the communicator
        └── ProtocolError                     a frame did not match what this rank expected
                                              (mismatched collectives, lengths, dtypes, versions)

On a communicator of more than one rank, a ``UsageError`` in a collective's arguments aborts
the communicator like any ``CommError`` does: the peers have entered (or will enter) the same
collective, so the rank that saw the problem tells them (every rank fails fast instead of
waiting for its deadline) and every later call raises ``CommError``. A one-rank communicator
stays usable after a ``UsageError``.
"""

from __future__ import annotations

from typing import Any

from .arguments import mismatch_text, slot_fields

__all__ = ["BitcollError", "UsageError", "CommError", "CommTimeoutError", "PeerLostError",
           "ProtocolError"]


class BitcollError(Exception):
    """Base class of every error raised by bitcoll."""


class UsageError(BitcollError, ValueError):
    """An argument is invalid (dtype, shape, op, ``out`` buffer, levels, NaN in a vote input).

    Raised before any byte is sent when the problem is visible locally; raised on every rank
    when only the comparison with other ranks reveals it (see :class:`ProtocolError`). The one
    exception is a NaN in a vote input, found while packing, which overlaps the sends: that
    rank raises UsageError, every peer PeerLostError, and no rank returns a result.

    Attributes, None where not set: ``argument`` (the name of the argument that is wrong, as
    the call spells it: ``"grads"``, ``"levels"``, ``"tie"``, ...; for a setting read from the
    environment, the variable: ``"BITCOLL_SHM"``) and ``index`` (the position of the wrong
    item within it, e.g. the parameter whose gradient is bad).
    """

    def __init__(self, *args: object, argument: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(*args)
        self.argument = argument
        self.index = index


class CommError(BitcollError):
    """A collective could not complete. The communicator is aborted afterwards.

    Attributes, None where unknown: ``rank`` (the rank that raised it), ``peer`` (the rank
    it was talking to), ``collective`` (the name of the collective call, e.g. "allreduce"),
    ``sequence`` (the collective's number on its communicator) and, for timeouts, ``silent``
    (the rank the silence started from: ``peer`` itself, or the rank at the end of a chain of
    ranks waiting for each other). The transport sets what it knows where it detects the
    error; the communicator fills in ``rank``, ``collective`` and ``sequence`` of every error
    leaving a collective (:meth:`add_context`), so they are set for every collective's error.
    """

    def __init__(self, *args: object, rank: int | None = None, peer: int | None = None,
                 sequence: int | None = None, silent: int | None = None,
                 collective: str | None = None) -> None:
        super().__init__(*args)
        self.rank = rank
        self.peer = peer
        self.sequence = sequence
        self.silent = silent
        self.collective = collective

    def add_context(self, *, rank: int, collective: str, sequence: int) -> None:
        """Set ``rank``, ``collective`` and ``sequence`` where they are still unknown."""
        if self.rank is None:
            self.rank = rank
        if self.collective is None:
            self.collective = collective
        if self.sequence is None:
            self.sequence = sequence


class CommTimeoutError(CommError, TimeoutError):
    """A blocking operation did not complete before its deadline."""


class PeerLostError(CommError, ConnectionError):
    """A peer closed its connection, died, or aborted the communicator."""


class ProtocolError(CommError):
    """A received frame did not match this rank's expectation.

    This is how mismatched collectives are reported: a rank that called ``allreduce`` with a
    different length, dtype, op or algorithm than its peers, or another collective altogether.

    ``fields``: for such a mismatch, what differs: the names of the arguments (e.g.
    ``("element count",)``, :data:`bitcoll.arguments.FIELD_NAMES`), ``("collective",)`` when
    the ranks called different collectives (or a different number of them), ``()`` when it
    is not known which arguments; None for any other protocol error. With ``sequence`` (the
    collective's number) and ``collective`` it is the whole finding, and the message has one
    form on every backend (:func:`bitcoll.arguments.mismatch_text`): ``"allreduce #3: the
    ranks called it with different element count (...)"``. Over MPI every rank finds it;
    over TCP and shared memory the ranks that received a frame of the other call do, and
    their peers see a PeerLostError quoting it.

    ``slots`` (transports): the differing slots of the frames' argument maps
    (:func:`bitcoll.arguments.differing_slots`), turned into ``fields`` once the collective
    is known (:meth:`add_context`).
    """

    def __init__(self, *args: object, fields: tuple[str, ...] | None = None,
                 slots: tuple[int, ...] | None = None, **context: Any) -> None:
        super().__init__(*args, **context)
        self.fields = fields
        self.slots = slots
        if slots is not None and fields is None and self.collective is not None:
            self.fields = slot_fields(self.collective, slots)

    def add_context(self, *, rank: int, collective: str, sequence: int) -> None:
        super().add_context(rank=rank, collective=collective, sequence=sequence)
        if self.slots is not None and self.fields is None:
            self.fields = slot_fields(self.collective, self.slots)

    def __str__(self) -> str:
        if self.slots is not None and self.fields is not None and self.collective is not None \
                and self.sequence is not None:
            return mismatch_text(self.collective, self.sequence, self.fields,
                                 f" (rank {self.peer} and rank {self.rank})")
        return super().__str__()
