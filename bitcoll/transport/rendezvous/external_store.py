"""Rendezvous through a store the job already has (torch.distributed's, torchrun's agent store).

:class:`ExternalStore` adapts any object with torch.distributed ``Store``'s methods
``set(key, value)``, ``get(key)``, ``add(key, delta)`` and ``wait(keys, timeout)`` (and, if
present, ``check(keys)``) to the interface the TCP transport uses for bitcoll's own store
(:class:`~bitcoll.transport.store.StoreClient`): deadlines as ``time.monotonic()`` values,
bitcoll's errors. Every key is prefixed, so bitcoll's keys never collide with the job's.

:func:`torchrun_store` connects to the store that torchrun's agent serves at
``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``). It imports
``torch.distributed``: only then, when the process was started by torch's own launcher, so the
rest of bitcoll stays importable and usable without torch.

Such a store is not authenticated (anyone who reaches it can read and write keys). bitcoll's
peer hellos still prove the job's secret (see :mod:`bitcoll.transport.auth`), so a stranger
who rewrites bitcoll's keys can make set-up fail but cannot join or sit between ranks.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from ...errors import CommError, CommTimeoutError, PeerLostError, UsageError

__all__ = ["ExternalStore", "torchrun_store", "check_store", "STORE_METHODS"]

#: The methods a store object passed to ``bitcoll.init(store=...)`` must have.
STORE_METHODS = ("set", "get", "add", "wait")


def check_store(store: object) -> None:
    """UsageError unless ``store`` has every method of :data:`STORE_METHODS`."""
    missing = [m for m in STORE_METHODS if not callable(getattr(store, m, None))]
    if missing:
        raise UsageError(f"store must be a torch.distributed Store or have its methods "
                         f"{', '.join(STORE_METHODS)}; {type(store).__name__} lacks "
                         f"{', '.join(missing)}", argument="store")


def _timedelta(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


class ExternalStore:
    """A duck-typed torch.distributed ``Store`` seen as bitcoll's rendezvous store.

    ``prefix`` is put in front of every key. ``host`` is the store's address if known (used to
    find the local address peers can reach; default: the store's ``host`` attribute, then
    ``MASTER_ADDR``). :meth:`close` releases nothing: the store belongs to the job.
    """

    def __init__(self, store: object, prefix: str = "", host: str | None = None) -> None:
        check_store(store)
        self._store: Any = store
        self.prefix = prefix
        self._host = host if host is not None else getattr(store, "host", None)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            text = str(exc)
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise CommTimeoutError(f"store {what}: {text}") from exc
            raise PeerLostError(f"store {what} failed: {type(exc).__name__}: {text}") from exc

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None:
        self._call(f"set({key!r})", self._store.set, self._key(key), bytes(value))

    def _wait(self, keys: list[str], deadline: float, what: str) -> None:
        try:
            self._store.wait([self._key(k) for k in keys], _timedelta(deadline))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if time.monotonic() >= deadline - 0.01 or "timeout" in str(exc).lower():
                raise CommTimeoutError(f"store {what}: keys {keys} were not set before the "
                                       f"deadline") from exc
            raise PeerLostError(f"store {what} failed: {type(exc).__name__}: {exc}") from exc

    def get(self, key: str, deadline: float | None = None) -> bytes:
        dl = time.monotonic() + 60.0 if deadline is None else deadline
        self._wait([key], dl, f"get({key!r})")
        return bytes(self._call(f"get({key!r})", self._store.get, self._key(key)))

    def _present(self, key: str) -> bool:
        check = getattr(self._store, "check", None)
        if callable(check):
            return bool(self._call("check", check, [self._key(key)]))
        try:
            self._store.wait([self._key(key)], datetime.timedelta(milliseconds=1))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return False
        return True

    def try_get(self, key: str, deadline: float | None = None) -> bytes | None:
        if not self._present(key):
            return None
        return bytes(self._call(f"get({key!r})", self._store.get, self._key(key)))

    def add(self, key: str, delta: int, deadline: float | None = None) -> int:
        return int(self._call(f"add({key!r})", self._store.add, self._key(key), int(delta)))

    def wait(self, keys: Iterable[str], deadline: float | None = None) -> None:
        klist = list(keys)
        self._wait(klist, time.monotonic() + 60.0 if deadline is None else deadline, "wait")

    def missing(self, keys: Iterable[str], deadline: float | None = None) -> list[str]:
        return [k for k in keys if not self._present(k)]

    def close(self) -> None:
        """Nothing to release (the store belongs to the job)."""

    @property
    def local_address(self) -> str:
        """The local IP address that routes to the store's host (loopback if unknown)."""
        return route_address(self._host or os.environ.get("MASTER_ADDR") or "127.0.0.1")


def route_address(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def torchrun_store(timeout: float) -> tuple[object, str]:
    """Connect to torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``; return the store and
    its host. Raises CommTimeoutError when it does not answer within ``timeout`` seconds
    (e.g. a stale ``TORCHELASTIC_USE_AGENT_STORE`` variable with no torchrun around),
    CommError when torch is not installed."""
    host = os.environ.get("MASTER_ADDR", "")
    port_text = os.environ.get("MASTER_PORT", "")
    if not host or not port_text.isdigit():
        raise UsageError("TORCHELASTIC_USE_AGENT_STORE is set but MASTER_ADDR/MASTER_PORT are "
                         "not: this process was not started by torchrun")
    try:
        TCPStore = importlib.import_module("torch.distributed").TCPStore
    except (ImportError, AttributeError) as exc:
        raise CommError("TORCHELASTIC_USE_AGENT_STORE is set (torchrun) but torch.distributed "
                        f"cannot be imported: {exc}") from exc
    try:
        store = TCPStore(host, int(port_text), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CommTimeoutError(f"torchrun's agent store at {host}:{port_text} did not answer "
                               f"within {timeout:g} s ({type(exc).__name__}: {exc}); a stale "
                               "TORCHELASTIC_USE_AGENT_STORE variable?") from exc
    return store, host
