"""bitcoll: collective communication for numpy arrays over MPI and TCP, with packed-bit
collectives (majority-vote sign all-reduce, exact low-bit integer sums) for
communication-efficient distributed training.

Quick start (run under ``python -m launch -n 4 script.py`` or ``mpiexec -n 4 python script.py``)::

    import numpy as np, bitcoll
    with bitcoll.init() as comm:
        total = comm.allreduce(np.ones(10, np.float32))          # 4.0 everywhere
        votes = comm.sign_allreduce(np.random.randn(10))          # int8 +-1, identical on all

See the README for the full manual; errors are documented in :mod:`bitcoll.errors`.
"""

from . import arrays, errors, layout
from .bootstrap import detect_backend, init
from .communicator import DEFAULT_PACKED_SEGMENT_BYTES, DEFAULT_SEGMENT_BYTES, Communicator
from .errors import (
    BitcollError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    ProtocolError,
    UsageError,
)
from .ops import ReduceOp
from .partition import block, partition
from .transport.base import TrafficStats
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "init",
    "detect_backend",
    "Communicator",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_PACKED_SEGMENT_BYTES",
    "Work",
    "ReduceOp",
    "TrafficStats",
    "partition",
    "block",
    "errors",
    "layout",
    "arrays",
    "BitcollError",
    "UsageError",
    "CommError",
    "CommTimeoutError",
    "PeerLostError",
    "ProtocolError",
]
