"""One strategy object per distributed Lion variant: what a rank sends, which collective carries
it, how the result updates the parameters.

The optimizer core (:class:`lioncub.DistributedLion`) owns everything that is the same for
every variant: parameters, per-bucket momenta, the bucket layout, the pipeline of two buckets
in flight, overlap with the backward pass, hyperparameters, timing and traffic statistics,
momentum synchronization, replicas and checkpoints. For everything that differs it calls the
variant's strategy, the way DistributedDataParallel calls its communication hook. Per bucket
and step, in this order:

1. :meth:`VariantStrategy.buffers` (once per pipeline stage, at the first step): the flat
   buffers a stage needs, sized for the largest bucket.
2. :meth:`VariantStrategy.prepare`: this rank's contribution of the bucket into the buffers
   (for the local-momentum variants, Lion's ``c = beta1 m + (1 - beta1) g`` with this rank's
   momentum, advanced at the same time, then the votes).
3. :meth:`VariantStrategy.start`: start bitcoll's collective on the buffers with
   ``async_op=True`` and return its Work (the core times the call and waits for the Work).
4. :meth:`VariantStrategy.finish`: after the Work completed, apply the result to the
   bucket's parameters (identically on every rank) and record the per-tensor vote sums.

A front end that applies the update elsewhere (:mod:`lioncub.torch_hooks`: the strategy runs
inside DistributedDataParallel's communication hooks and an optimizer step applies the result
later) calls :meth:`VariantStrategy.update` instead of :meth:`~VariantStrategy.finish`: it
writes the direction ``u`` of every element, so that ``p * decay - lr * u`` (float32, each
operation rounded) is bitwise the parameter :meth:`~VariantStrategy.finish` would have
written; the momenta advance exactly as with :meth:`~VariantStrategy.finish`.

The class attributes tell the core the rest: :attr:`~VariantStrategy.local_momentum`,
:attr:`~VariantStrategy.yields_sums`, :attr:`~VariantStrategy.uses_levels`,
:attr:`~VariantStrategy.breaks_ties`. Bytes on the wire are counted by the communicator
(``last_stats.bytes_sent``), so a strategy does not account for them.

Classes, one per aggregation rule; a variant is a :class:`lioncub.variants.VariantSpec`
binding a public name to one of them with its bitcoll ``algorithm`` and quantizer
``method`` (:data:`lioncub.variants.SPECS` is the registry; :func:`lioncub.variants.register`
adds one):

=======================  ========  ==========================================================
class                    kind      variants
=======================  ========  ==========================================================
:class:`GlobalAverage`   global    ``global``
:class:`MajorityVote`    majority  ``dlion-mavo``, ``lioncub-mavo``
:class:`SignMean`        mean      ``dlion-avg``
:class:`SignSum`         sign-sum  ``lioncub-sign``
:class:`QuantizedSum`    quantized ``lioncub-l1``, ``lioncub-l0``, ``lioncub-linf``
=======================  ========  ==========================================================

Adding a variant: subclass :class:`VariantStrategy` (usually reusing :meth:`direction`,
:meth:`apply_signs`), then ``register(VariantSpec("name", MyStrategy, summary=...))`` on every
rank before constructing the optimizer. The torch engine runs a variant only if its class also
has a torch counterpart (:mod:`lioncub.torch_strategies`).

Strategies hold no per-step state; the core passes itself to every hook, as the narrow
:class:`lioncub.step_view.StepView` (its communicator, world size, levels, flat parameter
views, momenta, tie rule and non-finite error): a strategy needs nothing else of the core and
can be driven by any object that has those members. This module does not import torch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from bitcoll.errors import UsageError

from . import kernels
from .buckets import Bucket, Slot
from .comm import WorkLike
from .lion import Hyper
from .quantize import METHODS, multiplier, tensor_scale
from .step_view import SpecView, StepView

__all__ = ["Buffers", "VariantStrategy", "GlobalAverage", "MajorityVote", "ExactSum",
           "SignSum", "SignMean", "QuantizedSum"]

F32 = npt.NDArray[np.float32]
Array = npt.NDArray[Any]


@dataclass
class Buffers:
    """One pipeline stage's flat buffers, sized for the largest bucket.

    ``f``: float32, the contribution (``c``, or the gradient copy of "global"); the core also
    uses stage 0's ``f`` as scratch when it averages momenta, so every strategy provides it.
    ``q``: int8 votes (quantized variants) or None. ``s``: the collective's result (int8 for
    the 1-bit majority, int16 for exact sums)."""

    f: F32
    q: Array | None
    s: Array


class VariantStrategy(ABC):
    """How one variant communicates and updates (module docstring); one object per optimizer.

    ``spec``: the variant's :class:`lioncub.variants.VariantSpec` (``name``, ``algorithm``:
    the bitcoll algorithm of the collective or None for bitcoll's default, ``method``: the
    quantizer or None). Subclasses set :attr:`kind` and implement :meth:`prepare`,
    :meth:`start` and :meth:`finish`; the constructor raises UsageError for a spec the
    strategy cannot run."""

    #: Short name of the aggregation rule (``VariantSpec.kind``).
    kind: ClassVar[str]
    #: Every rank keeps its own momentum, fed by its own gradients (the core synchronizes
    #: them on the momentum schedule); False: one shared momentum, identical everywhere.
    local_momentum: ClassVar[bool] = True
    #: :meth:`finish` records exact per-tensor vote sums ``sum |total|`` (agreement, adaptive
    #: momentum sync).
    yields_sums: ClassVar[bool] = False
    #: The optimizer's ``levels`` matter (else they are 1).
    uses_levels: ClassVar[bool] = False
    #: The collective breaks ties with the optimizer's tie rule (:meth:`tie`); the core's tie
    #: counter advances once per step.
    breaks_ties: ClassVar[bool] = False
    #: dtype of :attr:`Buffers.s`.
    result_dtype: ClassVar[type[np.integer[Any]]] = np.int16

    def __init__(self, spec: SpecView) -> None:
        self.spec = spec

    # ------------------------------------------------------------------ hooks
    def buffers(self, size: int) -> Buffers:
        """A stage's buffers for buckets of at most ``size`` elements (default: ``f``, ``s``
        of :attr:`result_dtype`, no ``q``)."""
        return Buffers(np.zeros(size, np.float32), None, np.zeros(size, self.result_dtype))

    @abstractmethod
    def prepare(self, core: StepView, bucket: Bucket, buf: Buffers,
                grads: Sequence[F32 | None], hypers: Sequence[Hyper]) -> None:
        """This rank's contribution of ``bucket`` into ``buf`` (``grads`` and ``hypers``:
        one entry per parameter, flat float32 gradients or None for a zero gradient).
        Raises the core's non-finite UsageError
        (:meth:`~lioncub.step_view.StepView.non_finite`) for a non-finite value."""

    @abstractmethod
    def start(self, core: StepView, bucket: Bucket, buf: Buffers) -> WorkLike:
        """Start the bucket's collective on ``core.comm`` (``async_op=True``) over the first
        ``bucket.size`` elements of ``buf``; return its Work."""

    @abstractmethod
    def finish(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        """Apply the completed collective's result in ``buf`` to the bucket's parameters;
        with :attr:`yields_sums`, set ``sums[index]`` of every parameter of the bucket."""

    def update(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], out: F32, sums: dict[int, int]) -> None:
        """Like :meth:`finish`, but write the update direction ``u`` of the bucket's
        elements into ``out`` (float32, bucket coordinates) instead of changing the
        parameters: ``p * decay - lr * u``, rounded operation by operation, is bitwise what
        :meth:`finish` writes. With :attr:`yields_sums`, set ``sums[index]``. The default
        raises UsageError (a registered strategy that only implements :meth:`finish`)."""
        raise UsageError(f"variant {self.spec.name!r} ({type(self).__name__}) has no update() "
                         "(needed to run inside DistributedDataParallel's hooks)")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def direction(core: StepView, s: Slot, out: F32, grads: Sequence[F32 | None],
                  hypers: Sequence[Hyper]) -> tuple[float, float]:
        """``out = beta1 m + (1 - beta1) g`` for slot ``s`` (``out``: its part of a flat
        buffer) with this rank's momentum ``m``, advanced to ``beta2 m + (1 - beta2) g``;
        returns ``(sum |out|, max |out|)``. UsageError for a non-finite value."""
        h = hypers[s.index]
        total, amax = kernels.direction_with_max(core.flat_momentum(s.index), grads[s.index],
                                                 out, h.b1, h.a1, h.b2, h.a2)
        if not math.isfinite(total):
            raise core.non_finite(s.index)
        return total, amax

    @staticmethod
    def apply_signs(core: StepView, s: Slot, votes: Array, h: Hyper) -> int:
        """``p = p * decay - lr * sign(votes)`` for slot ``s`` (``votes``: its part of an
        integer result); returns ``sum |votes|``."""
        return kernels.apply_sign(core.flat_param(s.index), votes, h.lr, h.decay)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec.name}>"


class GlobalAverage(VariantStrategy):
    """Global Lion: float32 average of the gradients, then Lion with one shared momentum."""

    kind = "global"
    local_momentum = False

    def prepare(self, core: StepView, bucket: Bucket, buf: Buffers,
                grads: Sequence[F32 | None], hypers: Sequence[Hyper]) -> None:
        for s in bucket.slots:
            g = grads[s.index]
            f = buf.f[s.offset:s.stop]
            if g is None:
                f.fill(0.0)
            elif not kernels.copy_checked(g, f):
                raise core.non_finite(s.index)

    def start(self, core: StepView, bucket: Bucket, buf: Buffers) -> WorkLike:
        n = bucket.size
        return core.comm.allreduce(buf.f[:n], op="avg", out=buf.f[:n], async_op=True)

    def finish(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        for s in bucket.slots:
            i = s.index
            h = hypers[i]
            kernels.lion_step(core.flat_param(i), buf.f[s.offset:s.stop],
                              core.flat_momentum(i), h.lr, h.decay, h.b1, h.a1, h.b2, h.a2)

    def update(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], out: F32, sums: dict[int, int]) -> None:
        """``u = sign(beta1 m + (1 - beta1) mean_g)``, the shared momentum advanced (the
        arithmetic of :func:`lioncub.kernels.lion_step`)."""
        for s in bucket.slots:
            h = hypers[s.index]
            u = out[s.offset:s.stop]
            kernels.direction(core.flat_momentum(s.index), buf.f[s.offset:s.stop], u, h.b1,
                              h.a1, h.b2, h.a2)
            np.sign(u, out=u)


class _LocalDirections(VariantStrategy):
    """The local-momentum variants' :meth:`prepare`: ``c`` of every slot into ``buf.f``."""

    def prepare(self, core: StepView, bucket: Bucket, buf: Buffers,
                grads: Sequence[F32 | None], hypers: Sequence[Hyper]) -> None:
        for s in bucket.slots:
            self.direction(core, s, buf.f[s.offset:s.stop], grads, hypers)


