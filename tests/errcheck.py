"""``raises_usage`` and ``raises_comm``: ``pytest.raises`` that checks the error's attributes
(which argument is wrong and which item of it; which peer, collective, ...) instead of its
message text."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from bitcoll.errors import CommError, UsageError


@contextlib.contextmanager
def raises_usage(argument: str, index: int | None = None,
                 cls: type[UsageError] = UsageError, match: str | None = None
                 ) -> Iterator[pytest.ExceptionInfo[UsageError]]:
    """Expect ``cls`` (a UsageError) naming ``argument`` (``exc.argument``) and, when given,
    the item ``index`` of it (``exc.index``); ``match`` only where the message's content is
    what the test checks (as ``pytest.raises``)."""
    with pytest.raises(cls, match=match) as info:
        yield info
    exc = info.value
    assert exc.argument == argument, f"argument {exc.argument!r}, expected {argument!r}: {exc}"
    if index is not None:
        assert exc.index == index, f"index {exc.index!r}, expected {index!r}: {exc}"


@contextlib.contextmanager
def raises_comm(cls: type[CommError] = CommError, **attributes: object
                ) -> Iterator[pytest.ExceptionInfo[CommError]]:
    """Expect ``cls`` (a CommError) whose attributes (``peer``, ``rank``, ``collective``,
    ``sequence``, ``silent``; ``fields`` of a ProtocolError) have the given values."""
    with pytest.raises(cls) as info:
        yield info
    exc = info.value
    for name, want in attributes.items():
        got = getattr(exc, name)
        assert got == want, f"{name} {got!r}, expected {want!r}: {type(exc).__name__}: {exc}"
