"""The distributed Lion step on torch tensors, on the parameters' own device.

:class:`TorchEngine` is :class:`lioncub.DistributedLion` (same layout, variants, tie rules,
momentum schedules, replica checks, state format and pipeline of two buckets in flight)
with the per-bucket work done by torch operations on the device that holds the
parameters (CPU or CUDA), in float32, bfloat16 or float16. Only packed votes cross to the
host and only packed results come back:

1. On the device: Lion's interpolation ``c = beta1 m + (1 - beta1) g`` in float32 (the
   momentum ``m`` is kept in ``momentum_dtype``, float32 by default, and advanced), its
   quantization exactly as :mod:`lioncub.quantize` defines it, and the packing into bits
   or fields in :mod:`bitcoll.layout`'s layout (:mod:`lioncub.torch_layout`).
2. One device-to-host copy of the packed bytes (``ceil(count / 8)`` for the 1-bit
   majority, ``ceil(count w_in / 8)`` for fields of ``w_in`` bits) into a host buffer
   (page-locked when the device is CUDA), after the producing stream is synchronized.
3. bitcoll's packed collective (:meth:`~bitcoll.Communicator.packed_sign_allreduce` or
   :meth:`~bitcoll.Communicator.packed_quantized_allreduce`), started asynchronously; the
   next bucket is computed while it runs.
4. One host-to-device copy of the packed result (``ceil(count / 8)`` or
   ``ceil(count w_out / 8)`` bytes), unpacked on the device, and the update applied.

"global" moves float32 gradients (4 bytes per element each way), as the numpy core does.
The exact sums of ternary signs ("lioncub-sign", "dlion-avg") travel as
``packed_quantized_allreduce`` fields with ``levels=1`` (the values, the algorithm and the
bytes on the wire are those of ``sign_allreduce(op="sum")``).

Arithmetic: every element-wise operation is one float32 operation rounded as numpy rounds
it (``c = m*b1 + g*a1`` as two products and a sum, the update as ``p*decay - lr*u``), so
for float32 parameters the trajectory is the numpy core's bit for bit, except for one
difference in order: the per-tensor scale sums of "l1" (``sum|c|``) and "l0"
(``sum log|c|``) are float64 reductions in torch's order rather than the numpy kernels'
fixed lanes. They agree to about 1e-14 relative, and the scale enters the votes only through
the float32 multiplier, which the two orders round to the same value except in the rare
case where the float64 sums straddle a float32 rounding boundary (then single votes may
differ by one level). bfloat16 / float16 parameters are updated in their dtype
(``p*decay`` rounded, then ``- lr*u`` rounded); a bfloat16 momentum is advanced in float32
and rounded once per step.

Replicas stay identical on every rank: the collective's result is identical everywhere and
the update is element-wise, so every rank applies the same bits (the scale each rank uses
to quantize its own vote is that rank's business, as in the numpy core).

This module imports torch; :mod:`lioncub.torch` builds the engine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from bitcoll.errors import UsageError
from bitcoll.layout import field_width

from . import torch_layout as tl
from .buckets import Bucket, Slot
from .distributed import DistributedLion
from .lion import Hyper
from .quantize import multiplier
from .replicas import ReplicaSet

__all__ = ["TorchEngine", "TensorReplicas", "PARAM_DTYPES", "MOMENTUM_DTYPES"]

#: Parameter dtypes of the torch engine.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Momentum dtypes of the torch engine.
MOMENTUM_DTYPES = (torch.float32, torch.bfloat16)

_NUMPY_VIEW = {torch.float32: torch.float32, torch.float16: torch.float16,
               torch.bfloat16: torch.int16}


def host_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy array over the bytes of the CPU tensor ``t`` (bfloat16 as int16)."""
    return t.detach().view(_NUMPY_VIEW.get(t.dtype, t.dtype)).numpy()


def _int_sum(x: torch.Tensor, bound: int) -> torch.Tensor:
    """``x.sum()`` of integers in ``[0, bound]`` as an int64 0-d tensor, summed in int32
    chunks that cannot overflow (torch's int64 accumulation of int8 is several times
    slower)."""
    chunk = (2**31 - 1) // max(1, bound)
    parts = [x[i:i + chunk].sum(dtype=torch.int32) for i in range(0, x.numel(), chunk)]
    return torch.stack(parts).sum(dtype=torch.int64)