class MajorityVote(_LocalDirections):
    """1-bit majority of the signs of ``c`` (``c == 0`` votes +1), ties by the optimizer's
    tie rule; applies ``lr * majority``."""

    kind = "majority"
    breaks_ties = True
    result_dtype = np.int8

    def start(self, core: StepView, bucket: Bucket, buf: Buffers) -> WorkLike:
        n = bucket.size
        return core.comm.sign_allreduce(buf.f[:n], op="majority",
                                        tie=core.tie_for(bucket.index), out=buf.s[:n],
                                        async_op=True, algorithm=self.spec.algorithm)

    def finish(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        for s in bucket.slots:
            self.apply_signs(core, s, buf.s[s.offset:s.stop], hypers[s.index])

    def update(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], out: F32, sums: dict[int, int]) -> None:
        """``u = majority`` (+-1)."""
        n = bucket.size
        out[:n] = buf.s[:n]


class ExactSum(_LocalDirections):
    """Base of the variants whose collective returns exact integer vote sums (int16), or
    only their signs when neither the update nor the core's agreement needs the sums
    (:meth:`result_op`): applies ``lr * sign(sum)`` and records ``sum |sum|`` per tensor
    (meaningful when the sums came back)."""

    yields_sums = True
    #: Whether the update itself needs the sums (not only their signs).
    needs_sums = False

    def result_op(self, agreement: bool) -> str:
        """The collective's ``op``: "sum" when the sums are needed (by the update, or for the
        core's vote ``agreement``), else "sign" (only the sums' signs travel back)."""
        return "sum" if self.needs_sums or agreement else "sign"

    def finish(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        for s in bucket.slots:
            sums[s.index] = self.apply_signs(core, s, buf.s[s.offset:s.stop], hypers[s.index])

    def update(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], out: F32, sums: dict[int, int]) -> None:
        """``u = sign(sum)``."""
        for s in bucket.slots:
            sums[s.index] = kernels.sign_into(buf.s[s.offset:s.stop], out[s.offset:s.stop])


