"""The parts of ``train.py``'s training loop: schedule, loss scaling, evaluation, step figures
and replica checks.

* :func:`lr_at`: linear warm-up, then constant or cosine decay to a tenth.
* :class:`LossScale`: fp16's dynamic loss scaling, decided identically on every rank.
* :func:`evaluate`: the validation loss over fixed, evenly spaced windows.
* :func:`step_figures` and :func:`step_record`: a step's timing, bytes and loss, averaged
  over the ranks (the ``steps`` records of the JSON log, :mod:`lioncub.recipe.logs`).
* :func:`same_on_all_ranks`, :func:`params_digest`: cross-rank equality of small values, for
  the checks before training; :func:`check_replicas`: the optimizer's replica check turned
  into an error naming the first differing rank and parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

import bitcoll
import bitcoll.kernels
from lioncub.replicas import ReplicaMismatchError
from lioncub.stats import StepStats

from .data import windows
from .models import autocast, token_loss

__all__ = ["lr_at", "LossScale", "default_threads", "digest48", "params_digest",
           "same_on_all_ranks", "evaluate", "step_figures", "step_record", "replica_error",
           "check_replicas"]

class LossScale:
    """Dynamic loss scaling for ``--dtype fp16``, decided identically on every rank.

    The loss is multiplied by ``scale`` before ``backward()``; :meth:`unscale` then checks the
    gradients on every rank (one all-reduce of one float64) and either divides them by
    ``scale`` (a power of two: exact) and returns True, or, if any rank's gradients hold an
    inf or NaN, halves ``scale`` and returns False (the step is skipped everywhere, so the
    replicas stay identical). After :data:`GROWTH_INTERVAL` good steps in a row the scale
    doubles. Disabled (``scale`` 1, :meth:`unscale` returns True at no cost) for other dtypes.
    """

    INITIAL = 2.0 ** 16
    GROWTH_INTERVAL = 200

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = self.INITIAL if enabled else 1.0
        self.good = 0

    def unscale(self, params: Sequence[torch.Tensor], comm: bitcoll.Communicator) -> bool:
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        flag = np.array([1.0 if finite else 0.0])
        if float(np.asarray(comm.allreduce(flag, op="min"))[0]) < 1.0:
            self.scale /= 2.0
            self.good = 0
            return False
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        self.good += 1
        if self.good % self.GROWTH_INTERVAL == 0:
            self.scale *= 2.0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good = int(state["good"])


def lr_at(step: int, steps: int, lr: float, warmup: int, schedule: str) -> float:
    """Learning rate of (1-based) ``step``: linear warm-up over ``warmup`` steps, then constant
    (``schedule="constant"``) or a cosine decay to ``lr / 10`` at ``steps`` (``"cosine"``)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if schedule == "constant" or steps <= warmup:
        return lr
    frac = (step - warmup) / (steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def default_threads(local_size: int) -> int:
    """Torch threads per rank when ``--threads`` is not given: the usable cores divided by the
    ranks on this host (``comm.local_size``, as bitcoll shares them among its kernels), at
    least 1."""
    return max(1, bitcoll.kernels.usable_cores() // max(1, local_size))


def digest48(data: bytes) -> float:
    """48 bits of SHA-256 as a float64 (exact), for cross-rank equality checks."""
    return float(int.from_bytes(hashlib.sha256(data).digest()[:6], "little"))


def params_digest(model: nn.Module) -> float:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return digest48(h.digest())


def same_on_all_ranks(comm: bitcoll.Communicator, values: Sequence[float]) -> list[bool]:
    """For each value, whether every rank holds the same one (two small all-reduces)."""
    x = np.asarray(values, dtype=np.float64)
    hi = np.asarray(comm.allreduce(x.copy(), op="max"))
    lo = np.asarray(comm.allreduce(x.copy(), op="min"))
    return [bool(a == b) for a, b in zip(hi, lo, strict=True)]


@torch.no_grad()
def evaluate(model: nn.Module, comm: bitcoll.Communicator | None, val: npt.NDArray[np.uint8],
             batch_size: int, seq_len: int, eval_batches: int, device: str = "cpu",
             dtype: torch.dtype = torch.float32, ranks: int | None = None) -> float:
    """Mean validation cross-entropy (nats/token) over ``eval_batches * batch_size * size``
    evenly spaced windows, split over the ranks of ``comm`` (every rank returns the same
    value); the forward pass runs on ``device`` in ``dtype`` (autocast) as in training.
    ``comm=None``: this process alone evaluates the windows of a world of ``ranks`` ranks
    (no communication; the fault-tolerant loop's evaluation)."""
    size = comm.size if comm is not None else (ranks or 1)
    rank = comm.rank if comm is not None else 0
    step = comm.size if comm is not None else 1
    total = eval_batches * batch_size * size
    starts = np.linspace(0, val.size - seq_len - 1, total).astype(np.int64)[rank::step]
    model.eval()
    acc = np.zeros(2, dtype=np.float64)
    for i in range(0, starts.size, batch_size):
        x, y = windows(val, starts[i:i + batch_size], seq_len)
        with autocast(device, dtype):
            loss = token_loss(model, x.to(device), y.to(device))
        acc[0] += float(loss) * y.numel()
        acc[1] += y.numel()
    model.train()
    if comm is not None:
        acc = np.asarray(comm.allreduce(acc, op="sum"))
    return float(acc[0] / acc[1])


def step_figures(stats: StepStats | None, optional: bool = False
                 ) -> tuple[float, int, int, int, float | None]:
    """(comm s, bytes sent, bytes received, tensors whose momentum was synced, mean vote
    agreement or None) of an optimizer step from its statistics ``stats``
    (``opt.last_stats``). ``optional``: ``stats`` may be None (DDP's own averaging, the sign
    hook, and a stale optimizer's first step, whose figures are those of the step before):
    zeros then; otherwise None is a RuntimeError."""
    if stats is None:
        if optional:
            return 0.0, 0, 0, 0, None
        raise RuntimeError("the optimizer reported no statistics after its step")
    agreement = None
    if stats.agreement:
        agreement = float(np.mean(list(stats.agreement.values())))
    return (float(stats.comm_seconds), int(stats.bytes_sent), int(stats.bytes_received),
            len(stats.synced), agreement)


def step_record(step: int, lr: float, loss: float, times: tuple[float, float, float],
                figures: tuple[float, int, int, int, float | None], *, warmup: bool,
                applied: bool, comm: bitcoll.Communicator | None) -> dict[str, Any]:
    """The log record of a step: ``times`` are ``perf_counter`` readings at its start, after
    ``backward()`` and at its end; ``figures`` come from :func:`step_figures`. The loss, the
    times and the bytes are averaged over the ranks of ``comm`` (one all-reduce of 7
    float64; ``comm=None``: this rank's own). RuntimeError when the loss is not finite."""
    t0, t1, t2 = times
    comm_s, sent, received, synced, agreement = figures
    local = np.array([loss, t2 - t0, t1 - t0, (t2 - t1) - comm_s, comm_s, sent, received],
                     dtype=np.float64)
    mean = local if comm is None else np.asarray(comm.allreduce(local, op="sum")) / comm.size
    if not math.isfinite(mean[0]):
        raise RuntimeError(f"training loss is {mean[0]} at step {step}")
    rec = {"step": step, "lr": lr, "loss": float(mean[0]), "time": float(mean[1]),
           "forward_backward": float(mean[2]), "optimizer": float(mean[3]),
           "compute": float(mean[2] + mean[3]), "comm": float(mean[4]),
           "bytes_sent": float(mean[5]), "bytes_received": float(mean[6]),
           "synced_tensors": synced}
    if warmup:
        rec["warmup"] = True
    if not applied:
        rec["skipped"] = True
    if agreement is not None:
        rec["agreement"] = agreement
    return rec


def replica_error(exc: ReplicaMismatchError, when: str) -> RuntimeError:
    """The RuntimeError that stops a run whose replicas differ, naming the first differing
    rank and parameter."""
    return RuntimeError(f"the model replicas differ {when} (rank {exc.rank}'s parameter "
                        f"{exc.index} ({exc.name}) differs from rank 0's; "
                        f"{len(exc.indices)} parameters differ): the optimizer applied "
                        "different updates on different ranks")


def check_replicas(check: Callable[[], None], when: str) -> None:
    """Run a collective replica check (``opt.check_replicas``; every rank gets the same
    verdict) and raise :func:`replica_error`'s RuntimeError on a mismatch."""
    try:
        check()
    except ReplicaMismatchError as exc:
        raise replica_error(exc, when) from None