class TensorReplicas(ReplicaSet):
    """A :class:`lioncub.replicas.ReplicaSet` over torch tensors on any device: CPU tensors
    are hashed and broadcast in place (numpy views of their memory, bfloat16 as int16),
    others through host copies that :meth:`broadcast` writes back."""

    def __init__(self, tensors: list[torch.Tensor], names: list[str] | None,
                 unnamed: str = "") -> None:
        self.tensors = [t.detach() for t in tensors]
        super().__init__([self._host(t) for t in self.tensors], names, unnamed)

    @staticmethod
    def _host(t: torch.Tensor) -> np.ndarray[Any, Any]:
        return host_view(t if t.device.type == "cpu" else t.cpu())

    def _refresh(self) -> None:
        self.arrays = tuple(self._host(t) for t in self.tensors)

    def check(self, comm: Any) -> None:
        self._refresh()
        super().check(comm)

    def broadcast(self, comm: Any, root: int = 0, chunk_bytes: int | None = None) -> None:
        self._refresh()
        if chunk_bytes is None:
            super().broadcast(comm, root)
        else:
            super().broadcast(comm, root, chunk_bytes)
        for t, a in zip(self.tensors, self.arrays, strict=True):
            if t.device.type != "cpu":
                t.copy_(torch.from_numpy(a).view(t.dtype))


@dataclass
class _Stage:
    """One pipeline stage's buffers (sized for the largest bucket)."""

    c: torch.Tensor          # float32 [padded]: c, or the gradients ("global")
    t: torch.Tensor          # float32 [padded] scratch
    fields: torch.Tensor     # uint8 [padded]: votes one per byte, then the result fields
    words: torch.Tensor      # int64 [padded / 8] scratch of the packing
    dev_in: torch.Tensor     # uint8: packed votes on the device
    host_in: torch.Tensor    # uint8: packed votes on the host (page-locked on CUDA)
    host_out: torch.Tensor   # uint8: packed result on the host
    dev_out: torch.Tensor    # uint8: packed result on the device
    aux: torch.Tensor        # int8 [padded] scratch: the signs of the sums
    t2: torch.Tensor         # float32 [padded] scratch ("global" only, else empty)