class SignSum(ExactSum):
    """Exact sum of the ternary signs of ``c`` (bitcoll's p-bit sum); applies its sign."""

    kind = "sign-sum"

    def start(self, core: StepView, bucket: Bucket, buf: Buffers) -> WorkLike:
        n = bucket.size
        return core.comm.sign_allreduce(buf.f[:n], op=self.result_op(core.agreement), out=buf.s[:n],
                                        async_op=True, algorithm=self.spec.algorithm)


class SignMean(SignSum):
    """The sum of :class:`SignSum` applied as ``lr * sum / p`` (in [-1, 1], not re-signed)."""

    kind = "mean"
    needs_sums = True

    def finish(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], sums: dict[int, int]) -> None:
        p = kernels.f32(core.world_size)
        for s in bucket.slots:
            h = hypers[s.index]
            sums[s.index] = kernels.apply_mean(core.flat_param(s.index),
                                               buf.s[s.offset:s.stop], h.lr, h.decay, p)

    def update(self, core: StepView, bucket: Bucket, buf: Buffers,
               hypers: Sequence[Hyper], out: F32, sums: dict[int, int]) -> None:
        """``u = sum / p`` (float32, correctly rounded, as :func:`kernels.apply_mean`)."""
        p = kernels.f32(core.world_size)
        for s in bucket.slots:
            total = buf.s[s.offset:s.stop]
            u = out[s.offset:s.stop]
            u[:] = total
            u /= p
            sums[s.index] = int(np.abs(total).sum(dtype=np.int64))


