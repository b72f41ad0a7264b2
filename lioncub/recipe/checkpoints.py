"""``train.py``'s checkpoints: one file per rank, written atomically, checked on resume.

A checkpoint is a directory holding ``rank<r>.pt`` (:func:`checkpoint_file`) for every rank
``r``, each a ``torch.save`` of a dict of tensors and plain values (loadable with
``weights_only=True``): :data:`CHECKPOINT_FORMAT`, the rank and world size that wrote it,
the step, the :data:`TRAJECTORY_KEYS` options, and whatever the training loop keeps (model,
optimizer state, generators, log). Every function here is collective over a communicator:
a failure on one rank is an error on every rank (:func:`agree`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

import bitcoll

from .loop import same_on_all_ranks

__all__ = ["CHECKPOINT_FORMAT", "TRAJECTORY_KEYS", "checkpoint_file", "agree",
           "save_checkpoint", "load_checkpoint"]

CHECKPOINT_FORMAT = "lioncub-train-checkpoint/1"
#: Options that shape the training trajectory: a resumed run must use the checkpoint's values.
TRAJECTORY_KEYS = ("optimizer", "lr", "weight_decay", "schedule", "warmup", "levels",
                   "momentum_sync", "steps", "seed", "batch_size", "seq_len", "corpus_mb",
                   "d_model", "layers", "heads", "dtype", "native", "momentum_dtype", "device",
                   "no_comm", "backend", "hook")


def checkpoint_file(directory: Path, rank: int) -> Path:
    """Rank ``rank``'s file of the checkpoint in ``directory``."""
    return directory / f"rank{rank}.pt"


def agree(comm: bitcoll.Communicator, error: str | None, what: str) -> None:
    """Collective: raise RuntimeError on every rank when any rank passes an ``error`` (its own
    message on that rank, "... on rank R" on the others)."""
    flag = np.array([comm.size if error is None else comm.rank], dtype=np.float64)
    first = int(np.asarray(comm.allreduce(flag, op="min"))[0])
    if error is not None:
        raise RuntimeError(error)
    if first < comm.size:
        raise RuntimeError(f"{what} failed on rank {first}")


def save_checkpoint(directory: Path, comm: bitcoll.Communicator, state: dict[str, Any]) -> None:
    """Collective: every rank writes ``state`` to :func:`checkpoint_file` (atomically, through a
    temporary file). RuntimeError on every rank when any rank could not write."""
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = checkpoint_file(directory, comm.rank)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
    except OSError as exc:
        error = f"cannot write the checkpoint {directory}: {exc}"
    agree(comm, error, "writing the checkpoint")


def load_checkpoint(directory: Path, comm: bitcoll.Communicator,
                    args: Any) -> dict[str, Any]:
    """Collective: every rank reads its file of the checkpoint in ``directory`` and checks that
    it was written by the same rank of a run with the same world size and the same
    :data:`TRAJECTORY_KEYS` options, and that every rank's file is at the same step.
    RuntimeError on every rank otherwise."""
    error = None
    state: dict[str, Any] = {}
    path = checkpoint_file(directory, comm.rank)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            error = f"{path} is not a train.py checkpoint"
        elif state["trajectory"].get("fault_tolerant"):
            error = (f"{path} was written by a --fault-tolerant run (the live ranks' files), "
                     "which cannot be resumed")
        elif state["world_size"] != comm.size or state["rank"] != comm.rank:
            error = (f"{path} was written by rank {state['rank']} of {state['world_size']}; "
                     f"this is rank {comm.rank} of {comm.size}")
        else:
            mine = {k: getattr(args, k) for k in TRAJECTORY_KEYS}
            diff = [f"--{k.replace('_', '-')} {state['trajectory'].get(k)!r} (now {v!r})"
                    for k, v in mine.items() if state["trajectory"].get(k) != v]
            if diff:
                error = (f"{path} belongs to a run with other options: " + ", ".join(diff)
                         + "; resume with the checkpoint's options")
    except (OSError, RuntimeError, KeyError, pickle.UnpicklingError) as exc:
        error = f"cannot read the checkpoint {path}: {exc}"
    agree(comm, error, "reading the checkpoint")
    if not same_on_all_ranks(comm, [float(state["step"])])[0]:
        raise RuntimeError(f"the files of {directory} are not all from the same step")
    return state

