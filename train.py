#!/usr/bin/env python3
"""Data-parallel training of a small character-level transformer with Lion Cub and its baselines.

Every rank holds a full replica of the model, draws its own minibatches, computes its own
gradient and calls :class:`lioncub.torch.DistributedLion`, which exchanges whatever the chosen
variant exchanges (float32 gradients, sign bits, quantized votes) through bitcoll and applies the
same update on every rank. The run compares Lion Cub with Global Lion and Distributed Lion on
identical data, seeds and step counts.

Running it::

    python -m launch -n 4 train.py                      # 4 ranks, TCP backend
    mpiexec -n 4 python train.py                        # 4 ranks, MPI backend
    python train.py --steps 100                         # one rank, no communication
    python -m launch -n 4 train.py --optimizer global --json-log runs/global.json
    torchrun --nproc-per-node 4 train.py                # torchrun's environment
    srun -N 4 --ntasks-per-node 1 python train.py       # Slurm (SLURM_* environment)
    python -m launch -n 4 train.py --backend gloo --hook   # DDP, votes during backward

The backend is detected by ``bitcoll.init()``. The defaults (a 0.44M-parameter model, 400
steps of 16 x 128 characters per rank, lr 3e-4 with warm-up and cosine decay) take about two
minutes with 4 ranks sharing 2 cores, and bring the validation loss from ln(97) = 4.6 to about
2.26 nats per character. Rank 0 prints a progress bar (carriage-return
updates on a terminal, a plain line every 5% of the run otherwise), the validation loss every
``--eval-every`` steps and a final summary; ``--json-log`` writes every step, every evaluation,
the configuration and the summary to a JSON file (format below).

Data
----
The corpus is the Python standard library's own source (``sysconfig.get_paths()["stdlib"]``):
every ``*.py`` file outside test directories and third-party ``site-packages``, ordered by a
hash of its relative path (a fixed, deterministic shuffle that spreads the selection across the
library), read in that order until ``--corpus-mb`` megabytes (10**6 bytes) are collected. Every
tenth file goes to the held-out validation split. Tokens are bytes: newline and printable ASCII
are 96 tokens, every other byte is the unknown token, so the vocabulary (97) is fixed and the
same on every machine. Every rank builds the same corpus; the ranks compare a digest of it
and of the freshly initialised model before training and stop with an error if they differ.

Rank ``r`` draws minibatch windows uniformly from the training stream with the generator
``numpy.random.default_rng([seed, r])``. The validation loss is the mean token cross-entropy
(nats) over a fixed set of evenly spaced validation windows (``--eval-batches`` batches per rank,
split over the ranks), so it is comparable between optimizers and steps.

Model sizes, precision, devices
------------------------------
``--model`` picks a preset: ``tiny`` (the default: d_model 128, 2 layers, 4 heads, 0.44M
parameters), ``small`` (384, 6, 6: 10.8M) or ``medium`` (512, 10, 8: 31.7M; counts at
``--seq-len 128``); ``--d-model``, ``--layers`` and ``--heads`` override the preset's values.
``--dtype bf16`` / ``fp16`` run the forward and backward passes under ``torch.autocast``;
the parameters, gradients and momenta stay float32 (so the optimizer, the exchanged votes and
the replica check are those of a float32 run), and fp16 adds dynamic loss scaling whose
overflow verdict is agreed by all ranks (an overflowing step is skipped everywhere).
``--native`` instead keeps the parameters themselves in ``--dtype`` (no autocast, no float32
copy) and ``--momentum-dtype bf16`` stores the momenta in bfloat16; both need a lioncub whose
``DistributedLion`` takes 16-bit parameters (its torch engine). ``--device cuda`` runs the
model on the GPU; the optimizer takes the GPU parameters when lioncub supports it, else it
works on a float32 host copy (gradients copied to the host and parameters back every step;
the copies count as optimizer time); without CUDA it stops with an error (exit status 2).

DistributedDataParallel
-----------------------
``--backend bitcoll|gloo`` wraps the model in torch's ``DistributedDataParallel`` over a
``torch.distributed`` process group of that backend ("bitcoll": :mod:`bitcoll.torch`). The
process group meets through torchrun's store under torchrun, else through a TCP store that
rank 0 opens on a free port of ``MASTER_ADDR`` (announced over bitcoll). Without ``--hook``,
``--optimizer global`` lets DDP average the gradients during backward and steps Lion
(:class:`lioncub.torch.Lion`) on the mean gradient; any other variant keeps the gradients
local (``lioncub.torch.no_allreduce_hook``) and votes after backward in
:class:`lioncub.torch.DistributedLion`. ``--hook`` (``--hook lioncub``) votes inside DDP's
backward instead, bucket by bucket (:mod:`lioncub.torch_hooks`: ``lioncub_hook`` and the
stateless ``LionCubStep``, bit for bit DistributedLion's updates); ``--hook sign`` replaces
the average by a packed 1-bit majority vote with error feedback (``sign_hook``) and steps
``torch.optim.AdamW`` (the generic hook for other optimizers). With ``--no-comm`` every
rank runs the same code on a process group and communicator of its own (one rank). In the
hook modes the votes travel during ``backward()``: their time is part of *forward +
backward* and *communication* reads 0. DDP mode takes fp32 or bf16 autocast on the CPU.

Replica check
-------------
Every ``--check-every`` steps (default 100; 0: only after training) every rank hashes its
parameters and the ranks compare the hashes (one all-gather of 8 bytes per tensor,
:meth:`lioncub.replicas.ReplicaSet.check`); replicas that differ stop the run with an error
naming the lowest differing rank and the first differing parameter.

Checkpoints
-----------
``--save DIR`` writes ``DIR/rank<r>.pt`` on every rank at the end of the run (``--save-every
N``: also every N steps; ``--stop-after S``: end the run after step S of the ``--steps``
schedule). Each file holds the model, the optimizer's ``state_dict()`` (this rank's momenta,
step count, tie counter, sync schedule state), the data sampler's generator state, torch's
generator state, the loss scale, the step and the log so far. ``--resume DIR`` restores all of
it on the same number of ranks with the same training options (checked, see
``TRAJECTORY_KEYS``; a mismatch stops every rank with the differing options named), so the
continued run's losses equal an uninterrupted run's bit for bit (same machine, same
``--threads``), and its JSON log holds the whole run.

Timing
------
A step's time covers batch sampling, forward, backward and ``opt.step()``. It is split into
*forward + backward*, *optimizer* (everything after ``backward()`` that is not communication:
the optimizer's arithmetic, packing, host copies) and *communication* (the time the optimizer
reports blocked in its collectives, i.e. exposed communication); *compute* is the first two.
Bytes are those the optimizer's collectives sent in the step. The per-step figures are averaged
over ranks (one small all-reduce per step, excluded from the step time and byte counts, which
also yields the mean training loss over ranks). The first step of a run (and of a resumed run)
includes one-time warm-up (kernel compilation, buffer allocation): it is flagged ``warmup`` in
the log and reported on its own in the summary; the summary's mean step figures leave out the
first three steps of every session, and the ETA is paced by the steps after the first.
``--target-loss X`` reports the first evaluation whose validation loss is <= X: its step, the
sum of the step times up to it (warm-up steps left out; evaluations are not step time) and the
elapsed wall time. ``--no-comm`` measures the compute floor: each rank trains its own replica
with the optimizer on a one-rank communicator (the same arithmetic, nothing exchanged). After
training
the optimizer compares a checksum of every parameter across the ranks (``opt.check_replicas()``):
replicas that differ are reported, naming the first differing rank and parameter, and the run
exits with status 1.

JSON log
--------
``{"format": "lioncub-train-log/1", "config": {...}, "run": {...}, "steps": [...],
"evals": [...], "summary": {...}}``; ``steps[i]`` has ``step`` (1-based), ``lr``, ``loss``
(training loss averaged over ranks), ``time``, ``compute``, ``comm`` (seconds) and
``bytes_sent``, ``bytes_received`` (per rank, averaged over ranks), ``forward_backward`` and
``optimizer`` (seconds, the parts of ``compute``), ``warmup`` (true on a session's first step),
``skipped`` (true when fp16 overflowed), ``synced_tensors`` (how
many tensors had their momentum averaged after the step) and, for the variants whose
collective returns exact vote sums, ``agreement`` (the mean over tensors of the optimizer's
vote-agreement figure, in [0, 1]); ``evals[i]`` has ``step`` (0 = before training),
``val_loss``, ``elapsed`` (seconds since the start of training) and ``step_seconds`` (sum of
the step times so far, warm-up steps left out). ``summary["target_reached"]`` is the first
evaluation at or below ``--target-loss`` (None when not reached or not asked for).

Exit status: 0 on success, 1 when a communication or run-time error stopped the run, 2 for bad
options (argparse), 130 on Ctrl-C.
"""

