"""The Lion update rule (Chen et al. 2023, arXiv 2302.06675) on numpy arrays.

Per tensor, with gradient ``g``, momentum ``m`` (starts at 0), learning rate ``lr``,
decoupled weight decay ``wd`` and ``beta1, beta2``::

    theta <- theta * (1 - lr * wd)
    c      = beta1 * m + (1 - beta1) * g
    theta <- theta - lr * sign(c)          (sign(0) = 0)
    m     <- beta2 * m + (1 - beta2) * g

All arithmetic is float32: the scalars ``lr``, ``1 - lr * wd``, ``beta1``, ``1 - beta1``,
``beta2``, ``1 - beta2`` are computed in float64 and rounded to float32 once (:class:`Hyper`),
and every product and sum is rounded to float32, exactly as the numpy expressions above
evaluate with float32 arrays. The distributed optimizer uses the same scalars and kernels, so a
distributed run whose votes reproduce ``sign(c)`` reproduces this function bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from bitcoll.errors import UsageError

from . import kernels

__all__ = ["Hyper", "lion_update", "check_hyper"]


@dataclass(frozen=True)
class Hyper:
    """Lion's hyperparameters as the float32 scalars the kernels take.

    ``lr``; ``decay = 1 - lr * weight_decay``; ``b1, a1 = beta1, 1 - beta1``;
    ``b2, a2 = beta2, 1 - beta2``.
    """

    lr: np.float32
    decay: np.float32
    b1: np.float32
    a1: np.float32
    b2: np.float32
    a2: np.float32

    @classmethod
    def of(cls, lr: float, beta1: float, beta2: float, weight_decay: float) -> Hyper:
        """Validate (:func:`check_hyper`) and round to float32."""
        lr, beta1, beta2, weight_decay = check_hyper(lr, beta1, beta2, weight_decay)
        f = kernels.f32
        return cls(lr=f(lr), decay=f(1.0 - lr * weight_decay), b1=f(beta1), a1=f(1.0 - beta1),
                   b2=f(beta2), a2=f(1.0 - beta2))


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise UsageError(f"{name} must be a real number, got {value!r}", argument=name)
    out = float(value)
    if not math.isfinite(out):
        raise UsageError(f"{name} must be finite, got {value!r}", argument=name)
    return out


def check_hyper(lr: object, beta1: object, beta2: object,
                weight_decay: object) -> tuple[float, float, float, float]:
    """Return the hyperparameters as floats; raise UsageError unless ``lr >= 0``,
    ``0 <= beta1, beta2 <= 1`` and ``weight_decay >= 0`` (all finite)."""
    lr_f = _number("lr", lr)
    b1 = _number("beta1", beta1)
    b2 = _number("beta2", beta2)
    wd = _number("weight_decay", weight_decay)
    if lr_f < 0:
        raise UsageError(f"lr must be >= 0, got {lr_f}", argument="lr")
    for name, b in (("beta1", b1), ("beta2", b2)):
        if not 0.0 <= b <= 1.0:
            raise UsageError(f"{name} must be in [0, 1], got {b}", argument=name)
    if wd < 0:
        raise UsageError(f"weight_decay must be >= 0, got {wd}", argument="weight_decay")
    return lr_f, b1, b2, wd


def _array(name: str, x: object, shape: tuple[int, ...] | None, writable: bool
           ) -> npt.NDArray[np.float32]:
    if not isinstance(x, np.ndarray):
        raise UsageError(f"{name} must be a numpy array, got {type(x).__name__}", argument=name)
    if x.dtype != np.float32:
        raise UsageError(f"{name} must be float32, got {x.dtype}", argument=name)
    if shape is not None and x.shape != shape:
        raise UsageError(f"{name} has shape {x.shape}, expected {shape}", argument=name)
    if writable:
        if not x.flags.c_contiguous:
            raise UsageError(f"{name} must be C-contiguous (it is updated in place)", argument=name)
        if not x.flags.writeable:
            raise UsageError(f"{name} is read-only", argument=name)
    return x


def lion_update(param: npt.NDArray[np.float32], grad: npt.NDArray[Any] | None,
                momentum: npt.NDArray[np.float32], lr: float, beta1: float = 0.9,
                beta2: float = 0.99, weight_decay: float = 0.0) -> None:
    """One Lion step on one tensor, in place (formula in the module docstring).

    ``param`` and ``momentum``: float32, same shape, C-contiguous, writable; both are
    updated. ``grad``: float32 of the same shape (any memory layout), or None for a zero
    gradient. Raises UsageError for wrong types, dtypes, shapes or hyperparameters.

    >>> p = np.zeros(3, np.float32); m = np.zeros(3, np.float32)
    >>> lion_update(p, np.array([1, -2, 0], np.float32), m, lr=0.1)
    >>> p
    array([-0.1,  0.1,  0. ], dtype=float32)
    """
    hyper = Hyper.of(lr, beta1, beta2, weight_decay)
    param = _array("param", param, None, writable=True)
    momentum = _array("momentum", momentum, param.shape, writable=True)
    if np.shares_memory(param, momentum):
        raise UsageError("param and momentum must not share memory", argument="momentum")
    g = None
    if grad is not None:
        g = np.ascontiguousarray(_array("grad", grad, param.shape, writable=False)).reshape(-1)
    kernels.lion_step(param.reshape(-1), g, momentum.reshape(-1), hyper.lr, hyper.decay,
                      hyper.b1, hyper.a1, hyper.b2, hyper.a2)
