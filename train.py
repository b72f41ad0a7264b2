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

Timing
------
A step's time covers batch sampling, forward, backward and ``opt.step()``. It is split into
*compute* (forward, backward and the optimizer's arithmetic) and *communication* (the time the
optimizer reports for its collectives). Bytes are those the optimizer's collectives sent in the
step. The per-step figures are averaged over ranks (one small all-reduce per step, excluded from
the step time and byte counts, which also yields the mean training loss over ranks). The
summary's mean step figures leave out the first three steps (one-time set-up). After training
the optimizer compares a checksum of every parameter across the ranks (``opt.check_replicas()``):
replicas that differ are reported, naming the first differing rank and parameter, and the run
exits with status 1.

JSON log
--------
``{"format": "lioncub-train-log/1", "config": {...}, "run": {...}, "steps": [...],
"evals": [...], "summary": {...}}``; ``steps[i]`` has ``step`` (1-based), ``lr``, ``loss``
(training loss averaged over ranks), ``time``, ``compute``, ``comm`` (seconds) and
``bytes_sent``, ``bytes_received`` (per rank, averaged over ranks), ``synced_tensors`` (how
many tensors had their momentum averaged after the step) and, for the variants whose
collective returns exact vote sums, ``agreement`` (the mean over tensors of the optimizer's
vote-agreement figure, in [0, 1]); ``evals[i]`` has ``step`` (0 = before training),
``val_loss`` and ``elapsed`` (seconds since the start of training).

Exit status: 0 on success, 1 when a communication or run-time error stopped the run, 2 for bad
options (argparse), 130 on Ctrl-C.
"""

from __future__ import annotations

import os

# The collective kernels run on one thread per rank; several ranks usually share the cores.
# Must be set before bitcoll (numba) is imported.
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

import bitcoll
import lioncub
from bitcoll.errors import BitcollError, CommError, UsageError
from lioncub.quantize import check_levels
from lioncub.replicas import ReplicaMismatchError
from lioncub.sync import parse_sync
from lioncub.torch import DistributedLion

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


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


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


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (``--help`` lists every option with its default)."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Data-parallel training of a character-level transformer on the Python "
                    "standard library's sources with Lion Cub or one of its baselines. Run it "
                    "with `python -m launch -n N train.py`, `mpiexec -n N python train.py` or "
                    "plainly on one rank.",
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
                   help="torch threads per rank (default: usable cores // ranks on this node, "
                        "at least 1)")
    g.add_argument("--comm-timeout", type=_float_in(0.0, 86400.0, low_open=True),
                   default=300.0, help="deadline of every collective, seconds")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=_positive_int, default=128, help="embedding width")
    g.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks")
    g.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
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
    if args.warmup is None:
        args.warmup = args.steps // 20
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    return args


# --------------------------------------------------------------------------------------------
# Output on rank 0
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _fmt_duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


class Progress:
    """Rank 0's progress display on ``stream``.

    On a terminal one line is redrawn with carriage returns (at most 10 times a second); on
    anything else a plain line is printed every ``max(1, total // 20)`` steps and at the end.
    ``note()`` prints a message on its own line without breaking the bar.
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total = total
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
        # The first step includes one-time set-up (kernel loading, buffers): the ETA uses
        # the pace of the later steps.
        if step == 1 or self._first_done is None:
            self._first_done = now
            eta = step_time * (self.total - step)
        else:
            eta = (now - self._first_done) / (step - 1) * (self.total - step)
        if self.tty:
            if now - self._last_draw < 0.1 and step < self.total:
                return
            self._last_draw = now
            width = 20
            filled = int(width * step / self.total)
            bar = "#" * filled + "." * (width - filled)
            line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] "
                    f"loss {loss:.4f}  {step_time * 1e3:.0f} ms/step "
                    f"(comm {comm * 1e3:.0f} ms, sent {_fmt_bytes(sent)})  "
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
                f"comm {comm * 1e3:.0f} ms)  sent {_fmt_bytes(sent)}/step  "
                f"elapsed {_fmt_duration(elapsed)}  ETA {_fmt_duration(eta)}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()