from __future__ import annotations

import os

# The collective kernels run on one thread per rank; several ranks usually share the cores.
# Must be set before bitcoll (numba) is imported.
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import inspect
import json
import math
import pickle
import platform
import shutil
import socket
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

import bitcoll
import bitcoll.kernels
import lioncub
from bitcoll.errors import BitcollError, CommError, UsageError
from bitcoll.transport.base import format_bytes
from lioncub.quantize import check_levels
from lioncub.replicas import ReplicaMismatchError, ReplicaSet
from lioncub.stats import StepStats
from lioncub.sync import parse_sync
from lioncub.torch import DistributedLion, Lion, no_allreduce_hook
from lioncub.torch_hooks import (
    LionCubHookState,
    LionCubStep,
    SignHookState,
    lioncub_hook,
    sign_hook,
)

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "UNK",
    "Corpus",
    "encode",
    "decode",
    "corpus_files",
    "load_corpus",
    "BatchSampler",
    "CharTransformer",
    "lr_at",
    "build_parser",
    "parse_args",
    "run",
    "main",
]

LOG_FORMAT = "lioncub-train-log/1"

# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

VOCAB: str = "\n" + "".join(chr(c) for c in range(32, 127))
"""The 96 characters with their own token: newline and printable ASCII, in this order."""
UNK: int = len(VOCAB)
"""Token of every other byte."""
VOCAB_SIZE: int = len(VOCAB) + 1

_LUT = np.full(256, UNK, dtype=np.uint8)
for _i, _ch in enumerate(VOCAB):
    _LUT[ord(_ch)] = _i
_INV = np.frombuffer((VOCAB + "\ufffd").encode("utf-32-le"), dtype=np.uint32)

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})
VAL_EVERY = 10  # file i of the selection is held out when i % VAL_EVERY == VAL_EVERY - 1


def encode(data: bytes) -> npt.NDArray[np.uint8]:
    """Map bytes to tokens: ``VOCAB.index(chr(b))`` for newline and printable ASCII, else UNK.

    Returns a uint8 array of ``len(data)`` tokens in ``[0, VOCAB_SIZE)``.
    """
    return _LUT[np.frombuffer(data, dtype=np.uint8)]


def decode(tokens: npt.ArrayLike) -> str:
    """Inverse of :func:`encode` (UNK becomes U+FFFD)."""
    idx = np.asarray(tokens, dtype=np.int64)
    return _INV[idx].astype(np.uint32).tobytes().decode("utf-32-le")


def _order_key(rel: str) -> tuple[bytes, str]:
    return hashlib.blake2b(rel.encode(), digest_size=8).digest(), rel


def corpus_files(root: Path | None = None) -> list[Path]:
    """The candidate source files, in corpus order.

    ``root`` defaults to the standard library directory. Files named ``*.py`` below ``root``
    whose relative path has no component in :data:`EXCLUDED_DIRS`, ordered by the BLAKE2b hash
    of their relative POSIX path (ties by the path itself).
    """
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(base)
        rels.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return [base / rel for rel in sorted(rels, key=_order_key)]


@dataclass(frozen=True)
class Corpus:
    """Token streams of the training and validation splits (uint8, values < VOCAB_SIZE)."""

    train: npt.NDArray[np.uint8]
    val: npt.NDArray[np.uint8]
    train_files: int
    val_files: int
    digest: str  # SHA-256 of both streams, hex

    def describe(self) -> dict[str, Any]:
        return {"train_tokens": int(self.train.size), "val_tokens": int(self.val.size),
                "train_files": self.train_files, "val_files": self.val_files,
                "vocab_size": VOCAB_SIZE, "sha256": self.digest}


