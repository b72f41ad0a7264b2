"""Shared memory between the ranks of one host: the ring-buffer channel between two
processes (:mod:`.channel`) and the transport that routes same-host peers over it and the
others over TCP (:mod:`.hybrid`).
"""

from __future__ import annotations

from .channel import (
    CHUNK_BYTES,
    DEFAULT_RING_BYTES,
    SHM_DIR,
    WATCH_SECONDS,
    Offer,
    Probe,
    ShmChannel,
    ShmSetupError,
    accept,
    confirm,
    discard_offer,
    finish_offer,
    offer,
    segment_names,
    supported,
    vm_read,
)
from .hybrid import (
    DEFAULT_SHM,
    ENV_SHM,
    SETUP_SEQ,
    CombinedStats,
    HybridTransport,
    shm_enabled,
)

__all__ = [
    "SHM_DIR",
    "DEFAULT_RING_BYTES",
    "CHUNK_BYTES",
    "WATCH_SECONDS",
    "ShmChannel",
    "ShmSetupError",
    "Offer",
    "supported",
    "offer",
    "accept",
    "finish_offer",
    "confirm",
    "discard_offer",
    "vm_read",
    "Probe",
    "segment_names",
    "HybridTransport",
    "CombinedStats",
    "ENV_SHM",
    "DEFAULT_SHM",
    "shm_enabled",
    "SETUP_SEQ",
]
