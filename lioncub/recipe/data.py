"""The training data of ``train.py``: the Python standard library's sources as byte tokens.

The corpus is every ``*.py`` file of ``sysconfig.get_paths()["stdlib"]`` outside test
directories and third-party ``site-packages``, ordered by a hash of its relative path (a fixed,
deterministic shuffle that spreads the selection across the library), read in that order until
the requested number of megabytes (10**6 bytes) is collected. Every tenth file goes to the
held-out validation split. Tokens are bytes: newline and printable ASCII are 96 tokens, every
other byte is the unknown token, so the vocabulary (:data:`VOCAB_SIZE`, 97) is fixed and the
same on every machine.

Minibatches are windows of consecutive tokens: :class:`BatchSampler` draws their starts
uniformly with ``numpy.random.default_rng([seed, rank])`` (a stream per rank, restorable for
checkpoints); :func:`sharded_windows` draws a step's windows for a whole world and gives each
rank its share (the data order of an elastic job, whose world changes); :func:`windows` cuts
them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["VOCAB", "UNK", "VOCAB_SIZE", "EXCLUDED_DIRS", "VAL_EVERY", "encode", "decode",
           "corpus_files", "Corpus", "load_corpus", "BatchSampler", "windows",
           "sharded_windows"]

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


def sharded_windows(tokens: npt.NDArray[np.uint8], batch_size: int, seq_len: int, seed: int,
                    step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of step ``step``'s windows in a world of ``size`` ranks.

    ``numpy.random.default_rng([seed, step, size])`` draws ``size * batch_size`` window starts
    (uniform, as :class:`BatchSampler`); rank ``r`` takes the ``r``-th run of ``batch_size`` of
    them. The batches are a function of the step and the world only (no generator state to
    carry), so the ranks of an elastic job that lost or gained members still split one
    sample of the stream between them. Returns int64 tensors of shape ``(batch_size,
    seq_len)``. ValueError when ``tokens`` is too short or ``rank`` is not in ``[0, size)``.
    """
    if tokens.size < seq_len + 2:
        raise ValueError(f"{tokens.size} tokens are too few for windows of {seq_len + 1}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    rng = np.random.default_rng([seed, step, size])
    starts = rng.integers(0, tokens.size - seq_len, size=size * batch_size)
    return windows(tokens, starts[rank * batch_size:(rank + 1) * batch_size], seq_len)