class QuantizedSum(ExactSum):
    """Votes ``quantize(c, method, levels)`` per tensor (:mod:`lioncub.quantize`), summed
    exactly by bitcoll's quantized all-reduce; applies the sign of the sum. ``spec.method``
    must be one of :data:`lioncub.quantize.METHODS` other than "sign"."""

    kind = "quantized"
    uses_levels = True

    def __init__(self, spec: SpecView) -> None:
        super().__init__(spec)
        if spec.method not in METHODS or spec.method == "sign":
            raise UsageError(f"variant {spec.name!r}: method must be one of "
                             f"{', '.join(m for m in METHODS if m != 'sign')}, got "
                             f"{spec.method!r}", argument="spec")
        self.method: str = spec.method

    def buffers(self, size: int) -> Buffers:
        return Buffers(np.zeros(size, np.float32), np.zeros(size, np.int8),
                       np.zeros(size, np.int16))

    def prepare(self, core: StepView, bucket: Bucket, buf: Buffers,
                grads: Sequence[F32 | None], hypers: Sequence[Hyper]) -> None:
        assert buf.q is not None
        for s in bucket.slots:
            f = buf.f[s.offset:s.stop]
            total, amax = self.direction(core, s, f, grads, hypers)
            q = buf.q[s.offset:s.stop]
            mult = multiplier(self.method, core.levels,
                              tensor_scale(self.method, f, total, amax))
            if mult is None:
                q.fill(0)
            else:
                kernels.quantize_scaled(f, mult, core.levels, q)

    def start(self, core: StepView, bucket: Bucket, buf: Buffers) -> WorkLike:
        n = bucket.size
        assert buf.q is not None
        return core.comm.quantized_allreduce(buf.q[:n], core.levels, out=buf.s[:n],
                                             op=self.result_op(core.agreement), async_op=True,
                                             algorithm=self.spec.algorithm)
