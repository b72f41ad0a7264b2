"""The MPI transport: launcher detection (:mod:`.launcher`), the process lifecycle and exit
rules (:mod:`.lifecycle`), the frame messages (:mod:`.requests`), streamed ring passes
(:mod:`.stream`) and the transport itself (:mod:`.transport`).
"""

from __future__ import annotations

from .launcher import (
    launched_by_mpi,
    mpi_available,
)
from .lifecycle import (
    FINALIZE_GRACE_ENV,
    FINALIZE_GRACE_SECONDS,
    finalize_grace,
)
from .requests import (
    CONTROL_SIZE,
    CONTROL_TAG,
    DATA_TAG,
    INLINE_MAX,
)
from .transport import (
    MPITransport,
    record_bytes,
)

__all__ = [
    "launched_by_mpi",
    "mpi_available",
    "FINALIZE_GRACE_SECONDS",
    "FINALIZE_GRACE_ENV",
    "finalize_grace",
    "DATA_TAG",
    "CONTROL_TAG",
    "INLINE_MAX",
    "CONTROL_SIZE",
    "MPITransport",
    "record_bytes",
]
