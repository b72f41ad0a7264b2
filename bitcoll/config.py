"""Defaults and limits shared by the layers of bitcoll (one place to read and change them)."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_TIMEOUT", "ENV_MASTER_PORT", "ENV_INTEGRITY"]

#: Default deadline, in seconds, of every blocking operation (set-up included).
DEFAULT_TIMEOUT: Final = 300.0

#: Environment variable naming the port of bitcoll's own rendezvous store (TCP backend).
ENV_MASTER_PORT: Final = "BITCOLL_MASTER_PORT"

#: Environment variable that turns on the TCP backend's per-frame integrity tags ("1").
ENV_INTEGRITY: Final = "BITCOLL_INTEGRITY"
