"""``Work``: the handle of a collective started with ``async_op=True``.

Collectives of one communicator run one at a time, in call order, on the communicator's
worker thread; the caller's thread is free to compute meanwhile (numba kernels and socket I/O
release the GIL).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Generic, TypeVar

from .errors import CommTimeoutError

__all__ = ["Work"]

T = TypeVar("T")


class Work(Generic[T]):
    """A collective in progress.

    ``wait(timeout=None)`` blocks until it finishes and returns its result (the output
    array), or raises the error the collective raised. A ``timeout`` (seconds) here only
    limits this wait: :class:`~bitcoll.errors.CommTimeoutError` is raised and the collective
    goes on under its own deadline.
    """

    def __init__(self, future: cf.Future[T], name: str) -> None:
        self._future = future
        self._name = name

    def wait(self, timeout: float | None = None) -> T:
        """Return the result once the collective completed; re-raise its error."""
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise CommTimeoutError(
                f"{self._name} did not complete within the {timeout} s wait") from None

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not (never blocks)."""
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The error of a completed collective, None if it succeeded or is still running."""
        if not self._future.done():
            return None
        return self._future.exception()

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<Work {self._name} {state}>"

    @staticmethod
    def done(result: Any, name: str) -> Work[Any]:
        """A Work that has already completed with ``result``."""
        fut: cf.Future[Any] = cf.Future()
        fut.set_result(result)
        return Work(fut, name)
