"""The torch counterparts of the variant strategies: the per-bucket work of
:class:`lioncub.torch_engine.TorchEngine` on the parameters' device.

Each :class:`lioncub.strategies.VariantStrategy` class that the torch engine can run has one
:class:`TorchStrategy` counterpart here, bound in :data:`TORCH_STRATEGIES` (exact classes: a
subclass of a built-in strategy needs its own line). The engine builds the counterpart of its
variant's strategy (UsageError before anything is sent when there is none) and calls it per
bucket, in this order:

1. :meth:`TorchStrategy.stage_sizes` (once per pipeline stage): the sizes of the stage's
   device and host buffers (:class:`Stage`).
2. :meth:`TorchStrategy.contribute`: this rank's contribution into ``stage.c`` on the device
   (Lion's ``c`` with this rank's momentum, advanced; "global": the gradients).
3. :meth:`TorchStrategy.encode`: the contribution encoded (votes packed on the device, by
   :mod:`lioncub.torch_layout`) and copied into ``stage.host_in``; returns the bytes copied
   to the host. The engine then synchronizes the device, counts the bytes and checks ``c``
   for non-finite values.
4. :meth:`TorchStrategy.start`: bitcoll's collective on the host buffers (``async_op=True``).
5. :meth:`TorchStrategy.fetch`, after the engine waited for the collective: the result
   copied to the device; returns the bytes copied.
6. :meth:`TorchStrategy.apply`: the update of the bucket's parameters (and the per-tensor
   vote sums when the variant yields them).

The variants' flags (``local_momentum``, ``yields_sums``, ...) stay the numpy strategy's
(:attr:`TorchStrategy.base`). Arithmetic matches the numpy strategies bit for bit (see
:mod:`lioncub.torch_engine`). A counterpart sees the engine as the narrow
:class:`lioncub.step_view.TorchStepView`: ``comm``, ``levels``, ``world_size``, ``packing``
and ``tile``, and the engine's device helpers ``direction`` (Lion's ``c`` and momentum step of
one slot, tile by tile, with ``each=`` called on every tile while it is in the cache),
``apply_update`` (``p = p * decay - lr * u`` of one slot or part of one), ``tiles`` (the tiles
of the element-wise passes), ``tie_for`` (the tie rule of a bucket), ``flat_tensor`` (a flat
parameter view), ``scratch32``, ``scratch64``, ``sync_device``, ``non_finite`` and
``first_bad``.

Adding the torch side of a new variant: subclass :class:`TorchStrategy` and add one line,
``TORCH_STRATEGIES[MyStrategy] = MyTorchStrategy``, on every rank.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from bitcoll.errors import UsageError
from bitcoll.layout import field_width

from . import torch_layout as tl
from .buckets import Bucket, Slot
from .comm import WorkLike
from .lion import Hyper
from .quantize import multiplier
from .step_view import TorchStepView
from .strategies import (
    ExactSum,
    GlobalAverage,
    MajorityVote,
    QuantizedSum,
    SignMean,
    SignSum,
    VariantStrategy,
)

__all__ = ["Stage", "StageSizes", "TorchStrategy", "TorchGlobalAverage", "TorchMajorityVote",
           "TorchExactSum", "TorchSignSum", "TorchSignMean", "TorchQuantizedSum",
           "TORCH_STRATEGIES", "torch_strategy_for"]


@dataclass
class Stage:
    """One pipeline stage's buffers (sized for the largest bucket; the device scratch is
    shared by every stage, the host buffers are the stage's own)."""

    c: torch.Tensor          # float32 [padded]: c, or the gradients ("global")
    t: torch.Tensor          # float32 [padded] scratch
    fields: torch.Tensor     # uint8 [padded]: votes one per byte, then the result fields
    words: torch.Tensor      # int64 [padded / 8] scratch of the packing
    dev_in: torch.Tensor     # uint8: packed votes on the device
    host_in: torch.Tensor    # uint8: packed votes on the host (page-locked on CUDA)
    host_out: torch.Tensor   # uint8: packed result on the host
    dev_out: torch.Tensor    # uint8: packed result on the device
    aux: torch.Tensor        # int8 [padded] scratch of the votes
    t2: torch.Tensor         # float32 scratch (empty unless the strategy asks for it)


class StageSizes(NamedTuple):
    """Sizes of a stage's strategy-dependent buffers: bytes of ``host_in``, ``host_out``,
    ``dev_in``, ``dev_out`` and float32 elements of ``t2``."""

    host_in: int
    host_out: int
    dev_in: int
    dev_out: int
    t2: int