def format_summary(summary: dict[str, Any]) -> str:
    """The final summary as a two-column text table."""
    step_t = summary["mean_step_time"]
    comp_t = summary["mean_compute_time"]
    comm_t = summary["mean_comm_time"]

    def share(t: float) -> str:
        return f"{100 * t / step_t:.0f}%" if step_t > 0 else "-"

    rows = [
        ("optimizer", summary["optimizer"]),
        ("world size", f"{summary['world_size']} ({summary['backend']})"),
        ("steps", str(summary["steps"])),
        ("final train loss", f"{summary['final_train_loss']:.4f} "
                             f"(mean of last {summary['final_train_window']} steps)"),
        ("final val loss", f"{summary['final_val_loss']:.4f}"),
        ("mean step time", f"{step_t * 1e3:.1f} ms"),
        ("  compute", f"{comp_t * 1e3:.1f} ms ({share(comp_t)})"),
        ("  communication", f"{comm_t * 1e3:.1f} ms ({share(comm_t)})"),
        ("bytes sent / step", f"{_fmt_bytes(summary['bytes_sent_per_step'])} per rank"),
        ("bytes received / step", f"{_fmt_bytes(summary['bytes_received_per_step'])} per rank"),
        ("replicas identical", "yes" if summary["replicas_identical"] else "NO"),
        ("total wall time", _fmt_duration(summary["wall_time"])),
    ]
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


