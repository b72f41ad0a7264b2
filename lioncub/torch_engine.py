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

That is ``packing="device"`` (:attr:`TorchEngine.packing`), the default on a GPU. On a CPU
there is no bus to cross, and the default is ``packing="host"``: steps 2 and 4 go, the
votes (``c`` itself for the sign-based variants, the int8 values for the quantized ones)
are written into the stage's own host buffer and handed to bitcoll's unpacked collective
(``sign_allreduce`` / ``quantized_allreduce``, which packs them on the way to the wire, as
for the numpy core), and its result (one int8 or int16 per element) is applied where it
lies: the same results and wire bytes, without packing twice; the step's device/host byte
counts are 0.

On a CPU the element-wise work of steps 1 and 4 goes tile by tile (:data:`CPU_TILE`
elements, :attr:`TorchEngine.tile`): every tile passes through Lion's interpolation, the
extrema, the variant's per-tile work (its votes or partial scales), the packing, and later
the unpacking and the update while it is in the cache; a GPU takes whole tensors. The tile
size changes nothing but the order of the float64 scale sums of "l1" and "l0" (summed per
tile; see Arithmetic below).

What differs between variants in steps 1-4 (the contribution, its encoding, the collective,
the decoding and the update) is the variant's torch strategy (:mod:`lioncub.torch_strategies`),
the counterpart of its numpy strategy (:mod:`lioncub.strategies`); the engine does the rest
(buffers, synchronization, byte counts, the finiteness check) and never branches on the variant.
A variant whose strategy class has no torch counterpart is refused (UsageError) at
construction.

"global" moves float32 gradients (4 bytes per element each way), as the numpy core does.
The exact sums of ternary signs ("lioncub-sign", "dlion-avg") travel as
``packed_quantized_allreduce`` fields with ``levels=1`` (the values, the algorithm and the
bytes on the wire are those of ``sign_allreduce(op="sum")``).

Arithmetic: every element-wise operation is one float32 operation rounded as numpy rounds
it (``c = m*b1 + g*a1`` as two products and a sum, the update as ``p*decay - lr*u``), so
for float32 parameters the trajectory is the numpy core's bit for bit, except for one
difference in order: the per-tensor scale sums of "l1" (``sum|c|``) and "l0"
(``sum log|c|``, from exponents summed as integers and float64 products of 256 mantissas,
as the numpy kernel takes it) are float64 reductions in torch's order (per tile, the
tiles' sums then added in order) rather than the numpy kernels' fixed lanes. They agree to
about 1e-14
relative, and the scale enters the votes only through the float32 multiplier, which the
two orders round to the same value except in the rare case where the float64 sums straddle
a float32 rounding boundary (then single votes may differ by one level). bfloat16 / float16
parameters are updated in their dtype (``p*decay`` rounded, then ``- lr*u`` rounded); a
bfloat16 momentum is advanced in float32 and rounded once per step.