def _pieces(bucket: Bucket, start: int, stop: int) -> list[tuple[Slot, int, int]]:
    """The slots' parts within elements ``[start, stop)`` of ``bucket``: ``(slot, lo, hi)``
    in bucket coordinates, in order."""
    return [(s, max(start, s.offset), min(stop, s.stop)) for s in bucket.slots
            if s.offset < stop and s.stop > start]


_LOG_BLOCK = 256  # mantissas in [1, 2) multiplied per logarithm: the product < 2**256
_LN2 = math.log(2.0)


def _log_abs_sum(x: torch.Tensor, wide: torch.Tensor, scratch: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ints, logs)`` for float32 ``x``, without synchronizing: ``ints`` holds ``[normal,
    top, esum]`` (an integer tensor: the normal elements, the largest biased exponent, the sum
    of the biased exponents) and ``logs`` (float64, 0-d) the sum of the logarithms of the
    mantissas. As :func:`lioncub.kernels.log_abs_sum` computes it: ``|x_i| = 2**e_i m_i``,
    the exponents summed as integers and the mantissas ``m_i`` in [1, 2) multiplied in
    float64, one logarithm per :data:`_LOG_BLOCK` elements (zeros contribute ``m = 1, e = 0``),
    so that ``sum log|x_i| = logs + (esum - 127 count) ln 2`` over the ``count`` nonzero
    elements. ``top == 255``: some element is not finite. ``normal == x.numel()``: no zeros
    and no subnormals, so ``count == normal``; otherwise count the nonzero elements, and if
    some are subnormal (``count > normal``) take the logarithms one by one. ``wide``: float64
    scratch, ``scratch``: float32 scratch, each of at least ``x.numel()`` elements."""
    n = x.numel()
    bits = scratch[:n].view(torch.int32)
    torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=bits)
    e = wide[:n].view(torch.int32)[:n]
    torch.bitwise_right_shift(bits, 23, out=e)
    top = e.amax() if n else torch.zeros((), dtype=torch.int32, device=x.device)
    esum = _int_sum(e, 255)
    normal = _int_sum(e.clamp_(max=1), 1)  # (sums of 0 / 1 are cheaper than count_nonzero)
    found = [normal, top, esum]
    if len({v.dtype for v in found}) > 1:
        found = [v.long() for v in found]
    bits.bitwise_and_(0x7FFFFF).bitwise_or_(0x3F800000)  # the mantissas, as float32 bits
    m = wide[:n].copy_(bits.view(torch.float32))  # e is no longer needed
    whole = n - n % _LOG_BLOCK
    logs = m[:whole].view(-1, _LOG_BLOCK).prod(dim=1).log_().sum()
    if whole < n:
        logs = logs + m[whole:].prod().log()
    return torch.stack(found), logs


def _int_sum(x: torch.Tensor, bound: int) -> torch.Tensor:
    """The sum of int32 ``x`` (elements in ``[0, bound]``): int32 where it cannot overflow,
    else int64 from int32 chunks that cannot."""
    chunk = (2**31 - 1) // max(1, bound)
    if x.numel() <= chunk:
        return x.sum(dtype=torch.int32)
    return torch.stack([x[a:a + chunk].sum(dtype=torch.int32)
                        for a in range(0, x.numel(), chunk)]).sum(dtype=torch.int64)


def _abs_sums(mag: torch.Tensor, bucket: Bucket, start: int, bound: int,
              parts: list[torch.Tensor], owner: list[int],
              wide: torch.Tensor | None = None) -> None:
    """Append to ``parts`` the int32 sums of ``mag`` (integers in ``[0, bound]``, elements
    ``[start, start + mag.numel())`` of ``bucket``) per slot part, in chunks that cannot
    overflow int32 (torch's int64 accumulation of int8 is several times slower), and the
    slots' parameter indices to ``owner``. ``wide``: int32 scratch of ``mag``'s size for the
    widened values (else torch allocates it per sum)."""
    chunk = (2**31 - 1) // max(1, bound)
    if wide is not None and mag.dtype != torch.int32:
        mag = wide[:mag.numel()].copy_(mag)
    for s, lo, hi in _pieces(bucket, start, start + mag.numel()):
        for x in range(lo, hi, chunk):
            parts.append(mag[x - start:min(hi, x + chunk) - start].sum(dtype=torch.int32))
            owner.append(s.index)


class TorchStrategy(ABC):
    """The torch engine's side of the strategy ``base`` (module docstring); one object per
    engine. The default :meth:`contribute` is Lion's ``c`` with this rank's momentum."""

    def __init__(self, base: VariantStrategy) -> None:
        self.base = base

    @abstractmethod
    def stage_sizes(self, engine: TorchStepView, size: int) -> StageSizes:
        """The buffer sizes of a stage for buckets of at most ``size`` elements."""

    def contribute(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   grads: Sequence[torch.Tensor | None], hypers: Sequence[Hyper]) -> None:
        """``buf.c[s.offset:s.stop] = beta1 m + (1 - beta1) g`` of every slot, this rank's
        momentum advanced (``grads``: flat tensors or None, one per parameter)."""
        for s in bucket.slots:
            engine.direction(s, buf.c[s.offset:s.stop], buf.t[s.offset:s.stop],
                              grads[s.index], hypers[s.index])

    def contribution(self, engine: TorchStepView, buf: Stage) -> torch.Tensor:
        """Where :meth:`contribute` leaves ``c`` (float32, bucket coordinates; the engine's
        finiteness check reads it): ``buf.c`` by default."""
        return buf.c

    def checks_finite(self) -> bool:
        """Whether :meth:`encode` itself raises the engine's ``non_finite`` error for the
        first parameter whose ``c`` is not finite (before anything is sent); then the engine
        records no extrema (one pass less per tile) and passes None as ``lo`` and ``hi``."""
        return False

    @abstractmethod
    def encode(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> int:
        """Encode ``buf.c[:bucket.size]`` (its minimum ``lo`` and maximum ``hi``, 0-d device
        tensors, or None when :meth:`checks_finite`) into ``buf.host_in`` (the copy may be
        asynchronous; the engine synchronizes the device next); return the bytes copied to
        the host."""

    @abstractmethod
    def start(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> WorkLike:
        """Start the bucket's collective on the host buffers (``async_op=True``)."""

    @abstractmethod
    def fetch(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> int:
        """Copy the completed collective's result to the device; return its bytes."""

    @abstractmethod
    def apply(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
              hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        """Update the bucket's parameters from the fetched result (set ``sums`` of every
        parameter of the bucket when ``base.yields_sums``)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.base.spec.name}>"


class TorchGlobalAverage(TorchStrategy):
    """:class:`lioncub.strategies.GlobalAverage`: float32 gradients to the host (4 bytes per
    element each way), averaged, then Lion with the shared momentum on the device. On a CPU
    (``engine.packing == "host"``) the gradients are copied straight into the stage's host
    buffer and the average is used where it lies (nothing crosses, no copies back)."""

    def stage_sizes(self, engine: TorchStepView, size: int) -> StageSizes:
        padded = tl.padded(size)
        return StageSizes(4 * padded, 0, 0, 0, padded)

    def contribution(self, engine: TorchStepView, buf: Stage) -> torch.Tensor:
        return buf.host_in.view(torch.float32) if engine.packing == "host" else buf.c

    def contribute(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   grads: Sequence[torch.Tensor | None], hypers: Sequence[Hyper]) -> None:
        c = self.contribution(engine, buf)
        for s in bucket.slots:
            g = grads[s.index]
            if g is None:
                c[s.offset:s.stop].zero_()
            else:
                c[s.offset:s.stop].copy_(g)

    def encode(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> int:
        if engine.packing == "host":
            return 0
        nb = 4 * bucket.size
        buf.host_in[:nb].view(torch.float32).copy_(buf.c[:bucket.size], non_blocking=True)
        return nb

    def start(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> WorkLike:
        host = buf.host_in[:4 * bucket.size].view(torch.float32).numpy()
        return engine.comm.allreduce(host, op="avg", out=host, async_op=True)

    def fetch(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> int:
        if engine.packing == "host":
            return 0
        n = bucket.size
        buf.c[:n].copy_(buf.host_in[:4 * n].view(torch.float32), non_blocking=True)
        return 4 * n

    def apply(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
              hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        c = self.contribution(engine, buf)
        for s in bucket.slots:
            h = hypers[s.index]
            u = buf.t[s.offset:s.stop]
            engine.direction(s, u, buf.t2[s.offset:s.stop], c[s.offset:s.stop], h)
            engine.apply_update(s, u.sign_(), h)


class _Packed(TorchStrategy):
    """Votes packed into fields of ``widths()[0]`` bits, the result coming back in fields of
    ``widths()[1]`` bits (:mod:`bitcoll.layout`'s layout). Where they are packed is
    ``engine.packing``:

    * "device": by torch operations on the parameters' device (:mod:`lioncub.torch_layout`);
      only the packed bytes cross to the host and back, and bitcoll's packed collective
      (``packed_sign_allreduce`` / ``packed_quantized_allreduce``) runs on them.
    * "host" (CPU parameters only): nothing crosses a bus, so the votes go to bitcoll
      unpacked (``c`` itself for the sign-based variants, the int8 values for the quantized
      ones, in the stage's own host buffer) and its collective packs them on the way to the
      wire (``sign_allreduce`` / ``quantized_allreduce``, as the numpy core calls them); the
      result comes back one integer per element (int8, or int16 when the sums exceed 127)
      and is applied where it lies. The same bits and the same wire bytes as "device",
      without packing twice.
    """

    @abstractmethod
    def widths(self, engine: TorchStepView) -> tuple[int, int]:
        """Bits per element of the packed votes and of the packed result."""

    @abstractmethod
    def fields(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        """This rank's votes into ``buf.fields[:bucket.size]``, one unsigned field value per
        byte ("device" packing); "host" packing: whatever :meth:`start_host` reads into
        ``buf.host_in``."""

    @abstractmethod
    def start_packed(self, engine: TorchStepView, bucket: Bucket, votes: np.ndarray[Any, Any],
                     result: np.ndarray[Any, Any]) -> WorkLike:
        """bitcoll's packed collective from the packed ``votes`` into the packed ``result``
        (host arrays, ``async_op=True``)."""

    @abstractmethod
    def start_host(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   result: np.ndarray[Any, Any]) -> WorkLike:
        """"host" packing: bitcoll's collective from ``buf.host_in`` into ``result`` (one
        integer of :meth:`result_dtype` per element; ``async_op=True``)."""

    def result_dtype(self, engine: TorchStepView) -> torch.dtype:
        """"host" packing: the dtype of one result element (int8 when the widest result
        field has at most 8 bits, else int16)."""
        return torch.int8 if self.widths(engine)[1] <= 8 else torch.int16

    def host_in_bytes(self, engine: TorchStepView, size: int) -> int:
        """"host" packing: bytes of ``host_in`` for buckets of at most ``size`` elements
        (default: ``c`` in float32)."""
        return 4 * tl.padded(size)

    def host_c(self, buf: Stage) -> torch.Tensor:
        """"host" packing: ``c`` in float32 in the stage's own host buffer (the sign-based
        variants hand it to bitcoll, which takes the signs)."""
        return buf.host_in.view(torch.float32)

    def stage_sizes(self, engine: TorchStepView, size: int) -> StageSizes:
        if engine.packing == "host":
            item = torch.empty(0, dtype=self.result_dtype(engine)).element_size()
            return StageSizes(self.host_in_bytes(engine, size), item * tl.padded(size), 0, 0,
                              0)
        w_in, w_out = self.widths(engine)
        n_in, n_out = tl.nbytes(size, w_in), tl.nbytes(size, w_out)
        return StageSizes(n_in, n_out, n_in, n_out, 0)

    def encode(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> int:
        n = bucket.size
        self.fields(engine, bucket, buf, lo, hi)
        if engine.packing == "host":
            return 0  # already in the host buffer: nothing crosses
        buf.fields[n:tl.padded(n)].zero_()
        w_in = self.widths(engine)[0]
        nb = tl.nbytes(n, w_in)
        tl.pack(buf.fields[:tl.padded(n)], n, w_in, buf.dev_in[:nb],
                buf.words[:tl.padded(n) // 8], tile=engine.tile)
        buf.host_in[:nb].copy_(buf.dev_in[:nb], non_blocking=True)
        return nb

    def start(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> WorkLike:
        if engine.packing == "host":
            return self.start_host(engine, bucket, buf, self.host_result(engine, bucket,
                                                                         buf).numpy())
        w_in, w_out = self.widths(engine)
        n = bucket.size
        return self.start_packed(engine, bucket, buf.host_in[:tl.nbytes(n, w_in)].numpy(),
                                 buf.host_out[:tl.nbytes(n, w_out)].numpy())

    def host_result(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> torch.Tensor:
        """"host" packing: the bucket's result, one integer per element, in ``host_out``."""
        return buf.host_out.view(self.result_dtype(engine))[:bucket.size]

    def fetch(self, engine: TorchStepView, bucket: Bucket, buf: Stage) -> int:
        if engine.packing == "host":
            return 0  # applied where it lies
        nb = tl.nbytes(bucket.size, self.widths(engine)[1])
        buf.dev_out[:nb].copy_(buf.host_out[:nb], non_blocking=True)
        return nb


class TorchMajorityVote(_Packed):
    """:class:`lioncub.strategies.MajorityVote`: 1-bit votes ``c >= 0``, bitcoll's
    ``packed_sign_allreduce`` ("host" packing: ``sign_allreduce`` of ``c``), the majority
    applied as +-1."""

    def widths(self, engine: TorchStepView) -> tuple[int, int]:
        return 1, 1

    def contribute(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   grads: Sequence[torch.Tensor | None], hypers: Sequence[Hyper]) -> None:
        """Lion's ``c``: "device" packing turns its tiles into votes while they are in the
        cache and does not keep it (:meth:`fields` has nothing left to do); "host" packing
        writes it into the stage's host buffer for bitcoll."""
        if engine.packing == "host":
            c = self.contribution(engine, buf)
            for s in bucket.slots:
                engine.direction(s, c[s.offset:s.stop], buf.t[s.offset:s.stop],
                                  grads[s.index], hypers[s.index])
            return
        for s in bucket.slots:
            engine.direction(s, buf.c[s.offset:s.stop], buf.t[s.offset:s.stop],
                              grads[s.index], hypers[s.index],
                              each=functools.partial(self.votes, buf, s.offset), keep=False)

    def contribution(self, engine: TorchStepView, buf: Stage) -> torch.Tensor:
        return self.host_c(buf) if engine.packing == "host" else buf.c

    def votes(self, buf: Stage, offset: int, start: int, c: torch.Tensor,
              lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        """The votes ``c >= 0`` of a tile ``c`` of elements ``[offset + start, offset + start
        + c.numel())`` of the bucket into ``buf.fields``."""
        a = offset + start
        torch.ge(c, 0, out=buf.fields[a:a + c.numel()].view(torch.int8))  # int8: vectorized

    def fields(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        pass  # written by contribute

    def start_packed(self, engine: TorchStepView, bucket: Bucket, votes: np.ndarray[Any, Any],
                     result: np.ndarray[Any, Any]) -> WorkLike:
        comm: Any = engine.comm
        work: WorkLike = comm.packed_sign_allreduce(
            votes, bucket.size, tie=engine.tie_for(bucket.index), out=result, async_op=True,
            algorithm=self.base.spec.algorithm)
        return work

    def start_host(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   result: np.ndarray[Any, Any]) -> WorkLike:
        comm: Any = engine.comm
        work: WorkLike = comm.sign_allreduce(
            self.host_c(buf)[:bucket.size].numpy(), op="majority",
            tie=engine.tie_for(bucket.index), out=result, async_op=True,
            algorithm=self.base.spec.algorithm)
        return work

    def apply(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
              hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        if engine.packing == "host":
            signs = self.host_result(engine, bucket, buf)  # +-1
            for s in bucket.slots:
                engine.apply_update(s, signs[s.offset:s.stop], hypers[s.index])
            return
        for a, b in tl.ranges(bucket.size, engine.tile):  # unpacked and applied per tile
            bits = buf.fields[a:a + tl.padded(b - a)]
            tl.unpack(buf.dev_out[a // 8:tl.nbytes(b, 1)], b - a, 1, bits, buf.words)
            sgn = bits[:b - a].mul_(2).sub_(1).view(torch.int8)  # 1 -> +1, 0 -> -1
            for s, lo, hi in _pieces(bucket, a, b):
                engine.apply_update(s, sgn[lo - a:hi - a], hypers[s.index], lo - s.offset)


class TorchExactSum(_Packed):
    """Base of the exact-sum variants: votes in ``[-L, L]`` as fields of value + L, bitcoll's
    ``packed_quantized_allreduce`` with ``L`` = :meth:`vote_levels`, the sums applied by
    :meth:`apply_sums` (default ``lr * sign(sum)``) and ``sum |sum|`` recorded per tensor."""

    def vote_levels(self, engine: TorchStepView) -> int:
        """``L``: the largest vote magnitude (1: ternary signs)."""
        return 1

    def result_op(self, engine: TorchStepView) -> str:
        """The host-packed collective's ``op`` (:meth:`lioncub.strategies.ExactSum.result_op`:
        "sign" when neither the update nor the vote agreement needs the sums)."""
        base = self.base
        assert isinstance(base, ExactSum)
        return base.result_op(engine.agreement)

    def widths(self, engine: TorchStepView) -> tuple[int, int]:
        levels = self.vote_levels(engine)
        return field_width(levels), field_width(levels * engine.world_size)

    def start_packed(self, engine: TorchStepView, bucket: Bucket, votes: np.ndarray[Any, Any],
                     result: np.ndarray[Any, Any]) -> WorkLike:
        comm: Any = engine.comm
        work: WorkLike = comm.packed_quantized_allreduce(
            votes, bucket.size, self.vote_levels(engine), out=result, async_op=True,
            algorithm=self.base.spec.algorithm)
        return work

    def result_dtype(self, engine: TorchStepView) -> torch.dtype:
        return torch.int8 if self.vote_levels(engine) * engine.world_size <= 127 \
            else torch.int16

    def apply(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
              hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        n = bucket.size
        w_out = self.widths(engine)[1]
        bias = self.vote_levels(engine) * engine.world_size
        parts: list[torch.Tensor] = []
        owner: list[int] = []
        if engine.packing == "host":
            result = self.host_result(engine, bucket, buf)  # the sums, where they lie
            for a, b in tl.ranges(n, engine.tile):  # applied and summed per tile
                total = result[a:b]
                self.apply_sums(engine, bucket, buf, a, total, hypers)
                _abs_sums(total.abs_(), bucket, a, bias, parts, owner,
                          buf.t.view(torch.int32))
        elif w_out > 8:
            total = tl.unpack_wide(buf.dev_out[:tl.nbytes(n, w_out)], n, w_out).sub_(bias)
            self.apply_sums(engine, bucket, buf, 0, total, hypers)
            _abs_sums(total.abs_(), bucket, 0, bias, parts, owner)
        else:
            for a, b in tl.ranges(n, engine.tile):  # unpacked, applied and summed per tile
                f = buf.fields[a:a + tl.padded(b - a)]
                tl.unpack(buf.dev_out[a * w_out // 8:tl.nbytes(b, w_out)], b - a, w_out, f,
                          buf.words)
                total = f[:b - a].sub_(bias).view(torch.int8)  # the sums (|sum| <= 127)
                self.apply_sums(engine, bucket, buf, a, total, hypers)
                _abs_sums(total.abs_(), bucket, a, bias, parts, owner,
                          buf.t.view(torch.int32))
        for s in bucket.slots:
            sums[s.index] = 0
        for i, v in zip(owner, torch.stack(parts).tolist(), strict=True):
            sums[i] += int(v)

    def apply_sums(self, engine: TorchStepView, bucket: Bucket, buf: Stage, start: int,
                   total: torch.Tensor, hypers: Sequence[Hyper]) -> None:
        """``p = p * decay - lr * sign(total)`` for the bucket's elements ``[start, start +
        total.numel())`` (``total``: their sums, int8 or wider; it may be overwritten
        afterwards)."""
        n = total.numel()
        if total.dtype == torch.int8:  # the signs as bytes; apply_update widens them per tile
            sgn = torch.sign(total, out=buf.aux[start:start + n])
        else:
            sgn = engine.scratch32(n).copy_(total).sign_()
        for s, lo, hi in _pieces(bucket, start, start + n):
            engine.apply_update(s, sgn[lo - start:hi - start], hypers[s.index], lo - s.offset)


class TorchSignSum(TorchExactSum):
    """:class:`lioncub.strategies.SignSum`: ternary signs + 1 as 2-bit fields (the values,
    the algorithm and the bytes on the wire are those of ``sign_allreduce(op="sum")``)."""

    contribute = TorchMajorityVote.contribute
    contribution = TorchMajorityVote.contribution

    def votes(self, buf: Stage, offset: int, start: int, c: torch.Tensor,
              lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        """The votes ``(c > 0) + (c >= 0)`` of a tile (:meth:`TorchMajorityVote.votes`)."""
        a, n = offset + start, c.numel()
        f = buf.fields[a:a + n]
        torch.gt(c, 0, out=f.view(torch.int8))
        ge = buf.aux[:n]
        torch.ge(c, 0, out=ge)
        f.add_(ge.view(torch.uint8))

    def fields(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        pass  # written by contribute

    def start_host(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   result: np.ndarray[Any, Any]) -> WorkLike:
        comm: Any = engine.comm
        work: WorkLike = comm.sign_allreduce(
            self.host_c(buf)[:bucket.size].numpy(), op=self.result_op(engine), out=result,
            async_op=True, algorithm=self.base.spec.algorithm)
        return work


class TorchSignMean(TorchSignSum):
    """:class:`lioncub.strategies.SignMean`: the sums applied as ``lr * sum / p``."""

    def apply_sums(self, engine: TorchStepView, bucket: Bucket, buf: Stage, start: int,
                   total: torch.Tensor, hypers: Sequence[Hyper]) -> None:
        # As the numpy kernel: u = sum / p correctly rounded (a true division: torch's CUDA
        # kernels divide by a scalar through its reciprocal, which rounds differently for
        # some sums, so the divisor is an expanded tensor), then lr * u rounded, then
        # p * decay - lr * u; vectorized, in the engine's float32 scratch (a table lookup per
        # element was 3x slower on a CPU)
        n = total.numel()
        u = engine.scratch32(n).copy_(total)
        torch.div(u, torch.full((), float(engine.world_size), device=u.device).expand(n),
                  out=u)
        for s, lo, hi in _pieces(bucket, start, start + n):
            h = hypers[s.index]
            p = engine.flat_tensor(s.index)[lo - s.offset:hi - s.offset]
            step = u[lo - start:hi - start].mul_(float(h.lr))
            if float(h.decay) != 1.0:
                p.mul_(float(h.decay))
            p.sub_(step)


class TorchQuantizedSum(TorchExactSum):
    """:class:`lioncub.strategies.QuantizedSum`: ``quantize(c, method, levels) + levels``
    per tensor, with the numpy core's scales (:func:`lioncub.quantize.tensor_scale`) and
    multipliers."""

    def vote_levels(self, engine: TorchStepView) -> int:
        return engine.levels

    def contribute(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   grads: Sequence[torch.Tensor | None], hypers: Sequence[Hyper]) -> None:
        """Lion's ``c`` (the default), and the partial scales of its tiles while they are in
        the cache: ``max|c|`` ("linf"), ``sum|c|`` ("l1"), the nonzero count and
        ``sum log|c|`` ("l0"), float64 0-d tensors, kept for :meth:`fields`."""
        assert isinstance(self.base, QuantizedSum)
        method = self.base.method
        n = bucket.size
        parts: list[torch.Tensor] = []
        owner: list[int] = []
        d = engine.scratch64(min(n, engine.tile) if engine.tile > 0 else n)

        tiles: list[tuple[int, int]] = []  # (first element, count) in the bucket per part
        ints: list[torch.Tensor] = []  # l0: normal count, top exponent, exponent sum

        def partial(j: int, s: Slot, start: int, ct: torch.Tensor, lo: torch.Tensor | None,
                    hi: torch.Tensor | None) -> None:
            owner.append(j)
            tiles.append((s.offset + start, ct.numel()))
            if method == "linf":
                assert lo is not None and hi is not None
                parts.append(torch.maximum(lo.neg(), hi).double())
                return
            if method == "l0":
                found, logs = _log_abs_sum(ct, d, engine.scratch32(ct.numel()))
                ints.append(found)
                parts.append(logs)
                return
            dt = d[:ct.numel()]
            dt.copy_(ct).abs_()
            parts.append(dt.sum())

        for j, s in enumerate(bucket.slots):
            engine.direction(s, buf.c[s.offset:s.stop], buf.t[s.offset:s.stop],
                              grads[s.index], hypers[s.index],
                              each=functools.partial(partial, j, s))
        self._parts, self._ints, self._owner, self._tiles = parts, ints, owner, tiles

    def checks_finite(self) -> bool:
        assert isinstance(self.base, QuantizedSum)
        return self.base.method != "linf"  # l1 and l0 from their partial sums (fields)

    def fields(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
               lo: torch.Tensor | None, hi: torch.Tensor | None) -> None:
        assert isinstance(self.base, QuantizedSum)
        method = self.base.method
        n = bucket.size
        c = buf.c[:n]
        levels = engine.levels
        # the partial scales of the tiles (contribute), combined per slot below; linf: after
        # the bucket's extrema (the finiteness check), l1 and l0: their sums are finite only
        # if every c is (sums of |c| or of log|c|, zeros counted apart, cannot overflow)
        extrema = [lo.double(), hi.double()] if lo is not None and hi is not None else []
        floats = torch.stack(extrema + self._parts)
        ints: list[int] = []
        if self._ints:  # l0: with the integers, still one synchronization per bucket
            everything = torch.cat([floats, torch.cat(self._ints).double()]).tolist()
            values, ints = everything[:floats.numel()], [int(v) for v in
                                                          everything[floats.numel():]]
        else:
            values = floats.tolist()  # one synchronization per bucket
        if extrema and not (math.isfinite(values[0]) and math.isfinite(values[1])):
            engine.sync_device()
            raise engine.first_bad(bucket, c)
        first = len(extrema)
        k = len(bucket.slots)
        totals = [0.0] * k  # linf: maxima; l1: sums of |c|; l0: sums of log|c|
        counts = [0] * k
        for i, j in enumerate(self._owner):
            v = values[first + i]
            if method == "l0":
                normal, top, esum = ints[3 * i:3 * i + 3]
                if top >= 255:  # an infinity or a NaN
                    raise engine.non_finite(bucket.slots[j].index)
                a, length = self._tiles[i]
                count = normal if normal == length else \
                    int(torch.count_nonzero(c[a:a + length]))  # zeros, or subnormals too
                if count != normal:  # subnormals: logarithm by logarithm
                    dt = engine.scratch64(length).copy_(c[a:a + length]).abs_()
                    v = float(dt.masked_fill_(dt == 0, 1.0).log_().sum())
                else:
                    v = v + (esum - 127 * count) * _LN2
                counts[j] += count
            if not math.isfinite(v):
                raise engine.non_finite(bucket.slots[j].index)  # l1 / l0: the first one
            totals[j] = max(totals[j], v) if method == "linf" else totals[j] + v
        t = buf.t
        host = engine.packing == "host"  # the values themselves, else value + levels
        fields = buf.host_in.view(torch.int8) if host else buf.fields
        for j, s in enumerate(bucket.slots):
            if method == "l1":
                scale = totals[j] / s.size
            elif method == "linf":
                scale = totals[j]
            else:
                scale = 0.0 if counts[j] == 0 else math.exp(totals[j] / counts[j])
            mult = multiplier(method, levels, scale)
            for a, b in engine.tiles(s.size):
                ft = fields[s.offset + a:s.offset + b]
                if mult is None:
                    ft.fill_(0 if host else levels)
                    continue
                tt = t[:b - a]
                torch.mul(c[s.offset + a:s.offset + b], float(mult), out=tt)
                tt.clamp_(-levels, levels).round_()
                if host:
                    ft.copy_(tt)  # exact: integers in [-levels, levels]
                    continue
                q = buf.aux[:b - a]
                q.copy_(tt)
                torch.add(q.view(torch.uint8), levels, out=ft)  # value + levels (mod 256)

    def host_in_bytes(self, engine: TorchStepView, size: int) -> int:
        return tl.padded(size)  # int8 values

    def start_host(self, engine: TorchStepView, bucket: Bucket, buf: Stage,
                   result: np.ndarray[Any, Any]) -> WorkLike:
        comm: Any = engine.comm
        work: WorkLike = comm.quantized_allreduce(
            buf.host_in.view(torch.int8)[:bucket.size].numpy(), engine.levels, out=result,
            op=self.result_op(engine), async_op=True, algorithm=self.base.spec.algorithm)
        return work


#: numpy strategy class -> its torch counterpart (a new variant's line goes here).
TORCH_STRATEGIES: dict[type[VariantStrategy], type[TorchStrategy]] = {
    GlobalAverage: TorchGlobalAverage,
    MajorityVote: TorchMajorityVote,
    SignSum: TorchSignSum,
    SignMean: TorchSignMean,
    QuantizedSum: TorchQuantizedSum,
}


def torch_strategy_for(strategy: VariantStrategy) -> TorchStrategy:
    """The torch counterpart of ``strategy`` (looked up by its exact class); UsageError when
    its class has none."""
    cls = TORCH_STRATEGIES.get(type(strategy))
    if cls is None:
        raise UsageError(f"variant {strategy.spec.name!r} ({type(strategy).__name__}) has no "
                         "torch engine implementation (lioncub.torch_strategies."
                         "TORCH_STRATEGIES); use the numpy engine (backend='numpy')",
                         argument="variant")
    return cls(strategy)