def default_threads(world_size: int) -> int:
    """Torch threads per rank when ``--threads`` is not given: the usable cores divided by the
    ranks on this node (``LOCAL_WORLD_SIZE`` from the launcher, ``MPI_LOCALNRANKS`` from MPICH,
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI, else the world size), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = world_size
    for var in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            local = int(value)
            break
    return max(1, (cores or 1) // local)


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
             batch_size: int, seq_len: int, eval_batches: int) -> float:
    """Mean validation cross-entropy (nats/token) over ``eval_batches * batch_size * size``
    evenly spaced windows, split over the ranks (every rank returns the same value)."""
    total = eval_batches * batch_size * comm.size
    starts = np.linspace(0, val.size - seq_len - 1, total).astype(np.int64)[comm.rank::comm.size]
    model.eval()
    acc = np.zeros(2, dtype=np.float64)
    for i in range(0, starts.size, batch_size):
        x, y = windows(val, starts[i:i + batch_size], seq_len)
        acc[0] += float(_loss(model, x, y)) * y.numel()
        acc[1] += y.numel()
    model.train()
    acc = np.asarray(comm.allreduce(acc, op="sum"))
    return float(acc[0] / acc[1])


def _optimizer_figures(opt: DistributedLion) -> tuple[float, float, int, int, int,
                                                      float | None]:
    """(compute s, comm s, bytes sent, bytes received, tensors whose momentum was synced,
    mean vote agreement or None) of the last ``opt.step()`` on this rank."""
    stats = opt.last_stats
    if stats is None:
        raise RuntimeError("the optimizer reported no statistics after its step")
    agreement = None
    if stats.agreement:
        agreement = float(np.mean(list(stats.agreement.values())))
    return (float(stats.compute_seconds), float(stats.comm_seconds), int(stats.bytes_sent),
            int(stats.bytes_received), len(stats.synced), agreement)


def run(args: argparse.Namespace, comm: bitcoll.Communicator,
        out: TextIO | None = None) -> dict[str, Any]:
    """Train as configured by ``args`` (see :func:`parse_args`) on communicator ``comm``.

    Returns the log record (config, run, steps, evals, summary); identical on every rank
    except for progress output, which only rank 0 writes to ``out`` (default stdout). Raises
    ``bitcoll.errors.CommError`` when a collective fails, ``RuntimeError`` when the ranks
    disagree on the corpus or the initial model.
    """
    stream = sys.stdout if out is None else out
    rank, size = comm.rank, comm.size
    lead = rank == 0
    wall0 = time.perf_counter()

    def say(text: str) -> None:
        if lead:
            stream.write(text + "\n")
            stream.flush()

    threads = args.threads or default_threads(size)
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

    opt = DistributedLion(model.named_parameters(), comm, variant=args.optimizer, lr=args.lr,
                          betas=(0.9, 0.99), weight_decay=args.weight_decay,
                          levels=args.levels, momentum_sync=args.momentum_sync)
    sampler = BatchSampler(corpus.train, args.batch_size, args.seq_len, args.seed, rank)

    backend = comm.backend
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}
    run_info = {
        "world_size": size, "backend": backend, "threads_per_rank": threads,
        "n_params": n_params, "corpus": corpus.describe(),
        "tokens_per_step": args.batch_size * args.seq_len * size,
        "python": platform.python_version(), "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    say(f"train.py: {args.optimizer} on {size} rank{'s' if size > 1 else ''} ({backend}), "
        f"{threads} torch thread{'s' if threads > 1 else ''} per rank")
    say(f"model: {n_params / 1e6:.2f}M parameters (d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads); batch {args.batch_size} x {args.seq_len} characters per rank")
    say(f"corpus: {corpus.train.size / 1e6:.2f} MB training ({corpus.train_files} files), "
        f"{corpus.val.size / 1e6:.2f} MB validation ({corpus.val_files} files) of the Python "
        f"standard library")

    progress = Progress(args.steps, stream, lead and not args.no_progress)
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    train_start = time.perf_counter()

    def do_eval(step: int) -> None:
        val_loss = evaluate(model, comm, corpus.val, args.batch_size, args.seq_len,
                            args.eval_batches)
        if not math.isfinite(val_loss):
            raise RuntimeError(f"validation loss is {val_loss} at step {step}")
        evals.append({"step": step, "val_loss": val_loss,
                      "elapsed": time.perf_counter() - train_start})
        if lead:
            progress.note(f"step {step:>{len(str(args.steps))}}/{args.steps}  "
                          f"val loss {val_loss:.4f}")

    do_eval(0)
    for step in range(1, args.steps + 1):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        x, y = sampler.next()
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        compute_o, comm_s, sent, received, synced, agreement = _optimizer_figures(opt)
        local = np.array([loss.item(), t2 - t0, (t1 - t0) + compute_o, comm_s, sent, received],
                         dtype=np.float64)
        mean = np.asarray(comm.allreduce(local, op="sum")) / size
        if not math.isfinite(mean[0]):
            raise RuntimeError(f"training loss is {mean[0]} at step {step}")
        rec = {"step": step, "lr": lr, "loss": float(mean[0]), "time": float(mean[1]),
               "compute": float(mean[2]), "comm": float(mean[3]),
               "bytes_sent": float(mean[4]), "bytes_received": float(mean[5]),
               "synced_tensors": synced}
        if agreement is not None:
            rec["agreement"] = agreement
        steps.append(rec)
        progress.update(step, rec["loss"], rec["time"], rec["compute"], rec["comm"],
                        rec["bytes_sent"])
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            do_eval(step)
    train_time = time.perf_counter() - train_start

    mismatch: ReplicaMismatchError | None = None
    try:
        opt.check_replicas()  # every rank gets the same verdict
    except ReplicaMismatchError as exc:
        mismatch = exc
    identical = mismatch is None
    # Mean step figures skip the first steps (first-call set-up: buffers, kernel loading).
    skip = min(3, len(steps) - 1)
    timed = steps[skip:]
    window = max(1, min(20, len(steps) // 10))
    summary = {
        "optimizer": args.optimizer, "world_size": size, "backend": backend,
        "steps": args.steps,
        "final_train_loss": float(np.mean([s["loss"] for s in steps[-window:]])),
        "final_train_window": window,
        "final_val_loss": evals[-1]["val_loss"],
        "best_val_loss": min(e["val_loss"] for e in evals),
        "mean_step_time": float(np.mean([s["time"] for s in timed])),
        "mean_compute_time": float(np.mean([s["compute"] for s in timed])),
        "mean_comm_time": float(np.mean([s["comm"] for s in timed])),
        "timed_steps_skipped": skip,
        "bytes_sent_per_step": float(np.mean([s["bytes_sent"] for s in steps])),
        "bytes_received_per_step": float(np.mean([s["bytes_received"] for s in steps])),
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
        raise RuntimeError(f"the model replicas differ after training (rank {mismatch.rank}'s "
                           f"parameter {mismatch.index} ({mismatch.name}) differs from rank "
                           f"0's; {len(mismatch.indices)} parameters differ): the optimizer "
                           "applied different updates on different ranks")
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
