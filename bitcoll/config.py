"""Defaults and limits shared by the layers of bitcoll (one place to read and change them)."""

from __future__ import annotations

import os
from typing import Final

from .errors import UsageError

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_RENDEZVOUS_TIMEOUT", "ENV_RENDEZVOUS_TIMEOUT",
           "ENV_MASTER_PORT", "ENV_INTEGRITY", "ENV_CHECKSUM", "ENV_TWO_LEVEL",
           "ENV_SEND_BUFFER", "MAX_SUM_RANGE", "rendezvous_timeout", "switch"]

#: Default deadline, in seconds, of every blocking operation (set-up included).
DEFAULT_TIMEOUT: Final = 300.0

#: Default deadline, in seconds, of the TCP backend's rendezvous (the ranks meeting at
#: ``bitcoll.init``): shorter than :data:`DEFAULT_TIMEOUT`, so that a job whose other ranks
#: never start (a batch script without ``srun``, a wrong ``WORLD_SIZE``) says so sooner.
DEFAULT_RENDEZVOUS_TIMEOUT: Final = 120.0

#: Environment variable that sets the rendezvous deadline in seconds (default
#: :data:`DEFAULT_RENDEZVOUS_TIMEOUT`; never longer than ``init``'s ``timeout``).
ENV_RENDEZVOUS_TIMEOUT: Final = "BITCOLL_RENDEZVOUS_TIMEOUT"

#: Environment variable naming the port of bitcoll's own rendezvous store (TCP backend).
ENV_MASTER_PORT: Final = "BITCOLL_MASTER_PORT"

#: Environment variable that turns on the TCP backend's per-frame integrity tags ("1").
ENV_INTEGRITY: Final = "BITCOLL_INTEGRITY"

#: Environment variable that turns the TCP backend's per-frame CRC32C checksum off ("0"; on by
#: default, and left out where integrity tags are on).
ENV_CHECKSUM: Final = "BITCOLL_CHECKSUM"

#: Environment variable that sets whether the two-level algorithms are the default on hosts
#: with several ranks ("0": flat, "1": two-level, the default).
ENV_TWO_LEVEL: Final = "BITCOLL_TWO_LEVEL"

#: Environment variable that sets the send buffer of the TCP backend's data connections, in
#: bytes (0: the kernel's own sizing; default
#: :data:`bitcoll.transport.rendezvous.tcp_bootstrap.SEND_BUFFER_BYTES`).
ENV_SEND_BUFFER: Final = "BITCOLL_SEND_BUFFER"

#: Largest ``levels * size`` of the exact-sum collectives (their results travel in at most
#: 16-bit fields).
MAX_SUM_RANGE: Final = (1 << 15) - 1


def rendezvous_timeout(timeout: float) -> float:
    """The deadline, in seconds, of the TCP backend's set-up under ``bitcoll.init(timeout=)``:
    ``BITCOLL_RENDEZVOUS_TIMEOUT`` (a number > 0; unset or empty:
    :data:`DEFAULT_RENDEZVOUS_TIMEOUT`), at most ``timeout``. UsageError for a bad value."""
    text = os.environ.get(ENV_RENDEZVOUS_TIMEOUT, "").strip()
    if not text:
        return min(timeout, DEFAULT_RENDEZVOUS_TIMEOUT)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{ENV_RENDEZVOUS_TIMEOUT} must be a number of seconds > 0, got "
                         f"{text!r}", argument=ENV_RENDEZVOUS_TIMEOUT)
    return min(timeout, value)


def switch(value: object, name: str, env: str, default: bool) -> bool:
    """An on/off option of ``bitcoll.init``: ``value`` when it is True or False, else (None)
    the environment variable ``env`` ("0" or "1"; unset or empty: ``default``). UsageError
    for anything else, naming the option ``name`` or the variable (its ``argument``)."""
    if value is None:
        text = os.environ.get(env, "")
        if text not in ("0", "1", ""):
            raise UsageError(f"{env} must be 0 or 1, got {text!r}", argument=env)
        return default if text == "" else text == "1"
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True, False or None, got {value!r}", argument=name)
    return value
