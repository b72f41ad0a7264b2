"""How this process was started: MPI launcher detection and the lazy import of mpi4py.

Nothing here imports :mod:`mpi4py` except :func:`_mpi`, which initializes MPI.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from typing import Any

from ...errors import UsageError

__all__ = ["launched_by_mpi", "mpi_available"]

# --------------------------------------------------------------------------------------------
# Environment detection
# --------------------------------------------------------------------------------------------


def _is_open_socket(fd_text: str) -> bool:
    try:
        fd = int(fd_text)
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except (ValueError, OSError):
        return False


def launched_by_mpi() -> bool:
    """Return True when this process was started by an MPI launcher (``mpiexec``/``srun``).

    Only environment variables are inspected (and one ``fstat``); mpi4py is not imported. The
    process counts as MPI-launched when any of these holds:

    * **Open MPI** (``mpirun``/``prterun``): ``OMPI_COMM_WORLD_SIZE`` is set. Open MPI's
      launcher sets it (with ``OMPI_COMM_WORLD_RANK``) in every process it starts.
    * **PMIx** (Open MPI 5 / PRRTE, ``srun --mpi=pmix``, any PMIx server): ``PMIX_RANK`` is set.
      A PMIx server sets it for every client process it launches.
    * **PMI-1 / PMI-2** (MPICH's Hydra ``mpiexec``, Intel MPI and MVAPICH under Hydra,
      ``srun --mpi=pmi2``): ``PMI_RANK`` is set *and* the PMI connection it relies on exists:
      ``PMI_FD`` names a socket that is open in this process, or ``PMI_PORT`` (a
      ``host:port`` the client connects to) is set. Hydra also sets ``PMI_SIZE``,
      ``MPI_LOCALNRANKS`` and ``HYDI_CONTROL_FD``, which add nothing to this test.

    The ``PMI_FD`` check matters because environment variables are inherited: a child process
    started by an MPI rank (for example with :mod:`subprocess`, which closes inherited file
    descriptors by default) sees the rank's ``PMI_*`` variables but not its PMI socket, and an
    MPI initialization there would fail. Such a child is correctly reported as not launched by
    MPI. The same cannot be checked cheaply for Open MPI and PMIx (their variables point to a
    server address, not to a descriptor), so a child of an Open MPI rank that keeps the parent's
    environment is reported as MPI-launched.

    Slurm sets ``SLURM_PROCID`` in every task of a step, including steps that are not MPI jobs
    (``srun -n 4 python x.py`` runs four independent processes). It is therefore not sufficient
    on its own: a Slurm step counts as MPI only through the PMI-2 or PMIx variables that
    Slurm's ``--mpi`` plugins set, which the rules above already cover.
    """
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env:
        return True
    if "PMI_RANK" in env:
        if "PMI_PORT" in env:
            return True
        fd_text = env.get("PMI_FD")
        if fd_text is not None and _is_open_socket(fd_text):
            return True
    return False


def mpi_available() -> bool:
    """Return True when mpi4py is installed with its compiled ``mpi4py.MPI`` module.

    This finds the module without importing it (importing ``mpi4py.MPI`` initializes MPI), so
    it does not prove that the MPI library itself loads; :meth:`MPITransport.create` does.
    """
    try:
        return importlib.util.find_spec("mpi4py.MPI") is not None
    except (ImportError, ValueError):
        return False


def _mpi() -> Any:
    """Import and return ``mpi4py.MPI`` (initializes MPI on first use)."""
    try:
        from mpi4py import MPI as mpi_module
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise UsageError("the MPI transport needs mpi4py: pip install 'bitcoll[mpi]'") from exc
    return mpi_module

