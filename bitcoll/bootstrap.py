"""``bitcoll.init``: pick a backend from the environment and build a Communicator.

Backends:

* ``"mpi"``: when the process was started by an MPI launcher (``mpiexec``/``mpirun``,
  Slurm with PMI/PMIx) and mpi4py imports. Uses a private duplicate of ``MPI.COMM_WORLD``.
* ``"tcp"``: when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set (the
  torchrun contract, as set by ``python -m launch``); rank 0 serves the rendezvous store at
  ``MASTER_ADDR:MASTER_PORT``.
* ``"local"``: a one-rank world, when neither applies.

``backend="auto"`` tries them in that order.
"""

from __future__ import annotations

import os

from .communicator import (
    DEFAULT_PACKED_SEGMENT_BYTES,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_TIMEOUT,
    Communicator,
)
from .errors import UsageError
from .transport.base import Transport
from .transport.local import LocalTransport

__all__ = ["init", "detect_backend", "TCP_ENV"]

TCP_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("auto", "mpi", "tcp", "local")


def detect_backend() -> str:
    """The backend ``init(backend="auto")`` would choose in this process."""
    from .transport.mpi import launched_by_mpi, mpi_available

    if launched_by_mpi() and mpi_available():
        return "mpi"
    if all(os.environ.get(k) for k in TCP_ENV):
        return "tcp"
    return "local"


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name} must be an integer, got {value!r}")\
            from None


def _tcp_transport(timeout: float) -> Transport:
    from .transport.tcp import TCPTransport

    missing = [k for k in TCP_ENV if not os.environ.get(k)]
    if missing:
        raise UsageError("backend 'tcp' needs the environment variables "
                         f"{', '.join(TCP_ENV)}; missing: {', '.join(missing)} "
                         "(start the ranks with `python -m launch -n N script.py`)")
    rank, size, port = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("MASTER_PORT")
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"RANK={rank} is not in [0, WORLD_SIZE={size})")
    return TCPTransport.create(rank, size, os.environ["MASTER_ADDR"], port, timeout=timeout)


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT,
         segment_bytes: int = DEFAULT_SEGMENT_BYTES,
         packed_segment_bytes: int = DEFAULT_PACKED_SEGMENT_BYTES) -> Communicator:
    """Create the communicator of this process's world.

    ``backend``: "auto", "mpi", "tcp" or "local" (see the module docstring). ``timeout``:
    the default deadline in seconds of every blocking operation, connection set-up included.
    ``segment_bytes``: the wire segment size of the dense ring algorithms (default 32 MiB);
    ``packed_segment_bytes``: that of the packed-bit pipelines (default 1 MiB). Every rank
    must pass the same values.

    Raises UsageError for an unknown backend or inconsistent environment, CommTimeoutError
    when the other ranks do not show up before the deadline.

    Use it as a context manager to release the connections at the end::

        with bitcoll.init() as comm:
            y = comm.allreduce(x, op="avg")
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = detect_backend()
    transport: Transport
    if backend == "mpi":
        from .transport.mpi import MPITransport

        transport = MPITransport.create(timeout=timeout)
    elif backend == "tcp":
        transport = _tcp_transport(timeout)
    else:
        transport = LocalTransport()
    return Communicator(transport, timeout=timeout, segment_bytes=segment_bytes,
                        packed_segment_bytes=packed_segment_bytes)