def load_corpus(megabytes: float, root: Path | None = None) -> Corpus:
    """Read files of :func:`corpus_files` in order until ``megabytes * 10**6`` bytes are read
    and the validation split holds at least one file; file ``i`` goes to validation when
    ``i % VAL_EVERY == VAL_EVERY - 1``.

    Raises ``ValueError`` when ``megabytes <= 0`` or the directory has too few files.
    """
    if not megabytes > 0:
        raise ValueError(f"corpus size must be > 0 MB, got {megabytes}")
    budget = int(megabytes * 1e6)
    train_parts: list[npt.NDArray[np.uint8]] = []
    val_parts: list[npt.NDArray[np.uint8]] = []
    total = 0
    files = corpus_files(root)
    for i, path in enumerate(files):
        if total >= budget and val_parts:
            break
        tokens = encode(path.read_bytes())
        (val_parts if i % VAL_EVERY == VAL_EVERY - 1 else train_parts).append(tokens)
        total += tokens.size
    if not val_parts or not train_parts:
        raise ValueError(f"need at least {VAL_EVERY} source files, found {len(files)}")
    train = np.concatenate(train_parts)
    val = np.concatenate(val_parts)
    h = hashlib.sha256()
    h.update(np.int64(train.size).tobytes())
    h.update(train.tobytes())
    h.update(val.tobytes())
    return Corpus(train, val, len(train_parts), len(val_parts), h.hexdigest())


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from ``tokens``; rank-specific stream.

    ``next()`` returns ``(x, y)``, int64 tensors of shape ``(batch_size, seq_len)`` with
    ``y[:, t] == x[:, t + 1]`` along the stream. Window starts are drawn uniformly by
    ``numpy.random.default_rng([seed, rank])``.
    """

    def __init__(self, tokens: npt.NDArray[np.uint8], batch_size: int, seq_len: int,
                 seed: int, rank: int) -> None:
        if tokens.size < seq_len + 2:
            raise ValueError(f"{tokens.size} tokens are too few for windows of {seq_len + 1}")
        self._tokens = tokens
        self._batch = batch_size
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self._rng = np.random.default_rng([seed, rank])

    def state(self) -> dict[str, Any]:
        """The generator's state (the data position), for checkpoints."""
        return dict(self._rng.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`: the next batches are those that followed it."""
        self._rng.bit_generator.state = state

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._rng.integers(0, self._tokens.size - self._offsets.size + 1,
                                    size=self._batch)
        return windows(self._tokens, starts, self._offsets.size - 1)


def windows(tokens: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64],
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the windows starting at ``starts``: int64 tensors of shape
    ``(len(starts), seq_len)``."""
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return y


class CharTransformer(nn.Module):
    """A GPT-style character model: token + learned position embeddings, ``layers`` blocks,
    final LayerNorm and a linear head.

    ``forward(x)`` takes int64 tokens of shape ``(batch, t)`` with ``t <= seq_len`` and returns
    float32 logits of shape ``(batch, t, vocab_size)``. Weights are drawn from the global torch
    generator (seed it identically on every rank for identical replicas): normal(0, 0.02),
    residual projections scaled by ``1/sqrt(2 * layers)``, biases zero.
    """

    def __init__(self, vocab_size: int, d_model: int, layers: int, heads: int,
                 seq_len: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        return logits


@dataclass(frozen=True)
class ModelShape:
    """A ``--model`` preset: width, depth and heads (``approx_params`` at ``--seq-len 128``)."""

    d_model: int
    layers: int
    heads: int
    approx_params: str


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(128, 2, 4, "0.44M"),
    "small": ModelShape(384, 6, 6, "10.8M"),
    "medium": ModelShape(512, 10, 8, "31.7M"),
}
"""``--model`` presets; ``--d-model``, ``--layers`` and ``--heads`` override their values."""

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
"""``--dtype`` values: the dtype of the forward and backward computation."""


#: Whether lioncub's DistributedLion takes parameters of any device and of 16-bit dtypes (its
#: torch engine); otherwise it takes float32 CPU tensors only and train.py keeps float32
#: parameters (autocast for 16-bit compute, a host copy for --device cuda).
OPTIMIZER_TAKES_DEVICE_PARAMS: bool = "backend" in inspect.signature(
    DistributedLion.__init__).parameters


def autocast(device: str, dtype: torch.dtype) -> AbstractContextManager[Any]:
    """``torch.autocast(device, dtype)`` for a 16-bit ``dtype``, a no-op for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class HostParams:
    """Float32 CPU copies of a model's parameters, for an optimizer that works on host memory
    while the model runs on another device.

    ``named()`` gives ``(name, host tensor)`` pairs to build the optimizer on;
    :meth:`pull_grads` copies the device gradients into the host tensors' ``grad`` (None stays
    None), :meth:`push_params` the updated host values back onto the device, and
    :meth:`pull_params` the device values to the host (after loading a checkpoint into the
    model)."""

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._device = [p for _, p in named]
        self._host = [p.detach().to("cpu", torch.float32).clone().requires_grad_(p.requires_grad)
                      for p in self._device]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self._names, self._host, strict=True))

    @torch.no_grad()
    def pull_grads(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            if d.grad is None:
                h.grad = None
            elif h.grad is None:
                h.grad = d.grad.to("cpu", torch.float32)
            else:
                h.grad.copy_(d.grad)

    @torch.no_grad()
    def push_params(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            d.copy_(h, non_blocking=True)

    @torch.no_grad()
    def pull_params(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            h.copy_(d)


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


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def _int_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return check


_positive_int = _int_from(1)
_nonneg_int = _int_from(0)


def _float_in(low: float, high: float, *, low_open: bool = False) -> Any:
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (value > low if low_open else value >= low) and value <= high
        if not ok or math.isnan(value):
            lo = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {lo}{low:g}, {high:g}], got {text}")
        return value
    return check


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` except for options whose default is None or False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # the launch lines' options (--nproc-per-node) must not be broken at their hyphens
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (``--help`` lists every option with its default)."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Data-parallel training of a character-level transformer on the Python "
                    "standard library's sources with Lion Cub or one of its baselines. Run it "
                    "with `python -m launch -n N train.py`, `mpiexec -n N python train.py` or "
                    "plainly on one rank.",
        epilog="launch lines: `python -m launch -n 4 train.py` (one host); "
               "`torchrun --nproc-per-node 4 train.py` (torchrun's environment); "
               "`torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
               "--rdzv-endpoint HOST:29500 train.py` (two hosts); "
               "`srun -N 4 --ntasks-per-node 1 python train.py` (Slurm); "
               "`mpiexec -n 4 python train.py` (MPI). Add `--backend gloo --hook` for "
               "DistributedDataParallel with the votes inside backward. The first step "
               "compiles bitcoll's and lioncub's kernels (cached for later runs).",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="lioncub-l1", choices=list(lioncub.VARIANTS),
                   metavar="NAME",
                   help="distributed Lion variant, one of: " + ", ".join(lioncub.VARIANTS))
    g.add_argument("--lr", type=_float_in(0.0, 1.0, low_open=True), default=3e-4,
                   help="peak learning rate")
    g.add_argument("--weight-decay", type=_float_in(0.0, 10.0), default=0.0,
                   help="decoupled weight decay (theta *= 1 - lr * wd per step)")
    g.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning-rate schedule after warm-up (cosine decays to lr/10)")
    g.add_argument("--warmup", type=_nonneg_int, default=None,
                   help="linear warm-up steps (default: 5%% of --steps)")
    g.add_argument("--levels", type=_positive_int, default=None,
                   help="quantization levels s of the lioncub-l1/l0/linf votes (in [-s, s]); "
                        "default: the optimizer's own")
    g.add_argument("--momentum-sync", default=None, metavar="SPEC",
                   help="momentum synchronization schedule, passed to the optimizer: none, "
                        "every:K, exp:K[:START], early:S[:EVERY], "
                        "adaptive:T[:MIN_INTERVAL[:WARMUP]], optionally followed by "
                        "@GLOB[,GLOB...] (default: the optimizer's own)")
    g.add_argument("--overlap", action="store_true",
                   help="start each bucket's votes and collective during the backward pass as "
                        "soon as its gradients are final (lioncub's overlap=True; the "
                        "optimizer gets a communicator of its own); not with --dtype fp16 "
                        "(the gradients are unscaled only after backward)")
    g.add_argument("--stale", action="store_true",
                   help="one-step-stale updates for slow or far links: each step's exchange "
                        "runs during the next step's forward and backward pass, its update is "
                        "applied one step late (lioncub's stale=True; float32 on the CPU, not "
                        "with --overlap or --backend)")
    g = p.add_argument_group("DistributedDataParallel")
    g.add_argument("--backend", choices=("bitcoll", "gloo"), default=None,
                   help="wrap the model in torch's DistributedDataParallel over a process "
                        "group of this torch.distributed backend (default: no DDP, the "
                        "optimizer does all the communication)")
    g.add_argument("--hook", nargs="?", const="lioncub", default=None,
                   choices=("lioncub", "sign"),
                   help="with --backend: vote inside DDP's backward, bucket by bucket: "
                        "'lioncub' (also plain --hook: the --optimizer variant's votes, "
                        "bitwise DistributedLion) or 'sign' (packed majority of gradient signs "
                        "with error feedback, then AdamW)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=_positive_int, default=400, help="training steps")
    g.add_argument("--seed", type=_nonneg_int, default=0,
                   help="model initialisation seed (same on every rank); rank r samples its "
                        "batches with default_rng([seed, r])")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per rank")
    g.add_argument("--seq-len", type=_positive_int, default=128, help="characters per sequence")
    g.add_argument("--eval-every", type=_nonneg_int, default=50,
                   help="validation every N steps (0: only before and after training)")
    g.add_argument("--eval-batches", type=_positive_int, default=4,
                   help="validation batches per rank")
    g.add_argument("--corpus-mb", type=_float_in(0.0, 1000.0, low_open=True), default=2.0,
                   help="corpus size in MB (10**6 bytes), validation included")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per rank (default: usable cores // ranks on this host, "
                        "at least 1)")
    g.add_argument("--comm-timeout", type=_float_in(0.0, 86400.0, low_open=True),
                   default=300.0, help="deadline of every collective, seconds")
    g.add_argument("--no-comm", action="store_true",
                   help="compute floor: every rank trains its own replica on its own batches "
                        "with the optimizer on a one-rank communicator (nothing exchanged; "
                        "replicas diverge and are not checked; the validation loss is the mean "
                        "over the replicas)")
    g.add_argument("--check-every", type=_nonneg_int, default=100, metavar="N",
                   help="compare a digest of the parameters across the ranks every N steps "
                        "(0: only after training); differing replicas stop the run naming "
                        "the rank")
    g.add_argument("--target-loss", type=_float_in(0.0, 100.0, low_open=True), default=None,
                   metavar="X", help="report the step and time at which the validation loss "
                                     "first reaches X (checked at every evaluation)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(PRESETS), default="tiny",
                   help="size preset: " + ", ".join(
                       f"{k} (d_model {v.d_model}, {v.layers} layers, {v.heads} heads, "
                       f"~{v.approx_params})" for k, v in PRESETS.items())
                   + "; --d-model, --layers and --heads override its values")
    g.add_argument("--d-model", type=_positive_int, default=None,
                   help="embedding width (default: the preset's)")
    g.add_argument("--layers", type=_positive_int, default=None,
                   help="transformer blocks (default: the preset's)")
    g.add_argument("--heads", type=_positive_int, default=None,
                   help="attention heads (default: the preset's)")
    g = p.add_argument_group("precision and device")
    g.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="compute dtype: fp32, or bf16/fp16 through torch.autocast (parameters, "
                        "gradients, momenta and the exchanged votes stay float32; fp16 adds "
                        "dynamic loss scaling, overflowing steps are skipped on every rank)")
    g.add_argument("--native", action="store_true",
                   help="keep the parameters themselves in --dtype (no autocast, no float32 "
                        "copy; the optimizer updates 16-bit parameters); needs a lioncub whose "
                        "DistributedLion takes 16-bit and device parameters")
    g.add_argument("--momentum-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the optimizer's momentum buffers (bf16 halves the optimizer "
                        "state; same lioncub requirement as --native)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs; the optimizer takes the device's parameters "
                        "when lioncub supports it, else it works on a float32 host copy "
                        "(gradients copied to the host, parameters back, every step)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", type=Path, default=None, metavar="DIR",
                   help="write a checkpoint to DIR (one rank<r>.pt per rank) at the end of the "
                        "run (and every --save-every steps)")
    g.add_argument("--save-every", type=_nonneg_int, default=0, metavar="N",
                   help="also checkpoint every N steps (0: only at the end)")
    g.add_argument("--stop-after", type=_positive_int, default=None, metavar="STEP",
                   help="stop after STEP of the --steps schedule (with --save: to continue "
                        "later with --resume)")
    g.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue the run checkpointed in DIR (same ranks and training "
                        "options): model, optimizer state, random generators, data position, "
                        "step and log are restored, so the continued run equals an "
                        "uninterrupted one bit for bit")
    g = p.add_argument_group("output")
    g.add_argument("--json-log", type=Path, default=None, metavar="PATH",
                   help="write the per-step / per-eval log, config and summary here (rank 0)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar or periodic step lines (evaluations and the summary "
                        "are still printed)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the options; exits with status 2 and a message on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.model]
    for name in ("d_model", "layers", "heads"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
        parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__} {why}); "
                     "use --device cpu")
    if args.stop_after is not None and args.stop_after > args.steps:
        parser.error(f"--stop-after {args.stop_after} must not exceed --steps {args.steps}")
    if args.save_every and args.save is None:
        parser.error("--save-every needs --save DIR")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if (args.d_model // args.heads) % 2:
        parser.error(f"--d-model / --heads = {args.d_model // args.heads} must be even")
    try:
        if args.momentum_sync is not None:
            parse_sync(args.momentum_sync)
        if args.levels is not None:
            check_levels(args.levels)
    except UsageError as exc:
        parser.error(str(exc))
    if args.overlap and args.dtype == "fp16":
        parser.error("--overlap cannot be used with --dtype fp16: loss scaling unscales the "
                     "gradients after backward, when overlapped buckets have already started")
    if args.overlap and args.device == "cuda" and not OPTIMIZER_TAKES_DEVICE_PARAMS:
        parser.error("--overlap with --device cuda needs a lioncub whose DistributedLion "
                     "takes device parameters")
    if args.stale:
        for flag, bad in (("--overlap", args.overlap), ("--backend", args.backend is not None),
                          ("--device cuda", args.device != "cpu"),
                          ("--dtype other than fp32", args.dtype != "fp32"),
                          ("--momentum-dtype bf16", args.momentum_dtype != "fp32"),
                          ("--native", args.native)):
            if bad:
                parser.error(f"--stale cannot be used with {flag} (lioncub's stale mode "
                             "runs on its numpy core: float32 parameters on the CPU)")
    if args.hook is not None and args.backend is None:
        parser.error("--hook needs --backend bitcoll or gloo (DistributedDataParallel)")
    if args.backend is not None:
        for flag, bad in (("--overlap", args.overlap), ("--native", args.native),
                          ("--momentum-dtype bf16", args.momentum_dtype != "fp32"),
                          ("--device cuda", args.device != "cpu"),
                          ("--dtype fp16", args.dtype == "fp16")):
            if bad:
                parser.error(f"{flag} cannot be used with --backend (DDP mode takes fp32 or "
                             "bf16 autocast on the CPU)")
    if args.warmup is None:
        args.warmup = args.steps // 20
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    return args


# --------------------------------------------------------------------------------------------
# Output on rank 0
# --------------------------------------------------------------------------------------------


def _fmt_duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


class Progress:
    """Rank 0's progress display on ``stream``.

    On a terminal one line is redrawn with carriage returns (at most 10 times a second); on
    anything else a plain line is printed every ``max(1, total // 20)`` steps and at the end.
    ``note()`` prints a message on its own line without breaking the bar.
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool, start: int = 0) -> None:
        self.total = total
        self.start = start
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = max(1, total // 20)
        self._last_draw = 0.0
        self._width = 0
        self._start = time.perf_counter()
        self._first_done: float | None = None

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0

    def update(self, step: int, loss: float, step_time: float, compute: float, comm: float,
               sent: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self._start
        # The first step includes one-time set-up (kernel compilation, buffers): the ETA uses
        # the pace of the later steps.
        if step == self.start + 1 or self._first_done is None:
            self._first_done = now
            eta = step_time * (self.total - step)
        else:
            eta = (now - self._first_done) / (step - self.start - 1) * (self.total - step)
        if self.tty:
            if now - self._last_draw < 0.1 and step < self.total:
                return
            self._last_draw = now
            width = 20
            filled = int(width * step / self.total)
            bar = "#" * filled + "." * (width - filled)
            line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] "
                    f"loss {loss:.4f}  {step_time * 1e3:.0f} ms/step "
                    f"(comm {comm * 1e3:.0f} ms, sent {format_bytes(sent)})  "
                    f"ETA {_fmt_duration(eta)}")
            line = line[:max(20, shutil.get_terminal_size().columns - 1)]
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
            if step == self.total:
                self.stream.write("\n")
                self._width = 0
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(
                f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
                f"step {step_time * 1e3:.0f} ms (compute {compute * 1e3:.0f} ms, "
                f"comm {comm * 1e3:.0f} ms)  sent {format_bytes(sent)}/step  "
                f"elapsed {_fmt_duration(elapsed)}  ETA {_fmt_duration(eta)}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()


def format_summary(summary: dict[str, Any]) -> str:
    """The final summary as a two-column text table."""
    step_t = summary["mean_step_time"]
    fb_t = summary["mean_forward_backward_time"]
    opt_t = summary["mean_optimizer_time"]
    comm_t = summary["mean_comm_time"]
    identical = summary["replicas_identical"]
    target = summary["target_reached"]

    def share(t: float) -> str:
        return f"{100 * t / step_t:.0f}%" if step_t > 0 else "-"

    rows = [
        ("optimizer", summary["optimizer"] + (" (--no-comm)" if summary["no_comm"] else "")),
        ("world size", f"{summary['world_size']} ({summary['backend']})"),
        ("model", f"{summary['model']}, {summary['n_params'] / 1e6:.2f}M parameters, "
                  f"{summary['dtype']}{' ' + summary['precision'] if summary['precision'] else ''} "
                  f"on {summary['device']}"),
        ("steps", str(summary["steps"]) if summary["steps_done"] == summary["steps"]
         else f"{summary['steps_done']} of {summary['steps']}"),
        ("final train loss", f"{summary['final_train_loss']:.4f} "
                             f"(mean of last {summary['final_train_window']} steps)"),
        ("final val loss", f"{summary['final_val_loss']:.4f}"),
        ("mean step time", f"{step_t * 1e3:.1f} ms"),
        ("  forward + backward", f"{fb_t * 1e3:.1f} ms ({share(fb_t)})"),
        ("  optimizer", f"{opt_t * 1e3:.1f} ms ({share(opt_t)})"),
        ("  communication", f"{comm_t * 1e3:.1f} ms ({share(comm_t)})"),
        ("first step (warm-up)", f"{summary['first_step_time'] * 1e3:.0f} ms (comm "
                                 f"{summary['first_step_comm'] * 1e3:.0f} ms), not in the means"),
        ("bytes sent / step", f"{format_bytes(summary['bytes_sent_per_step'])} per rank"),
        ("bytes received / step", f"{format_bytes(summary['bytes_received_per_step'])} per rank"),
        ("replicas identical", "not checked (--no-comm)" if identical is None
         else "yes" if identical else "NO"),
        ("total wall time", _fmt_duration(summary["wall_time"])),
    ]
    if summary["target_loss"] is not None:
        rows.insert(6, (f"val loss <= {summary['target_loss']:g}",
                        "not reached" if target is None else
                        f"step {target['step']}, {target['step_seconds']:.1f} s of steps "
                        f"({target['elapsed']:.1f} s elapsed)"))
    if summary["skipped_steps"]:
        rows.insert(3, ("skipped (fp16 overflow)", str(summary["skipped_steps"])))
    w = max(len(k) for k, _ in rows)
    v = max(len(str(val)) for _, val in rows)
    rule = "+" + "-" * (w + 2) + "+" + "-" * (v + 2) + "+"
    lines = [rule] + [f"| {k:<{w}} | {val:<{v}} |" for k, val in rows] + [rule]
    return "\n".join(lines)


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def default_threads(local_size: int) -> int:
    """Torch threads per rank when ``--threads`` is not given: the usable cores divided by the
    ranks on this host (``comm.local_size``, as bitcoll shares them among its kernels), at
    least 1."""
    return max(1, bitcoll.kernels.usable_cores() // max(1, local_size))


def _digest48(data: bytes) -> float:
    """48 bits of SHA-256 as a float64 (exact), for cross-rank equality checks."""
    return float(int.from_bytes(hashlib.sha256(data).digest()[:6], "little"))


def _params_digest(model: nn.Module) -> float:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return _digest48(h.digest())


def _same_on_all_ranks(comm: bitcoll.Communicator, values: Sequence[float]) -> list[bool]:
    """For each value, whether every rank holds the same one (two small all-reduces)."""
    x = np.asarray(values, dtype=np.float64)
    hi = np.asarray(comm.allreduce(x.copy(), op="max"))
    lo = np.asarray(comm.allreduce(x.copy(), op="min"))
    return [bool(a == b) for a, b in zip(hi, lo, strict=True)]


@torch.no_grad()
def evaluate(model: nn.Module, comm: bitcoll.Communicator, val: npt.NDArray[np.uint8],
             batch_size: int, seq_len: int, eval_batches: int, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> float:
    """Mean validation cross-entropy (nats/token) over ``eval_batches * batch_size * size``
    evenly spaced windows, split over the ranks (every rank returns the same value); the
    forward pass runs on ``device`` in ``dtype`` (autocast) as in training."""
    total = eval_batches * batch_size * comm.size
    starts = np.linspace(0, val.size - seq_len - 1, total).astype(np.int64)[comm.rank::comm.size]
    model.eval()
    acc = np.zeros(2, dtype=np.float64)
    for i in range(0, starts.size, batch_size):
        x, y = windows(val, starts[i:i + batch_size], seq_len)
        with autocast(device, dtype):
            loss = _loss(model, x.to(device), y.to(device))
        acc[0] += float(loss) * y.numel()
        acc[1] += y.numel()
    model.train()
    acc = np.asarray(comm.allreduce(acc, op="sum"))
    return float(acc[0] / acc[1])


def _optimizer_figures(opt: Any, stale: bool = False
                       ) -> tuple[float, int, int, int, float | None]:
    """(comm s, bytes sent, bytes received, tensors whose momentum was synced, mean vote
    agreement or None) of the last ``opt.step()`` on this rank (a :class:`DDPOptimizer`
    without lioncub statistics: zeros; in the hook modes the communication time is part of
    the backward pass: 0). ``stale``: the statistics are those of the step before, whose
    update this step applied (its communication time: the wait that was not hidden); zeros
    after the first step."""
    stats = opt.last_stats
    if stats is None:
        if isinstance(opt, DDPOptimizer) or stale:
            return 0.0, 0, 0, 0, None
        raise RuntimeError("the optimizer reported no statistics after its step")
    agreement = None
    if stats.agreement:
        agreement = float(np.mean(list(stats.agreement.values())))
    return (float(stats.comm_seconds), int(stats.bytes_sent), int(stats.bytes_received),
            len(stats.synced), agreement)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "lioncub-train-checkpoint/1"
#: Options that shape the training trajectory: a resumed run must use the checkpoint's values.
TRAJECTORY_KEYS = ("optimizer", "lr", "weight_decay", "schedule", "warmup", "levels",
                   "momentum_sync", "steps", "seed", "batch_size", "seq_len", "corpus_mb",
                   "d_model", "layers", "heads", "dtype", "native", "momentum_dtype", "device",
                   "no_comm", "backend", "hook")


def checkpoint_file(directory: Path, rank: int) -> Path:
    """Rank ``rank``'s file of the checkpoint in ``directory``."""
    return directory / f"rank{rank}.pt"


def _agree(comm: bitcoll.Communicator, error: str | None, what: str) -> None:
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
    _agree(comm, error, "writing the checkpoint")


def load_checkpoint(directory: Path, comm: bitcoll.Communicator,
                    args: argparse.Namespace) -> dict[str, Any]:
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
    _agree(comm, error, "reading the checkpoint")
    if not _same_on_all_ranks(comm, [float(state["step"])])[0]:
        raise RuntimeError(f"the files of {directory} are not all from the same step")
    return state


# --------------------------------------------------------------------------------------------
# DistributedDataParallel mode (--backend)
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_process_group(backend: str, comm: bitcoll.Communicator, solo: bool,
                       timeout: float) -> None:
    """``torch.distributed.init_process_group(backend)`` for the ranks of ``comm``: through
    torchrun's store under torchrun, else a TCP store on a free port of rank 0's
    ``MASTER_ADDR`` (default 127.0.0.1), the port broadcast over ``comm``. ``solo``: every
    rank a one-rank group of its own (``--no-comm``)."""
    import torch.distributed as dist

    if backend == "bitcoll":
        importlib.import_module("bitcoll.torch")  # registers the backend
    limit = datetime.timedelta(seconds=timeout)
    if solo:
        store = dist.HashStore()  # type: ignore[attr-defined]  # not in torch's stubs
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=limit)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, init_method="env://", rank=comm.rank,
                                world_size=comm.size, timeout=limit)
    else:
        port = np.array([_free_port() if comm.rank == 0 else 0], dtype=np.int64)
        comm.broadcast(port, 0)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{int(port[0])}",
                                rank=comm.rank, world_size=comm.size, timeout=limit)