Replicas stay identical on every rank: the collective's result is identical everywhere and
the update is element-wise, so every rank applies the same bits (the scale each rank uses
to quantize its own vote is that rank's business, as in the numpy core).

This module imports torch; :mod:`lioncub.torch` builds the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from bitcoll.errors import UsageError

from . import torch_layout as tl
from .buckets import Bucket, Slot
from .distributed import DistributedLion
from .lion import Hyper
from .replicas import ReplicaSet
from .strategies import VariantStrategy
from .torch_strategies import Stage, TorchStrategy, torch_strategy_for
from .variants import VariantSpec

__all__ = ["TorchEngine", "TensorReplicas", "PARAM_DTYPES", "MOMENTUM_DTYPES", "CPU_TILE",
           "PACKINGS"]

#: Parameter dtypes of the torch engine.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Momentum dtypes of the torch engine.
MOMENTUM_DTYPES = (torch.float32, torch.bfloat16)

#: Where the votes are packed (:attr:`TorchEngine.packing`).
PACKINGS = ("auto", "device", "host")

#: Elements per tile of the element-wise passes on a CPU: a tensor is processed in ranges of
#: this many elements, each going through all the operations of a pass while it is in the
#: cache (:attr:`TorchEngine.tile`).
CPU_TILE = 1 << 18

_NUMPY_VIEW = {torch.float32: torch.float32, torch.float16: torch.float16,
               torch.bfloat16: torch.int16}


def host_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy array over the bytes of the CPU tensor ``t`` (bfloat16 as int16)."""
    return t.detach().view(_NUMPY_VIEW.get(t.dtype, t.dtype)).numpy()


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


class TorchEngine(DistributedLion):
    """:class:`lioncub.DistributedLion` on torch tensors (module docstring).

    ``params``: as for the numpy core, but torch tensors (float32, bfloat16 or float16,
    dense, contiguous, all on one device); ``momentum_dtype``: torch.float32 or
    torch.bfloat16. ``step(grads)`` takes one tensor (same shape and device, floating
    dtype) or None per parameter. ``momenta`` are tensor views of the per-bucket momentum
    buffers. ``device_strategy`` is the variant's
    :class:`lioncub.torch_strategies.TorchStrategy`. ``tile``: elements per tile of the
    element-wise passes (:data:`CPU_TILE` on a CPU, 0 = whole tensors elsewhere; set before
    the first step to change it; only the order of the float64 scale sums depends on it).
    ``packing``: "device", "host" (CPU parameters only; UsageError otherwise) or "auto"
    (module docstring), resolved at construction. Everything else is the core's.
    """

    def __init__(self, params: Any, comm: Any, *args: Any,
                 momentum_dtype: torch.dtype = torch.float32, packing: str = "auto",
                 **kwargs: Any) -> None:
        if momentum_dtype not in MOMENTUM_DTYPES:
            raise UsageError(f"momentum_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{momentum_dtype}", argument="momentum_dtype")
        if packing not in PACKINGS:
            raise UsageError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}",
                             argument="packing")
        self.packing = packing
        for name in ("packed_sign_allreduce", "packed_quantized_allreduce"):
            if not callable(getattr(comm, name, None)):
                raise UsageError(f"the torch engine needs a communicator with {name} "
                                 "(a bitcoll.Communicator)", argument="comm")
        self.momentum_dtype = momentum_dtype
        self.device: torch.device | None = None
        self._stages: list[Stage] = []
        self._f64: torch.Tensor | None = None
        self._f32: torch.Tensor | None = None
        self.tile = 0
        self._extrema: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._extrema_of: list[int] = []
        self._covered = 0
        super().__init__(params, comm, *args, **kwargs)

    # ------------------------------------------------------------------ set-up
    def _make_strategy(self, spec: VariantSpec) -> VariantStrategy:
        """The core's strategy, and its torch counterpart (:attr:`device_strategy`, from
        :mod:`lioncub.torch_strategies`; UsageError when the variant has none)."""
        strategy = super()._make_strategy(spec)
        self.device_strategy: TorchStrategy = torch_strategy_for(strategy)
        return strategy

    def _check_param(self, p: object, index: int, seen: set[int]) -> None:  # type: ignore[override]
        if not isinstance(p, torch.Tensor):
            raise UsageError(f"parameter {index} must be a torch tensor, got "
                             f"{type(p).__name__}", argument="params", index=index)
        if p.dtype not in PARAM_DTYPES or p.layout != torch.strided:
            raise UsageError(f"parameter {index} must be a dense float32, bfloat16 or float16 "
                             f"tensor, got {p.dtype} ({p.layout})", argument="params", index=index)
        if not p.is_contiguous():
            raise UsageError(f"parameter {index} must be contiguous",
                             argument="params", index=index)
        if self.device is None:
            self.device = p.device
        elif p.device != self.device:
            raise UsageError(f"parameter {index} is on {p.device}, the others on "
                             f"{self.device}; every trainable parameter must be on one device",
                             argument="params", index=index)
        if id(p) in seen:
            raise UsageError(f"parameter {index} appears twice", argument="params", index=index)
        seen.add(id(p))

    @staticmethod
    def _size_of(p: Any) -> int:
        return int(p.numel())

    def _spans(self) -> list[tuple[int, int, int]]:
        return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i)
                for i, p in enumerate(cast(list[torch.Tensor], self.params)) if p.numel()]

    def _allocate_state(self) -> None:
        dev = self.device if self.device is not None else torch.device("cpu")
        if self.packing == "auto":
            self.packing = "host" if dev.type == "cpu" else "device"
        elif self.packing == "host" and dev.type != "cpu":
            raise UsageError(f"packing='host' needs the parameters on the CPU, they are on "
                             f"{dev}: on a device the votes are packed there so that only "
                             "packed bytes cross to the host (packing='device')",
                             argument="packing")
        if not self.tile:
            self.tile = CPU_TILE if dev.type == "cpu" else 0
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

    def _buffer(self, k: int) -> Stage:  # type: ignore[override]
        """Stage ``k``: its own host buffers (a bucket in flight holds them until it is
        finished) and the device scratch every stage shares (the main thread, and the
        device's stream, use it for one bucket at a time); the strategy-dependent sizes are
        the device strategy's."""
        dev = self.device if self.device is not None else torch.device("cpu")
        while len(self._stages) <= k:
            size = max((b.size for b in self.buckets), default=0)
            padded = tl.padded(size)
            sizes = self.device_strategy.stage_sizes(self, size)

            def u8(k: int) -> torch.Tensor:
                return torch.zeros(k, dtype=torch.uint8, device=dev)

            first = self._stages[0] if self._stages else None
            self._stages.append(Stage(
                c=first.c if first else torch.zeros(padded, dtype=torch.float32, device=dev),
                t=first.t if first else torch.zeros(padded, dtype=torch.float32, device=dev),
                fields=first.fields if first else u8(padded),
                words=first.words if first
                else torch.zeros(padded // 8, dtype=torch.int64, device=dev),
                dev_in=first.dev_in if first else u8(sizes.dev_in),
                host_in=self._pinned(sizes.host_in),
                host_out=self._pinned(sizes.host_out),
                dev_out=first.dev_out if first else u8(sizes.dev_out),
                aux=first.aux if first else torch.zeros(padded, dtype=torch.int8, device=dev),
                t2=first.t2 if first else torch.zeros(sizes.t2, dtype=torch.float32,
                                                       device=dev)))
        return self._stages[k]

    def scratch64(self, n: int) -> torch.Tensor:
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
            raise self._bad_grad(i, "must be a dense floating tensor or None, got "
                                    f"{getattr(g, 'dtype', type(g))}")
        if g.device != p.device:
            raise self._bad_grad(i, f"is on {g.device}, the parameter on {p.device}")
        if g.shape != p.shape:
            raise self._bad_grad(i, f"has shape {tuple(g.shape)}, the parameter has "
                                    f"{tuple(p.shape)}")
        return g.detach().reshape(-1)

    def _check_grads(self, grads: object) -> list[Any]:
        if isinstance(grads, torch.Tensor) or not isinstance(grads, (list, tuple)):
            raise UsageError("grads must be a list with one tensor (or None) per parameter",
                             argument="grads")
        if len(grads) != len(self.params):
            raise UsageError(f"got {len(grads)} gradients for {len(self.params)} parameters",
                             argument="grads")
        return [self._check_grad(i, g) for i, g in enumerate(grads)]

    def tiles(self, size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of at most :attr:`tile` elements covering ``[0, size)``
        in order (one range on a GPU, where a pass covers the whole tensor)."""
        step = self.tile if self.tile > 0 else max(size, 1)
        return [(a, min(size, a + step)) for a in range(0, size, step)]

    def direction(self, s: Slot, c: torch.Tensor, t: torch.Tensor,
                   g: torch.Tensor | None, h: Hyper,
                   each: Callable[[int, torch.Tensor, torch.Tensor | None,
                                   torch.Tensor | None], None] | None = None,
                   keep: bool = True) -> None:
        """``c = m*b1 + g*a1`` and ``m = m*b2 + g*a2`` (float32 arithmetic, one rounding
        per operation, the numpy kernels' expression), tile by tile (``t``: scratch of at
        least one tile). While a bucket is being prepared, every tile's minimum and maximum
        are recorded (the engine's finiteness check; not for a strategy that
        :meth:`~lioncub.torch_strategies.TorchStrategy.checks_finite` itself) and
        ``each(start, tile, lo, hi)`` is called with the tile of ``c`` just written (elements
        ``[start, start + tile.numel())`` of the slot) and its extrema (0-d tensors, None
        when none are recorded), in order. ``keep=False``: ``c`` is not kept (every tile is
        computed into the first tile of ``c``, for ``each`` only)."""
        m = self._tmom[s.index]
        b1, a1, b2, a2 = float(h.b1), float(h.a1), float(h.b2), float(h.a2)
        low = m.dtype != torch.float32
        if g is not None and g.dtype != torch.float32:
            g = g.float()  # products in float32, not rounded to the gradient's dtype first
        for a, b in self.tiles(s.size):
            mt, ct, tt = m[a:b], c[a:b] if keep else c[:b - a], t[:b - a]
            mf = mt.float() if low else mt
            torch.mul(mf, b1, out=ct)
            if g is None:
                mf.mul_(b2)
            else:
                gt = g[a:b]
                torch.mul(gt, a1, out=tt)
                ct.add_(tt)
                torch.mul(gt, a2, out=tt)
                mf.mul_(b2).add_(tt)
            if low:
                mt.copy_(mf)
            lo = hi = None
            if self._extrema is not None:
                lo, hi = torch.aminmax(ct)
                self._extrema.append((lo, hi))
                self._extrema_of.append(s.index)
                self._covered += b - a
            if each is not None:
                each(a, ct, lo, hi)

    def flat_tensor(self, index: int) -> torch.Tensor:
        """Parameter ``index`` as a flat view of its tensor (its own dtype and device)."""
        return self._tflat[index]

    def sync_device(self) -> None:
        """Wait for the work queued on the device (CUDA: its current stream)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def first_bad(self, bucket: Bucket, c: torch.Tensor) -> UsageError:
        """The error naming the first parameter of ``bucket`` whose ``c`` is not finite."""
        for s in bucket.slots:
            if not bool(torch.isfinite(c[s.offset:s.stop]).all()):
                return self.non_finite(s.index)
        return self.non_finite(bucket.slots[0].index)

    def _prepare(self, bucket: Bucket, buf: Stage, grads: list[Any],  # type: ignore[override]
                 hypers: list[Hyper]) -> None:
        """This rank's contribution of ``bucket`` computed and encoded on the device and
        copied into ``buf.host_in`` (the device strategy's); UsageError naming the first
        parameter whose ``c`` is not finite (found from the tiles' extrema, or by the
        strategy when it :meth:`~lioncub.torch_strategies.TorchStrategy.checks_finite`)."""
        strategy = self.device_strategy
        c = strategy.contribution(self, buf)[:bucket.size]
        if strategy.checks_finite():
            strategy.contribute(self, bucket, buf, grads, hypers)
            self._device_to_host += strategy.encode(self, bucket, buf, None, None)
            self.sync_device()
            return
        self._extrema, self._extrema_of, self._covered = [], [], 0
        tiles: torch.Tensor | None = None  # the tiles' extrema when they cover the bucket
        try:
            strategy.contribute(self, bucket, buf, grads, hypers)
            if self._covered == bucket.size and self._extrema:
                tiles = torch.stack([torch.stack([e[0] for e in self._extrema]),
                                     torch.stack([e[1] for e in self._extrema])])
                lo, hi = tiles[0].min(), tiles[1].max()
            else:
                lo, hi = torch.aminmax(c)
            owners = self._extrema_of
        finally:
            self._extrema = None
        nb = strategy.encode(self, bucket, buf, lo, hi)
        self.sync_device()
        self._device_to_host += nb
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            if tiles is None:
                raise self.first_bad(bucket, c)
            for index, a, b in zip(owners, *tiles.tolist(), strict=True):
                if not (math.isfinite(a) and math.isfinite(b)):
                    raise self.non_finite(index)
            raise self.non_finite(bucket.slots[0].index)

    def _start(self, bucket: Bucket, buf: Stage) -> Any:  # type: ignore[override]
        """Start the bucket's collective on the host buffers (the device strategy's, async);
        return its Work."""
        t0 = time.perf_counter()
        work = self.device_strategy.start(self, bucket, buf)
        self._comm_seconds += time.perf_counter() - t0
        return work

    def _finish(self, bucket: Bucket, buf: Stage, work: Any,  # type: ignore[override]
                hypers: list[Hyper], sums: dict[int, int]) -> None:
        """Wait for the collective, copy its result to the device, update (the device
        strategy's fetch and apply)."""
        t0 = time.perf_counter()
        work.wait()
        self._comm_seconds += time.perf_counter() - t0
        self._host_to_device += self.device_strategy.fetch(self, bucket, buf)
        self.device_strategy.apply(self, bucket, buf, hypers, sums)

    def apply_update(self, s: Slot, u: torch.Tensor, h: Hyper, start: int = 0) -> None:
        """``p = p*decay - lr*u`` for ``u`` in {-1, 0, 1} (any real dtype; ``lr*u`` is
        exact; ``p*1`` is ``p``, so a decay of 1 skips the product), tile by tile; ``u``
        holds elements ``[start, start + u.numel())`` of the parameter. A ``u`` other than
        float32 is converted tile by tile into the engine's float32 scratch (not into a
        new tensor per tile: fresh memory costs page faults on a CPU)."""
        p = self._tflat[s.index][start:start + u.numel()]
        decay, lr = float(h.decay), float(h.lr)
        wide = u.dtype != torch.float32
        for a, b in self.tiles(u.numel()):
            pt, ut = p[a:b], u[a:b]
            if wide:
                ut = self.scratch32(b - a).copy_(ut)
            if decay != 1.0:
                pt.mul_(decay)
            pt.sub_(ut, alpha=lr)

    def scratch32(self, n: int) -> torch.Tensor:
        """Float32 scratch of ``n`` elements (grown when asked for more), for :meth:`apply_update`
        and the strategies' updates."""
        if self._f32 is None or self._f32.numel() < n:
            self._f32 = torch.zeros(max(n, self.tile), dtype=torch.float32, device=self.device)
        return self._f32[:n]

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
                             f"expected {tuple(p.shape)} / a floating dtype",
                             argument="state", index=i)

    def _load_momentum(self, i: int, m: Any) -> None:
        if not isinstance(m, torch.Tensor):
            m = torch.as_tensor(np.asarray(m))
        self._tmom[i].copy_(m.reshape(-1))
