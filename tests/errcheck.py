"""``raises_usage``: ``pytest.raises(UsageError)`` that checks the error's attributes (which
argument is wrong, and which item of it) instead of its message text."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from bitcoll.errors import UsageError


@contextlib.contextmanager
def raises_usage(argument: str, index: int | None = None,
                 cls: type[UsageError] = UsageError) -> Iterator[pytest.ExceptionInfo[UsageError]]:
    """Expect ``cls`` (a UsageError) naming ``argument`` (``exc.argument``) and, when given,
    the item ``index`` of it (``exc.index``)."""
    with pytest.raises(cls) as info:
        yield info
    exc = info.value
    assert exc.argument == argument, f"argument {exc.argument!r}, expected {argument!r}: {exc}"
    if index is not None:
        assert exc.index == index, f"index {exc.index!r}, expected {index!r}: {exc}"
