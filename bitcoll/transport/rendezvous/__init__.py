"""Rendezvous: how the ranks of a job find each other before any data moves.

The store (:mod:`.store`, or a torch/external one: :mod:`.external_store`), the shared-secret
authentication of every connection (:mod:`.auth`, :mod:`.handshake`) and the set-up of the
TCP mesh through the store (:mod:`.tcp_bootstrap`). Nothing here moves collective data.
"""

from __future__ import annotations

from . import auth, handshake
from .external_store import (
    STORE_METHODS,
    ExternalStore,
    check_store,
    torchrun_store,
)
from .store import (
    AUTH_SECONDS,
    IO_SECONDS,
    MAX_BODY,
    MAX_HINT_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_PENDING_AUTH,
    MAX_STORED_BYTES,
    MAX_VALUE,
    StoreClient,
    StoreServer,
)
from .tcp_bootstrap import (
    KEY_ABORT,
    KEY_ADDR,
    KEY_INTEGRITY,
    KEY_JOB,
    KEY_JOIN,
    KEY_SECRET_FILE,
    KEY_SIZE,
    KEY_STALL,
    RECEIVE_BUFFER_BYTES,
    SEND_BUFFER_BYTES,
    RendezvousStore,
    build_mesh,
    send_buffer_bytes,
    tune,
)

__all__ = [
    "auth",
    "handshake",
    "StoreServer",
    "StoreClient",
    "MAX_BODY",
    "MAX_VALUE",
    "MAX_KEY_BYTES",
    "MAX_KEYS",
    "MAX_STORED_BYTES",
    "MAX_HINT_BYTES",
    "AUTH_SECONDS",
    "IO_SECONDS",
    "MAX_PENDING_AUTH",
    "ExternalStore",
    "torchrun_store",
    "check_store",
    "STORE_METHODS",
    "SEND_BUFFER_BYTES",
    "RECEIVE_BUFFER_BYTES",
    "send_buffer_bytes",
    "RendezvousStore",
    "build_mesh",
    "tune",
    "KEY_SIZE",
    "KEY_JOB",
    "KEY_JOIN",
    "KEY_ADDR",
    "KEY_ABORT",
    "KEY_SECRET_FILE",
    "KEY_STALL",
    "KEY_INTEGRITY",
]