class DDPOptimizer:
    """DDP mode's optimizer (see the module docstring), with the parts of
    DistributedLion's interface that the training loop uses: ``param_groups``,
    ``zero_grad``, ``step``, ``last_stats``, ``check_replicas``, ``state_dict`` and
    ``load_state_dict``. ``net`` is the DDP-wrapped model (for the training forward).
    Collective construction (DDP's broadcast of rank 0's parameters, the hook's
    communicator and agreement check)."""

    def __init__(self, args: argparse.Namespace, model: nn.Module,
                 named: Sequence[tuple[str, torch.Tensor]], comm: bitcoll.Communicator,
                 opt_comm: bitcoll.Communicator) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.net = DDP(model)
        self.comm = opt_comm
        self.named = named
        self.hooked = args.hook is not None
        self.hook_state: LionCubHookState | None = None
        self.sign_state: SignHookState | None = None
        self.inner: DistributedLion | None = None
        # the hooks' communicator: the bitcoll group's own (the hook splits a private one
        # off it), or one split off bitcoll.init()'s, so train.py's calls never meet them
        hook_comm = None if args.backend == "bitcoll" else opt_comm
        params = [p for _, p in named]
        self.opt: Any
        if args.hook == "lioncub":
            self.opt = LionCubStep(named, lr=args.lr, betas=(0.9, 0.99),
                                   weight_decay=args.weight_decay)
            self.hook_state = LionCubHookState(self.opt, hook_comm, variant=args.optimizer,
                                               levels=args.levels,
                                               momentum_sync=args.momentum_sync, private=True)
            self.net.register_comm_hook(self.hook_state, lioncub_hook)
        elif args.hook == "sign":
            self.opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
            self.sign_state = SignHookState(hook_comm, private=True)
            self.net.register_comm_hook(self.sign_state, sign_hook)
        elif args.optimizer == "global":  # DDP averages the gradients: Lion on the mean
            self.opt = Lion(params, lr=args.lr, betas=(0.9, 0.99),
                            weight_decay=args.weight_decay)
        else:  # local gradients, votes after backward
            self.net.register_comm_hook(None, no_allreduce_hook)
            self.inner = self.opt = DistributedLion(
                named, opt_comm, variant=args.optimizer, lr=args.lr, betas=(0.9, 0.99),
                weight_decay=args.weight_decay, levels=args.levels,
                momentum_sync=args.momentum_sync)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.opt.param_groups
        return groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()

    @property
    def last_stats(self) -> StepStats | None:
        """lioncub's statistics of the last step (the hook's or DistributedLion's), None for
        DDP's own averaging and the sign hook."""
        if self.hook_state is not None:  # the votes travelled during backward
            stats = self.hook_state.last_stats
            return None if stats is None else dataclasses.replace(stats, comm_seconds=0.0)
        return None if self.inner is None else self.inner.last_stats

    def check_replicas(self) -> None:
        """Collective: ReplicaMismatchError on every rank unless every rank's parameters are
        bitwise rank 0's."""
        if self.inner is not None:
            self.inner.check_replicas()
        elif self.hook_state is not None:
            self.hook_state.check_replicas()
        else:
            ReplicaSet([p.detach().numpy() for _, p in self.named],
                       [n for n, _ in self.named]).check(self.comm)

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.opt.state_dict()}
        if self.hook_state is not None:  # momenta as tensors (checkpoints load weights only)
            hook = self.hook_state.state_dict()
            hook["momentum"] = [torch.from_numpy(m) for m in hook["momentum"]]
            state["hook"] = hook
        if self.sign_state is not None:
            errors = self.sign_state.errors
            state["errors"] = [errors.get(p) for _, p in self.named]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.hook_state is not None:
            hook = dict(state["hook"])
            hook["momentum"] = [m.numpy() for m in hook["momentum"]]
            self.hook_state.load_state_dict(hook)
        if self.sign_state is not None:
            for (_, p), e in zip(self.named, state["errors"], strict=True):
                if e is not None:
                    self.sign_state.errors[p] = e.clone()

    def close(self) -> None:
        for st in (self.hook_state, self.sign_state):
            if st is not None:
                st.close()