class TorchEngine(DistributedLion):
    """:class:`lioncub.DistributedLion` on torch tensors (module docstring).

    ``params``: as for the numpy core, but torch tensors (float32, bfloat16 or float16,
    dense, contiguous, all on one device); ``momentum_dtype``: torch.float32 or
    torch.bfloat16. ``step(grads)`` takes one tensor (same shape and device, floating
    dtype) or None per parameter. ``momenta`` are tensor views of the per-bucket momentum
    buffers. Everything else is the core's.
    """

    def __init__(self, params: Any, comm: Any, *args: Any,
                 momentum_dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        if momentum_dtype not in MOMENTUM_DTYPES:
            raise UsageError(f"momentum_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{momentum_dtype}")
        for name in ("packed_sign_allreduce", "packed_quantized_allreduce"):
            if not callable(getattr(comm, name, None)):
                raise UsageError(f"the torch engine needs a communicator with {name} "
                                 "(a bitcoll.Communicator)")
        self.momentum_dtype = momentum_dtype
        self.device: torch.device | None = None
        self._stages: list[_Stage] = []
        self._f64: torch.Tensor | None = None
        super().__init__(params, comm, *args, **kwargs)

    # ------------------------------------------------------------------ set-up
    def _check_param(self, p: object, index: int, seen: set[int]) -> None:  # type: ignore[override]
        if not isinstance(p, torch.Tensor):
            raise UsageError(f"parameter {index} must be a torch tensor, got "
                             f"{type(p).__name__}")
        if p.dtype not in PARAM_DTYPES or p.layout != torch.strided:
            raise UsageError(f"parameter {index} must be a dense float32, bfloat16 or float16 "
                             f"tensor, got {p.dtype} ({p.layout})")
        if not p.is_contiguous():
            raise UsageError(f"parameter {index} must be contiguous")
        if self.device is None:
            self.device = p.device
        elif p.device != self.device:
            raise UsageError(f"parameter {index} is on {p.device}, the others on "
                             f"{self.device}; every trainable parameter must be on one device")
        if id(p) in seen:
            raise UsageError(f"parameter {index} appears twice")
        seen.add(id(p))

    @staticmethod
    def _size_of(p: Any) -> int:
        return int(p.numel())

    def _spans(self) -> list[tuple[int, int, int]]:
        return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i)
                for i, p in enumerate(cast(list[torch.Tensor], self.params)) if p.numel()]

    def _allocate_state(self) -> None:
        dev = self.device if self.device is not None else torch.device("cpu")
        self._flat = []
        self._bucket_mom = []
        self._mom = []
        self._tparams: list[torch.Tensor] = cast(list[torch.Tensor], self.params)
        self._tflat: list[torch.Tensor] = [p.view(-1) for p in self._tparams]
        self._tbucket_mom: list[torch.Tensor] = [
            torch.zeros(b.size, dtype=self.momentum_dtype, device=dev) for b in self.buckets]
        self._tmom: list[torch.Tensor] = [
            torch.zeros(0, dtype=self.momentum_dtype, device=dev)] * len(self.params)
        for b in self.buckets:
            for s in b.slots:
                self._tmom[s.index] = self._tbucket_mom[b.index][s.offset:s.stop]

    def _pinned(self, n: int) -> torch.Tensor:
        pin = self.device is not None and self.device.type == "cuda" \
            and torch.cuda.is_available()
        return torch.zeros(n, dtype=torch.uint8, pin_memory=pin)

    def _widths(self) -> tuple[int, int]:
        """Bits per element of the packed votes and of the packed result."""
        kind = self.spec.kind
        if kind == "majority":
            return 1, 1
        levels = self.levels if kind == "quantized" else 1
        return field_width(levels), field_width(levels * self.world_size)

    def _buffer(self, k: int) -> _Stage:  # type: ignore[override]
        """Stage ``k``: its own host buffers (a bucket in flight holds them until it is
        finished) and the device scratch every stage shares (the main thread, and the
        device's stream, use it for one bucket at a time)."""
        dev = self.device if self.device is not None else torch.device("cpu")
        while len(self._stages) <= k:
            size = max((b.size for b in self.buckets), default=0)
            padded = tl.padded(size)
            w_in, w_out = self._widths()
            if self.spec.kind == "global":
                n_in, n_out = 4 * padded, 0
            else:
                n_in, n_out = tl.nbytes(size, w_in), tl.nbytes(size, w_out)

            def u8(k: int) -> torch.Tensor:
                return torch.zeros(k, dtype=torch.uint8, device=dev)

            first = self._stages[0] if self._stages else None
            self._stages.append(_Stage(
                c=first.c if first else torch.zeros(padded, dtype=torch.float32, device=dev),
                t=first.t if first else torch.zeros(padded, dtype=torch.float32, device=dev),
                fields=first.fields if first else u8(padded),
                words=first.words if first
                else torch.zeros(padded // 8, dtype=torch.int64, device=dev),
                dev_in=first.dev_in if first else u8(0 if self.spec.kind == "global" else n_in),
                host_in=self._pinned(n_in),
                host_out=self._pinned(n_out),
                dev_out=first.dev_out if first else u8(n_out),
                aux=first.aux if first else torch.zeros(padded, dtype=torch.int8, device=dev),
                t2=first.t2 if first else torch.zeros(
                    padded if self.spec.kind == "global" else 0, dtype=torch.float32,
                    device=dev)))
        return self._stages[k]

    def _scratch64(self, n: int) -> torch.Tensor:
        if self._f64 is None or self._f64.numel() < n:
            size = max((b.size for b in self.buckets), default=0)
            self._f64 = torch.zeros(size, dtype=torch.float64, device=self.device)
        return self._f64[:n]

    # ------------------------------------------------------------------ properties
    @property
    def momenta(self) -> list[torch.Tensor]:  # type: ignore[override]
        """This rank's momentum of every parameter: views (``momentum_dtype``, on the
        device) shaped like the parameters."""
        return [m.view(p.shape) for m, p in zip(self._tmom, self._tparams, strict=True)]

    # ------------------------------------------------------------------ the step
    def _check_grad(self, i: int, g: object) -> Any:
        if g is None:
            return None
        p = self._tparams[i]
        if not isinstance(g, torch.Tensor) or g.layout != torch.strided \
                or not g.is_floating_point():
            raise UsageError(f"gradient {i} ({self.names[i]}) must be a dense floating "
                             f"tensor or None, got {getattr(g, 'dtype', type(g))}")
        if g.device != p.device:
            raise UsageError(f"gradient {i} ({self.names[i]}) is on {g.device}, the "
                             f"parameter on {p.device}")
        if g.shape != p.shape:
            raise UsageError(f"gradient {i} ({self.names[i]}) has shape "
                             f"{tuple(g.shape)}, the parameter has {tuple(p.shape)}")
        return g.detach().reshape(-1)

    def _check_grads(self, grads: object) -> list[Any]:
        if isinstance(grads, torch.Tensor) or not isinstance(grads, (list, tuple)):
            raise UsageError("grads must be a list with one tensor (or None) per parameter")
        if len(grads) != len(self.params):
            raise UsageError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        return [self._check_grad(i, g) for i, g in enumerate(grads)]

    def _direction(self, s: Slot, c: torch.Tensor, t: torch.Tensor,
                   g: torch.Tensor | None, h: Hyper) -> None:
        """``c = m*b1 + g*a1`` and ``m = m*b2 + g*a2`` (float32 arithmetic, one rounding
        per operation, the numpy kernels' expression)."""
        m = self._tmom[s.index]
        b1, a1, b2, a2 = float(h.b1), float(h.a1), float(h.b2), float(h.a2)
        mf = m if m.dtype == torch.float32 else m.float()
        torch.mul(mf, b1, out=c)
        if g is None:
            if mf is m:
                m.mul_(b2)
            else:
                m.copy_(mf.mul_(b2))
            return
        if g.dtype != torch.float32:
            g = g.float()  # products in float32, not rounded to the gradient's dtype first
        torch.mul(g, a1, out=t)
        c.add_(t)
        torch.mul(g, a2, out=t)
        if mf is m:
            m.mul_(b2).add_(t)
        else:
            m.copy_(mf.mul_(b2).add_(t))

    def _sync(self) -> None:
        """Wait for the work queued on the device (CUDA: its current stream)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _first_bad(self, bucket: Bucket, c: torch.Tensor) -> UsageError:
        """The error naming the first parameter of ``bucket`` whose ``c`` is not finite."""
        for s in bucket.slots:
            if not bool(torch.isfinite(c[s.offset:s.stop]).all()):
                return self._non_finite(s.index)
        return self._non_finite(bucket.slots[0].index)

    def _prepare(self, bucket: Bucket, buf: _Stage, grads: list[Any],  # type: ignore[override]
                 hypers: list[Hyper]) -> None:
        """This rank's votes of ``bucket``, packed, copied into ``buf.host_in``."""
        n = bucket.size
        kind = self.spec.kind
        c = buf.c[:n]
        for s in bucket.slots:
            if kind == "global":
                g = grads[s.index]
                if g is None:
                    c[s.offset:s.stop].zero_()
                else:
                    c[s.offset:s.stop].copy_(g)
            else:
                self._direction(s, c[s.offset:s.stop], buf.t[s.offset:s.stop],
                                grads[s.index], hypers[s.index])
        lo, hi = torch.aminmax(c)
        if kind == "global":
            nb = 4 * n
            host = buf.host_in[:nb]
            host.view(torch.float32).copy_(c, non_blocking=True)
        else:
            fields = buf.fields
            if kind == "majority":
                torch.ge(c, 0, out=fields[:n].view(torch.bool))
            elif kind == "quantized":
                self._quantize(bucket, buf, lo, hi)
            else:  # ternary signs + 1 as 2-bit fields: (c > 0) + (c >= 0)
                torch.gt(c, 0, out=fields[:n].view(torch.bool))
                ge = buf.aux[:n].view(torch.bool)
                torch.ge(c, 0, out=ge)
                fields[:n].add_(ge.view(torch.uint8))
            fields[n:tl.padded(n)].zero_()
            w_in = self._widths()[0]
            nb = tl.nbytes(n, w_in)
            tl.pack(fields[:tl.padded(n)], n, w_in, buf.dev_in[:nb],
                    buf.words[:tl.padded(n) // 8])
            host = buf.host_in[:nb]
            host.copy_(buf.dev_in[:nb], non_blocking=True)
        self._sync()
        self._device_to_host += nb
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            raise self._first_bad(bucket, c)

    def _quantize(self, bucket: Bucket, buf: _Stage, lo: torch.Tensor,
                  hi: torch.Tensor) -> None:
        """``buf.fields[:n] = quantize(c, method, levels) + levels`` per tensor, with the
        numpy core's scales (:func:`lioncub.quantize.tensor_scale`) and multipliers."""
        method = self.spec.method
        assert method is not None
        n = bucket.size
        c = buf.c[:n]
        levels = self.levels
        parts: list[torch.Tensor] = [lo.double(), hi.double()]
        if method == "linf":
            for s in bucket.slots:
                a, b = torch.aminmax(c[s.offset:s.stop])
                parts.append(torch.maximum(a.neg(), b).double())
        else:
            d = self._scratch64(n)
            d.copy_(c).abs_()
            if method == "l0":
                counts = [torch.count_nonzero(c[s.offset:s.stop]) for s in bucket.slots]
                d.masked_fill_(d == 0, 1.0).log_()
            for s in bucket.slots:
                parts.append(d[s.offset:s.stop].sum())
            if method == "l0":
                parts.extend(x.double() for x in counts)
        values = torch.stack(parts).tolist()  # one synchronization per bucket
        if not (math.isfinite(values[0]) and math.isfinite(values[1])):
            self._sync()
            raise self._first_bad(bucket, c)
        t = buf.t[:n]
        k = len(bucket.slots)
        for j, s in enumerate(bucket.slots):
            v = values[2 + j]
            if method == "l1":
                scale = v / s.size
            elif method == "linf":
                scale = v
            else:
                count = int(values[2 + k + j])
                scale = 0.0 if count == 0 else math.exp(v / count)
            mult = multiplier(method, levels, scale)
            if mult is None:
                t[s.offset:s.stop].zero_()
            else:
                torch.mul(c[s.offset:s.stop], float(mult), out=t[s.offset:s.stop])
        t.clamp_(-levels, levels).round_()
        q = buf.aux[:n]
        q.copy_(t)  # exact: integers in [-levels, levels]
        torch.add(q.view(torch.uint8), levels, out=buf.fields[:n])  # value + levels (mod 256)

    def _start(self, bucket: Bucket, buf: _Stage) -> Any:  # type: ignore[override]
        """Start the bucket's collective on the host buffers (async); return its Work."""
        n = bucket.size
        kind = self.spec.kind
        algo = self.spec.algorithm
        comm: Any = self.comm
        t0 = time.perf_counter()
        if kind == "global":
            host = buf.host_in[:4 * n].view(torch.float32).numpy()
            work = comm.allreduce(host, op="avg", out=host, async_op=True)
        else:
            w_in, w_out = self._widths()
            votes = buf.host_in[:tl.nbytes(n, w_in)].numpy()
            result = buf.host_out[:tl.nbytes(n, w_out)].numpy()
            if kind == "majority":
                work = comm.packed_sign_allreduce(votes, n, tie=self._tie_for(bucket.index),
                                                  out=result, async_op=True, algorithm=algo)
            else:
                levels = self.levels if kind == "quantized" else 1
                work = comm.packed_quantized_allreduce(votes, n, levels, out=result,
                                                       async_op=True, algorithm=algo)
        self._comm_seconds += time.perf_counter() - t0
        return work

    def _finish(self, bucket: Bucket, buf: _Stage, work: Any,  # type: ignore[override]
                hypers: list[Hyper], sums: dict[int, int]) -> None:
        """Wait for the collective, copy its packed result to the device, unpack, update."""
        t0 = time.perf_counter()
        work.wait()
        self._comm_seconds += time.perf_counter() - t0
        n = bucket.size
        kind = self.spec.kind
        if kind == "global":
            c = buf.c[:n]
            c.copy_(buf.host_in[:4 * n].view(torch.float32), non_blocking=True)
            self._host_to_device += 4 * n
            for s in bucket.slots:
                h = hypers[s.index]
                u = buf.t[s.offset:s.stop]
                self._direction(s, u, buf.t2[s.offset:s.stop], c[s.offset:s.stop], h)
                self._apply(s, u.sign_(), h)
            return
        w_out = self._widths()[1]
        nb = tl.nbytes(n, w_out)
        buf.dev_out[:nb].copy_(buf.host_out[:nb], non_blocking=True)
        self._host_to_device += nb
        if kind == "majority":
            bits = buf.fields[:tl.padded(n)]
            tl.unpack(buf.dev_out[:nb], n, 1, bits, buf.words[:tl.padded(n) // 8])
            sgn = bits[:n].mul_(2).sub_(1).view(torch.int8)  # 1 -> +1, 0 -> -1
            for s in bucket.slots:
                self._apply(s, sgn[s.offset:s.stop], hypers[s.index])
            return
        bias = (self.levels if kind == "quantized" else 1) * self.world_size
        if w_out <= 8:
            f = buf.fields[:tl.padded(n)]
            tl.unpack(buf.dev_out[:nb], n, w_out, f, buf.words[:tl.padded(n) // 8])
            total = f[:n].sub_(bias).view(torch.int8)  # the sums (|sum| <= 127)
        else:
            total = tl.unpack_wide(buf.dev_out[:nb], n, w_out).sub_(bias)
        totals: list[torch.Tensor] = []
        if kind == "mean":
            # u = sum / p takes 2p + 1 values: lr * u from a table computed as the numpy
            # kernel computes it (torch's division by a scalar multiplies by its reciprocal)
            world = self.world_size
            quotients = np.arange(-world, world + 1, dtype=np.float32) / np.float32(world)
            index = total.to(torch.int64).add_(world)
            for s in bucket.slots:
                h = hypers[s.index]
                table = torch.from_numpy(h.lr * quotients).to(self._tflat[s.index].device)
                p = self._tflat[s.index]
                if float(h.decay) != 1.0:
                    p.mul_(float(h.decay))
                p.sub_(table[index[s.offset:s.stop]])
        else:
            sgn = torch.sign(total) if total.dtype != torch.int8 \
                else torch.sign(total, out=buf.aux[:n])
            for s in bucket.slots:
                self._apply(s, sgn[s.offset:s.stop], hypers[s.index])
        mag = total.abs_()
        for s in bucket.slots:
            totals.append(_int_sum(mag[s.offset:s.stop], bias))
        for s, v in zip(bucket.slots, torch.stack(totals).tolist(), strict=True):
            sums[s.index] = int(v)

    def _apply(self, s: Slot, u: torch.Tensor, h: Hyper) -> None:
        """``p = p*decay - lr*u`` for ``u`` in {-1, 0, 1} (``lr*u`` is exact; ``p*1`` is
        ``p``, so a decay of 1 skips the product)."""
        p = self._tflat[s.index]
        if float(h.decay) != 1.0:
            p.mul_(float(h.decay))
        p.sub_(u, alpha=float(h.lr))

    # ------------------------------------------------------------------ momentum sync
    def average_momenta(self, bucket: int, slots: list[Slot] | None = None) -> None:  # type: ignore[override]
        """:meth:`lioncub.DistributedLion.average_momenta` through one float32 host copy
        (counted in the step's device/host bytes)."""
        mom = self._tbucket_mom[bucket]
        chosen = list(self.buckets[bucket].slots) if slots is None else list(slots)
        t0 = time.perf_counter()
        parts = [mom[s.offset:s.stop] for s in chosen]
        host = torch.cat(parts).to(device="cpu", dtype=torch.float32)
        self._device_to_host += host.numel() * mom.element_size()
        arr = host.numpy()
        self.comm.allreduce(arr, op="avg", out=arr)
        back = host.to(device=mom.device, dtype=mom.dtype)
        self._host_to_device += host.numel() * mom.element_size()
        pos = 0
        for s, part in zip(chosen, parts, strict=True):
            part.copy_(back[pos:pos + s.size])
            pos += s.size
        self._comm_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ checkpoints
    def _momentum_copies(self) -> list[Any]:
        return [m.detach().clone() for m in self.momenta]

    def _check_momentum(self, i: int, m: Any) -> None:
        p = self._tparams[i]
        if not isinstance(m, torch.Tensor):
            m = torch.as_tensor(np.asarray(m))
        if tuple(m.shape) != tuple(p.shape) or not m.is_floating_point():
            raise UsageError(f"momentum {i} has shape {tuple(m.shape)} / dtype {m.dtype}, "
                             f"expected {tuple(p.shape)} / a floating dtype")

    def _load_momentum(self, i: int, m: Any) -> None:
        if not isinstance(m, torch.Tensor):
            m = torch.as_tensor(np.asarray(m))
        self._tmom[i].copy_(m.reshape(-1))
