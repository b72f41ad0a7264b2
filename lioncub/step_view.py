"""What a variant's strategy sees of the optimizer: narrow, typed views of the step.

The strategies (:mod:`lioncub.strategies`, :mod:`lioncub.torch_strategies`) are called by an
optimizer core (:class:`lioncub.DistributedLion`, :class:`lioncub.torch_engine.TorchEngine`,
or a front end such as :mod:`lioncub.torch_hooks` that drives the core's strategy itself) and
read or change part of its state: the communicator, one parameter's flat view and momentum,
the tie rule of a bucket. The protocols below name exactly that part, so that a strategy
depends on this leaf module instead of on the core (no import circle, no access to the core's
private fields), and a test can hand a strategy a small stand-in.

* :class:`SpecView`: the variant a strategy implements (``name``, ``algorithm``,
  ``method``): :class:`lioncub.variants.VariantSpec` satisfies it.
* :class:`StepView`: the numpy strategies' view of the core;
  :class:`lioncub.DistributedLion` satisfies it.
* :class:`TorchStepView`: the torch strategies' view of the engine (the numpy view's facts
  plus the engine's device helpers); :class:`lioncub.torch_engine.TorchEngine` satisfies it.

Protocols are checked statically (mypy, at the call sites of the cores); nothing is checked at
run time. This module imports neither torch nor any other lioncub module at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from bitcoll.errors import UsageError

    from .buckets import Bucket, Slot
    from .comm import CommLike
    from .lion import Hyper

__all__ = ["SpecView", "StepView", "TorchStepView"]

F32 = npt.NDArray[np.float32]

if TYPE_CHECKING:
    #: ``each(start, tile, lo, hi)`` of :meth:`TorchStepView.direction`: the tile of ``c``
    #: just written (elements ``[start, start + tile.numel())`` of the slot) and its extrema
    #: (0-d tensors, or None when none are recorded).
    TileHook = Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None]


class SpecView(Protocol):
    """The variant a strategy object implements (:class:`lioncub.variants.VariantSpec`)."""

    @property
    def name(self) -> str:
        """The variant's public name (error messages)."""
        ...

    @property
    def algorithm(self) -> str | None:
        """The bitcoll algorithm of the variant's collective (None: bitcoll's default)."""
        ...

    @property
    def method(self) -> str | None:
        """The quantizer of the quantized variants (:data:`lioncub.quantize.METHODS`), else
        None."""
        ...


class StepView(Protocol):
    """The optimizer core as a numpy strategy sees it during a step.

    Every member is read-only for the strategy except the arrays that
    :meth:`flat_param` and :meth:`flat_momentum` return, which it updates in place."""

    @property
    def comm(self) -> CommLike:
        """The communicator the bucket's collective runs on (``async_op=True``)."""
        ...

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        ...

    @property
    def levels(self) -> int:
        """The effective vote levels (1 unless the strategy :attr:`uses_levels`)."""
        ...

    @property
    def agreement(self) -> bool:
        """Whether the step computes the vote agreement (the exact-sum collectives then
        return the sums, not only their signs)."""
        ...

    def flat_param(self, index: int) -> F32:
        """Parameter ``index`` as a flat float32 view of its memory (updated in place)."""
        ...

    def flat_momentum(self, index: int) -> F32:
        """This rank's momentum of parameter ``index``, flat float32 (advanced in place)."""
        ...

    def tie_for(self, bucket: int) -> str:
        """The tie rule bitcoll's majority uses for bucket ``bucket`` at this step
        ("positive", "negative" or "alternate")."""
        ...

    def non_finite(self, index: int) -> UsageError:
        """The error to raise for a non-finite gradient (or momentum) of parameter
        ``index`` on this rank (names the parameter and the rank)."""
        ...


class TorchStepView(Protocol):
    """The torch engine as a torch strategy sees it during a step: the facts of
    :class:`StepView` and the engine's device helpers (one float32 rounding per operation,
    as the numpy kernels round)."""

    @property
    def comm(self) -> CommLike:
        """The communicator (a :class:`bitcoll.Communicator`: the packed collectives too)."""
        ...

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        ...

    @property
    def levels(self) -> int:
        """The effective vote levels."""
        ...

    @property
    def agreement(self) -> bool:
        """Whether the step computes the vote agreement (as :class:`StepView`)."""
        ...

    @property
    def packing(self) -> str:
        """Where the votes are packed: "device" or "host" (resolved at construction)."""
        ...

    @property
    def tile(self) -> int:
        """Elements per tile of the element-wise passes (0: whole tensors)."""
        ...

    def tie_for(self, bucket: int) -> str:
        """As :meth:`StepView.tie_for`."""
        ...

    def non_finite(self, index: int) -> UsageError:
        """As :meth:`StepView.non_finite`."""
        ...

    def first_bad(self, bucket: Bucket, c: torch.Tensor) -> UsageError:
        """The error naming the first parameter of ``bucket`` whose ``c`` (float32, bucket
        coordinates) is not finite."""
        ...

    def flat_tensor(self, index: int) -> torch.Tensor:
        """Parameter ``index`` as a flat view of its tensor (its own dtype and device)."""
        ...

    def direction(self, s: Slot, c: torch.Tensor, t: torch.Tensor, g: torch.Tensor | None,
                  h: Hyper, each: TileHook | None = None, keep: bool = True) -> None:
        """Lion's ``c = m*b1 + g*a1`` and momentum step ``m = m*b2 + g*a2`` of slot ``s``,
        tile by tile (``t``: float32 scratch of at least one tile); ``each`` is called on
        every tile while it is in the cache; ``keep=False``: ``c`` is not kept (every tile is
        computed into the first tile of ``c``)."""
        ...

    def apply_update(self, s: Slot, u: torch.Tensor, h: Hyper, start: int = 0) -> None:
        """``p = p*decay - lr*u`` for ``u`` in {-1, 0, 1} (any real dtype), ``u`` holding
        elements ``[start, start + u.numel())`` of slot ``s``'s parameter."""
        ...

    def tiles(self, size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of at most :attr:`tile` elements covering ``[0, size)``."""
        ...

    def scratch32(self, n: int) -> torch.Tensor:
        """The engine's float32 scratch, ``n`` elements (reused: valid until the next call)."""
        ...

    def scratch64(self, n: int) -> torch.Tensor:
        """The engine's float64 scratch, ``n`` elements (at most the largest bucket's)."""
        ...

    def sync_device(self) -> None:
        """Wait for the work queued on the parameters' device (CUDA: its current stream)."""
        ...