def _replica_error(exc: ReplicaMismatchError, when: str) -> RuntimeError:
    return RuntimeError(f"the model replicas differ {when} (rank {exc.rank}'s parameter "
                        f"{exc.index} ({exc.name}) differs from rank 0's; "
                        f"{len(exc.indices)} parameters differ): the optimizer applied "
                        "different updates on different ranks")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, comm: bitcoll.Communicator,
        out: TextIO | None = None) -> dict[str, Any]:
    """Train as configured by ``args`` (see :func:`parse_args`) on communicator ``comm``.

    Returns the log record (config, run, steps, evals, summary); identical on every rank
    except for progress output, which only rank 0 writes to ``out`` (default stdout). Raises
    ``bitcoll.errors.CommError`` when a collective fails, ``RuntimeError`` when the ranks
    disagree on the corpus or the initial model, or a checkpoint cannot be written, read or
    does not fit the run.
    """
    stream = sys.stdout if out is None else out
    rank = comm.rank
    lead = rank == 0
    wall0 = time.perf_counter()
    device, dtype = args.device, DTYPES[args.dtype]

    def say(text: str) -> None:
        if lead:
            stream.write(text + "\n")
            stream.flush()

    threads = args.threads or default_threads(comm.local_size)
    torch.set_num_threads(threads)

    corpus = load_corpus(args.corpus_mb)
    for name, split in (("training", corpus.train), ("validation", corpus.val)):
        if split.size < args.seq_len + 2:
            raise ValueError(f"the {name} split has {split.size} tokens, fewer than "
                             f"--seq-len + 2; raise --corpus-mb")

    torch.manual_seed(args.seed)
    model = CharTransformer(VOCAB_SIZE, args.d_model, args.layers, args.heads, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    same = _same_on_all_ranks(comm, [_digest48(corpus.digest.encode()), _params_digest(model)])
    if not same[0]:
        raise RuntimeError("the ranks built different corpora (different Python installations?)")
    if not same[1]:
        raise RuntimeError("the ranks initialised different models (different torch builds?)")
    device_params = OPTIMIZER_TAKES_DEVICE_PARAMS
    kwargs: dict[str, Any] = {}
    if (args.native and dtype != torch.float32) or args.momentum_dtype != "fp32":
        if not device_params:
            raise RuntimeError("--native and --momentum-dtype bf16 need a lioncub whose "
                               "DistributedLion takes 16-bit parameters; this one takes "
                               "float32 CPU parameters only (drop them to use autocast)")
        if args.momentum_dtype != "fp32":
            kwargs["momentum_dtype"] = DTYPES[args.momentum_dtype]
    if args.native:
        model.to(device=device, dtype=dtype)
        dtype = torch.float32  # no autocast: the parameters are in --dtype already
    else:
        model.to(device)
    host = HostParams(model) if device != "cpu" and not device_params else None
    named = host.named() if host is not None else list(model.named_parameters())
    params = [p for _, p in named]

    # --no-comm: each rank its own one-rank communicator (the compute floor). --overlap: the
    # optimizer's collectives start inside backward(), so it gets a communicator of its own
    # (train.py's own all-reduces then never interleave with them).
    # --stale: the exchange runs on while train.py's own all-reduces go on: a communicator of
    # its own as well (a synchronous call would otherwise wait for it).
    opt_comm = comm.split(rank) if args.no_comm else \
        comm.split(0) if args.overlap or args.stale else comm
    if args.overlap:
        kwargs["overlap"] = True
    if args.stale:
        kwargs["stale"] = True
    assert opt_comm is not None
    try:
        if args.backend is not None:
            return _run_ddp(args, comm, opt_comm, model, named, params, corpus, n_params,
                            threads, stream, say, wall0, device, dtype)
        opt = DistributedLion(named, opt_comm, variant=args.optimizer, lr=args.lr,
                              betas=(0.9, 0.99), weight_decay=args.weight_decay,
                              levels=args.levels, momentum_sync=args.momentum_sync, **kwargs)
        return _train(args, comm, opt_comm, opt, model, model, host, params, corpus, n_params,
                      threads, stream, say, wall0, device, dtype)
    finally:
        if opt_comm is not comm:
            opt_comm.close()


def _run_ddp(args: argparse.Namespace, comm: bitcoll.Communicator,
             opt_comm: bitcoll.Communicator, model: nn.Module,
             named: Sequence[tuple[str, torch.Tensor]], params: list[torch.Tensor],
             corpus: Corpus,
             n_params: int, threads: int, stream: TextIO, say: Any, wall0: float, device: str,
             dtype: torch.dtype) -> dict[str, Any]:
    """:func:`run` in DDP mode (``--backend``): the process group, DDP and its optimizer
    around the same training loop."""
    import torch.distributed as dist

    init_process_group(args.backend, comm, args.no_comm, args.comm_timeout)
    opt: DDPOptimizer | None = None
    try:
        opt = DDPOptimizer(args, model, named, comm, opt_comm)
        return _train(args, comm, opt_comm, opt, model, opt.net, None, params, corpus,
                      n_params, threads, stream, say, wall0, device, dtype)
    finally:
        if opt is not None:
            opt.close()
        dist.destroy_process_group()


def _train(args: argparse.Namespace, comm: bitcoll.Communicator,
           opt_comm: bitcoll.Communicator, opt: Any, model: nn.Module, net: nn.Module,
           host: HostParams | None, params: list[torch.Tensor], corpus: Corpus, n_params: int,
           threads: int, stream: TextIO, say: Any, wall0: float, device: str,
           dtype: torch.dtype) -> dict[str, Any]:
    """The training loop of :func:`run` (``net``: the module to train through, ``model`` or
    its DDP wrapper; ``opt``: DistributedLion or a :class:`DDPOptimizer`)."""
    rank, size = comm.rank, comm.size
    lead = rank == 0
    cuda = device == "cuda"
    sampler = BatchSampler(corpus.train, args.batch_size, args.seq_len, args.seed, rank)
    scaler = LossScale(args.dtype == "fp16")
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    start_step = 0
    elapsed0 = 0.0
    if args.resume is not None:
        ckpt = load_checkpoint(args.resume, comm, args)
        model.load_state_dict(ckpt["model"])
        if host is not None:
            host.pull_params()
        opt.load_state_dict(ckpt["optimizer"])
        sampler.set_state(ckpt["sampler"])
        torch.set_rng_state(ckpt["torch_rng"])
        scaler.load_state_dict(ckpt["loss_scale"])
        steps, evals = list(ckpt["steps"]), list(ckpt["evals"])
        start_step, elapsed0 = int(ckpt["step"]), float(ckpt["elapsed"])
    stop = args.steps if args.stop_after is None else args.stop_after

    backend = comm.backend
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}
    run_info = {
        "world_size": size, "backend": backend, "threads_per_rank": threads,
        "n_params": n_params, "corpus": corpus.describe(),
        "tokens_per_step": args.batch_size * args.seq_len * size,
        "python": platform.python_version(), "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_at": start_step,
    }
    ddp = ""
    if args.backend is not None:
        ddp = f", DDP over {args.backend}" + (f" with the {args.hook} hook" if args.hook
                                               else "")
    say(f"train.py: {args.optimizer} on {size} rank{'s' if size > 1 else ''} ({backend}), "
        f"{threads} torch thread{'s' if threads > 1 else ''} per rank{ddp}"
        + (", no communication (--no-comm)" if args.no_comm else ""))
    say(f"model: {args.model} preset, {n_params / 1e6:.2f}M parameters (d_model "
        f"{args.d_model}, {args.layers} layers, {args.heads} heads); batch {args.batch_size} x "
        f"{args.seq_len} characters per rank; {args.dtype}"
        f"{' parameters' if args.native else ' autocast' if args.dtype != 'fp32' else ''} on "
        f"{device}")
    say(f"corpus: {corpus.train.size / 1e6:.2f} MB training ({corpus.train_files} files), "
        f"{corpus.val.size / 1e6:.2f} MB validation ({corpus.val_files} files) of the Python "
        f"standard library")
    if start_step:
        say(f"resumed from {args.resume} at step {start_step}")

    progress = Progress(stop, stream, lead and not args.no_progress, start=start_step)
    train_start = time.perf_counter() - elapsed0
    target: dict[str, Any] | None = None
    if args.target_loss is not None:
        target = next(({"step": e["step"], "val_loss": e["val_loss"], "elapsed": e["elapsed"],
                        "step_seconds": e.get("step_seconds", 0.0)}
                       for e in evals if e["val_loss"] <= args.target_loss), None)

    def step_seconds(upto: int) -> float:
        """Sum of the step times of steps 1..upto, warm-up steps left out."""
        return float(sum(s["time"] for s in steps[:upto] if not s.get("warmup")))

    def do_eval(step: int) -> None:
        nonlocal target
        if args.stale:
            opt.flush()  # the update in flight, before the parameters are read
        val_loss = evaluate(model, comm, corpus.val, args.batch_size, args.seq_len,
                            args.eval_batches, device, dtype)
        if not math.isfinite(val_loss):
            raise RuntimeError(f"validation loss is {val_loss} at step {step}")
        rec = {"step": step, "val_loss": val_loss,
               "elapsed": time.perf_counter() - train_start, "step_seconds": step_seconds(step)}
        evals.append(rec)
        if lead:
            progress.note(f"step {step:>{len(str(args.steps))}}/{args.steps}  "
                          f"val loss {val_loss:.4f}")
        if args.target_loss is not None and target is None and val_loss <= args.target_loss:
            target = dict(rec)
            if lead:
                progress.note(f"target val loss {args.target_loss:g} reached at step {step}: "
                              f"{rec['step_seconds']:.1f} s of steps, {rec['elapsed']:.1f} s "
                              "elapsed")

    def checkpoint(step: int) -> None:
        if args.stale:
            opt.flush()
        save_checkpoint(args.save, comm, {
            "format": CHECKPOINT_FORMAT, "rank": rank, "world_size": size, "step": step,
            "trajectory": {k: getattr(args, k) for k in TRAJECTORY_KEYS},
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state(), "torch_rng": torch.get_rng_state(),
            "loss_scale": scaler.state_dict(), "steps": steps, "evals": evals,
            "elapsed": time.perf_counter() - train_start})
        say(f"checkpoint of step {step} written to {args.save}")

    if start_step == 0:
        do_eval(0)
    for step in range(start_step + 1, stop + 1):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        if step == start_step + 1:
            say("compiling kernels (first step only) ...")
        t0 = time.perf_counter()
        x, y = sampler.next()
        with autocast(device, dtype):
            loss = _loss(net, x.to(device), y.to(device))
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss * scaler.scale if scaler.enabled else loss)
        loss_value = loss.item()
        if cuda:
            torch.cuda.synchronize()  # the backward pass runs asynchronously
        t1 = time.perf_counter()
        if host is not None:
            host.pull_grads()
        applied = scaler.unscale(params, opt_comm)
        comm_s, sent, received, synced, agreement = 0.0, 0, 0, 0, None
        if applied:
            opt.step()
            comm_s, sent, received, synced, agreement = _optimizer_figures(opt, args.stale)
        if host is not None:
            host.push_params()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        local = np.array([loss_value, t2 - t0, t1 - t0, (t2 - t1) - comm_s, comm_s, sent,
                          received], dtype=np.float64)
        mean = np.asarray(comm.allreduce(local, op="sum")) / size
        if not math.isfinite(mean[0]):
            raise RuntimeError(f"training loss is {mean[0]} at step {step}")
        rec = {"step": step, "lr": lr, "loss": float(mean[0]), "time": float(mean[1]),
               "forward_backward": float(mean[2]), "optimizer": float(mean[3]),
               "compute": float(mean[2] + mean[3]), "comm": float(mean[4]),
               "bytes_sent": float(mean[5]), "bytes_received": float(mean[6]),
               "synced_tensors": synced}
        if step == start_step + 1:
            rec["warmup"] = True
        if not applied:
            rec["skipped"] = True
        if agreement is not None:
            rec["agreement"] = agreement
        steps.append(rec)
        progress.update(step, rec["loss"], rec["time"], rec["compute"], rec["comm"],
                        rec["bytes_sent"])
        if args.check_every and step % args.check_every == 0 and step < stop \
                and not args.no_comm:
            try:
                opt.check_replicas()  # every rank gets the same verdict
            except ReplicaMismatchError as exc:
                raise _replica_error(exc, f"after step {step}") from None
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            do_eval(step)
        if args.save is not None and (step == stop or (args.save_every
                                                       and step % args.save_every == 0)):
            checkpoint(step)
    train_time = time.perf_counter() - train_start

    mismatch: ReplicaMismatchError | None = None
    identical: bool | None = None
    if not args.no_comm:
        try:
            opt.check_replicas()  # every rank gets the same verdict
        except ReplicaMismatchError as exc:
            mismatch = exc
        identical = mismatch is None
    # Mean step figures skip the first three steps of every session (the first one is the
    # warm-up: kernel compilation, buffers; reported on its own).
    sessions = [i for i, s in enumerate(steps) if s.get("warmup")]
    excluded = {i + k for i in sessions for k in range(3)}
    timed = [s for i, s in enumerate(steps) if i not in excluded] or steps[-1:]
    first = steps[sessions[-1]] if sessions else steps[0]
    window = max(1, min(20, len(steps) // 10))

    def mean_of(key: str) -> float:
        return float(np.mean([s[key] for s in timed]))

    summary = {
        "optimizer": args.optimizer, "world_size": size, "backend": backend,
        "model": args.model, "n_params": n_params, "dtype": args.dtype, "device": device,
        "precision": ("native parameters" if args.native else "autocast")
        if args.dtype != "fp32" else "", "momentum_dtype": args.momentum_dtype,
        "no_comm": args.no_comm,
        "steps": args.steps, "steps_done": len(steps),
        "final_train_loss": float(np.mean([s["loss"] for s in steps[-window:]])),
        "final_train_window": window,
        "final_val_loss": evals[-1]["val_loss"],
        "best_val_loss": min(e["val_loss"] for e in evals),
        "mean_step_time": mean_of("time"),
        "mean_forward_backward_time": mean_of("forward_backward"),
        "mean_optimizer_time": mean_of("optimizer"),
        "mean_compute_time": mean_of("compute"),
        "mean_comm_time": mean_of("comm"),
        "timed_steps_skipped": len(steps) - len(timed),
        "first_step_time": first["time"], "first_step_comm": first["comm"],
        "skipped_steps": sum(1 for s in steps if s.get("skipped")),
        "bytes_sent_per_step": float(np.mean([s["bytes_sent"] for s in steps])),
        "bytes_received_per_step": float(np.mean([s["bytes_received"] for s in steps])),
        "target_loss": args.target_loss, "target_reached": target,
        "train_time": train_time,
        "wall_time": time.perf_counter() - wall0,
        "replicas_identical": identical,
    }
    record = {"format": LOG_FORMAT, "config": config, "run": run_info, "steps": steps,
              "evals": evals, "summary": summary}
    if lead:
        stream.write(format_summary(summary) + "\n")
        stream.flush()
        if args.json_log is not None:
            _write_json(args.json_log, record)
            say(f"log written to {args.json_log}")
    if mismatch is not None:
        raise _replica_error(mismatch, "after training")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    rank: int | str = "?"
    try:
        with bitcoll.init(timeout=args.comm_timeout) as comm:
            rank = comm.rank
            run(args, comm)
    except KeyboardInterrupt:
        print(f"train.py: rank {rank}: interrupted", file=sys.stderr)
        return 130
    except (BitcollError, CommError, RuntimeError, ValueError, OSError) as exc:
        print(f"train.py: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
