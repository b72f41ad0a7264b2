"""Defaults and limits shared by the layers of bitcoll (one place to read and change them)."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_TIMEOUT", "ENV_MASTER_PORT", "ENV_INTEGRITY", "MAX_SUM_RANGE"]

#: Default deadline, in seconds, of every blocking operation (set-up included).
DEFAULT_TIMEOUT: Final = 300.0

#: Environment variable naming the port of bitcoll's own rendezvous store (TCP backend).
ENV_MASTER_PORT: Final = "BITCOLL_MASTER_PORT"

#: Environment variable that turns on the TCP backend's per-frame integrity tags ("1").
ENV_INTEGRITY: Final = "BITCOLL_INTEGRITY"

#: Largest ``levels * size`` of the exact-sum collectives (their results travel in at most
#: 16-bit fields).
MAX_SUM_RANGE: Final = (1 << 15) - 1
