"""Momentum synchronization schedules.

In the Distributed Lion and Lion Cub variants every worker keeps its own momentum, fed by its
own gradients, so the momenta drift apart. A schedule decides, after each optimizer step,
which tensors' momenta are replaced by their average over the workers (a float32
``comm.allreduce(op="avg")``, done by :class:`lioncub.DistributedLion`).

Every decision depends only on the step count, the parameter names and, for
:class:`Adaptive`, the vote agreement computed from the all-reduced sums; all of these are
identical on every rank, so every rank selects the same tensors and makes the same collective
calls.

Steps are counted from 1: the decision after the first optimizer step sees ``step == 1``.

Schedules (objects, or the string specs of :func:`parse_sync`):

============================  ==========================================================
``NoSync()``                  never (``"none"``, or ``None``)
``EveryK(k)``                 every tensor at steps ``k, 2k, 3k, ...`` (``"every:K"``)
``Exponential(k, start=1)``   every tensor at steps ``ceil(T_j)``, ``T_0 = start``,
                              ``T_{j+1} = T_j + 2**(j / k)``: the interval doubles every
                              ``k`` syncs, the 0/1-Adam shape (``"exp:K[:START]"``)
``EarlyPhase(steps, every)``  every tensor at steps ``<= steps`` that are multiples of
                              ``every`` (``"early:S[:EVERY]"``)
``Adaptive(threshold, ...)``  the tensors whose vote agreement this step is below
                              ``threshold`` (``"adaptive:THRESHOLD[:MIN_INTERVAL]"``)
``Selective(inner, include)`` ``inner``'s choice restricted to the tensors whose name
                              matches ``include`` (``"<inner spec>@GLOB[,GLOB...]"``)
============================  ==========================================================

Vote agreement (used by :class:`Adaptive`): for a tensor of ``n`` elements whose exact vote
sums are ``S_e`` over ``p`` workers voting integers in ``[-levels, levels]``,
``agreement = sum_e |S_e| / (n * p * levels)``, in [0, 1]. It is 1 when every worker casts the
extreme vote of the same sign everywhere and near 0 when the workers cancel out. Scale:
for ternary sign votes (``lioncub-sign``), workers that agree give 1; for L1-quantized votes
workers that agree give about ``mean|q| / levels``, roughly 0.5. Choose the threshold for the
quantizer in use (e.g. 0.6 for sign votes, 0.3 for L1).

:class:`Adaptive` rule: after step ``t > warmup``, synchronize tensor ``i`` when its agreement
at step ``t`` is ``< threshold`` and it was not synchronized in the last ``min_interval - 1``
steps. Low agreement means the local momenta (which dominate ``c`` with ``beta1 = 0.9``) point
in different directions; averaging them restores a common direction where it was lost, and
costs nothing where the workers still agree. It needs a variant whose collective returns
exact sums (``dlion-avg``, ``lioncub-sign``, ``lioncub-l1``/``l0``/``linf``).
"""

from __future__ import annotations

import fnmatch
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bitcoll.errors import UsageError

__all__ = ["MomentumSync", "NoSync", "EveryK", "Exponential", "EarlyPhase", "Adaptive",
           "Selective", "parse_sync"]

NameFilter = str | Sequence[str] | re.Pattern[str] | Callable[[str], bool]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}", argument=name)
    return value


class MomentumSync(ABC):
    """A momentum synchronization schedule.

    ``select(step, agreement, names)`` is called once after every optimizer step with the
    1-based step count, the per-tensor vote agreement of that step (``{tensor index:
    agreement}``, only tensors that produced sums; None when the variant yields no sums) and
    the names of all tensors. It returns the sorted indices of the tensors to synchronize.
    Schedules may keep state (:meth:`state_dict`), which the optimizer checkpoints.
    """

    #: True when the schedule needs the vote agreement (a variant with exact sums).
    needs_agreement: bool = False

    @abstractmethod
    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        """Indices of the tensors whose momenta are averaged after ``step``."""

    @abstractmethod
    def spec(self) -> str:
        """The string spec that :func:`parse_sync` turns back into this schedule."""

    def state_dict(self) -> dict[str, Any]:
        """The schedule's mutable state (plus its spec, checked on load)."""
        return {"spec": self.spec()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; raise UsageError if it belongs to another schedule."""
        if state.get("spec") != self.spec():
            raise UsageError(f"momentum sync state is for {state.get('spec')!r}, this "
                             f"optimizer uses {self.spec()!r}", argument="state")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec()!r}>"


class NoSync(MomentumSync):
    """Never synchronize."""

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        return []

    def spec(self) -> str:
        return "none"


class EveryK(MomentumSync):
    """Synchronize every tensor after steps ``k, 2k, 3k, ...``."""

    def __init__(self, k: int) -> None:
        self.k = _positive_int("k", k)

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        return list(range(len(names))) if step % self.k == 0 else []

    def spec(self) -> str:
        return f"every:{self.k}"


class Exponential(MomentumSync):
    """Synchronize every tensor at exponentially growing intervals.

    Sync times ``T_0 = start``, ``T_{j+1} = T_j + 2**(j / k)``; the sync happens after the
    first step ``t >= T_j``. With ``k = 1`` the intervals are 1, 2, 4, 8, ...
    """

    def __init__(self, k: int, start: int = 1) -> None:
        self.k = _positive_int("k", k)
        self.start = _positive_int("start", start)
        self.j = 0
        self.next_time = float(self.start)

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        if step < self.next_time:
            return []
        while self.next_time <= step:  # more than one T_j passed only after a restore
            self.next_time += 2.0 ** (self.j / self.k)
            self.j += 1
        return list(range(len(names)))

    def spec(self) -> str:
        return f"exp:{self.k}:{self.start}"

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec(), "j": self.j, "next_time": self.next_time}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.j = int(state["j"])
        self.next_time = float(state["next_time"])


class EarlyPhase(MomentumSync):
    """Synchronize every tensor after steps ``every, 2 every, ...`` up to ``steps``."""

    def __init__(self, steps: int, every: int = 1) -> None:
        self.steps = _positive_int("steps", steps, minimum=0)
        self.every = _positive_int("every", every)

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        if step <= self.steps and step % self.every == 0:
            return list(range(len(names)))
        return []

    def spec(self) -> str:
        return f"early:{self.steps}:{self.every}"


class Adaptive(MomentumSync):
    """Synchronize the tensors whose vote agreement falls below ``threshold`` (rule in the
    module docstring). ``min_interval``: at least this many steps between two syncs of one
    tensor; ``warmup``: no sync at steps ``<= warmup``."""

    needs_agreement = True

    def __init__(self, threshold: float, min_interval: int = 1, warmup: int = 0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not 0.0 <= float(threshold) <= 1.0:
            raise UsageError(f"threshold must be a number in [0, 1], got {threshold!r}",
                             argument="threshold")
        self.threshold = float(threshold)
        self.min_interval = _positive_int("min_interval", min_interval)
        self.warmup = _positive_int("warmup", warmup, minimum=0)
        self.last: dict[int, int] = {}

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        if agreement is None:
            raise UsageError("adaptive momentum sync needs a variant with exact vote sums",
                             argument="momentum_sync")
        if step <= self.warmup:
            return []
        chosen = [i for i in sorted(agreement)
                  if agreement[i] < self.threshold
                  and step - self.last.get(i, -self.min_interval) >= self.min_interval]
        for i in chosen:
            self.last[i] = step
        return chosen

    def spec(self) -> str:
        return f"adaptive:{self.threshold!r}:{self.min_interval}:{self.warmup}"

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec(), "last": dict(self.last)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.last = {int(k): int(v) for k, v in state["last"].items()}


def _name_predicate(include: NameFilter) -> tuple[Callable[[str], bool], str]:
    if isinstance(include, re.Pattern):
        pattern = include
        return (lambda name: pattern.search(name) is not None), f"re:{pattern.pattern}"
    if isinstance(include, str):
        include = [include]
    if callable(include):
        func = include
        return (lambda name: bool(func(name))), f"func:{getattr(func, '__qualname__', func)}"
    globs = list(include)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise UsageError(f"include must be glob pattern(s), a regex or a predicate, "
                         f"got {include!r}", argument="include")
    return (lambda name: any(fnmatch.fnmatchcase(name, g) for g in globs)), ",".join(globs)


class Selective(MomentumSync):
    """Restrict ``inner`` to the tensors whose name matches ``include``: a glob pattern or
    list of them (``fnmatch``, case-sensitive: ``"*.bias"``, ``"layers.0.*"``), a compiled
    regular expression (``re.search``) or a predicate ``name -> bool``."""

    def __init__(self, inner: MomentumSync | str, include: NameFilter) -> None:
        self.inner = parse_sync(inner)
        self.match, self._desc = _name_predicate(include)
        self.needs_agreement = self.inner.needs_agreement
        self._mask: tuple[tuple[str, ...], list[bool]] | None = None

    def select(self, step: int, agreement: Mapping[int, float] | None,
               names: Sequence[str]) -> list[int]:
        key = tuple(names)
        if self._mask is None or self._mask[0] != key:
            self._mask = (key, [self.match(n) for n in key])
        mask = self._mask[1]
        if agreement is not None:
            agreement = {i: a for i, a in agreement.items() if mask[i]}
        return [i for i in self.inner.select(step, agreement, names) if mask[i]]

    def spec(self) -> str:
        return f"{self.inner.spec()}@{self._desc}"

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict(state["inner"])


def _ints(spec: str, parts: list[str], lo: int, hi: int) -> list[int]:
    if not lo <= len(parts) <= hi:
        raise UsageError(f"bad momentum sync spec {spec!r}", argument="momentum_sync")
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise UsageError(f"bad momentum sync spec {spec!r}: expected integers",
                         argument="momentum_sync") from None


def parse_sync(spec: MomentumSync | str | None) -> MomentumSync:
    """Turn a schedule object, None or a string spec into a :class:`MomentumSync`.

    String specs: ``"none"``, ``"every:K"``, ``"exp:K[:START]"``, ``"early:S[:EVERY]"``,
    ``"adaptive:THRESHOLD[:MIN_INTERVAL[:WARMUP]]"``, and any of them followed by
    ``"@GLOB[,GLOB...]"`` to restrict it to the tensors whose names match (:class:`Selective`).
    Raises UsageError for anything else.
    """
    if spec is None:
        return NoSync()
    if isinstance(spec, MomentumSync):
        return spec
    if not isinstance(spec, str):
        raise UsageError(f"momentum_sync must be a MomentumSync, a string spec or None, got "
                         f"{type(spec).__name__}", argument="momentum_sync")
    text = spec.strip()
    if "@" in text:
        inner, _, globs = text.partition("@")
        return Selective(parse_sync(inner), [g.strip() for g in globs.split(",")])
    kind, *rest = text.split(":")
    kind = kind.strip().lower()
    if kind == "none" and not rest:
        return NoSync()
    if kind == "every":
        (k,) = _ints(spec, rest, 1, 1)
        return EveryK(k)
    if kind == "exp":
        return Exponential(*_ints(spec, rest, 1, 2))
    if kind == "early":
        return EarlyPhase(*_ints(spec, rest, 1, 2))
    if kind == "adaptive" and 1 <= len(rest) <= 3:
        try:
            threshold = float(rest[0])
        except ValueError:
            raise UsageError(f"bad momentum sync spec {spec!r}: threshold",
                             argument="momentum_sync") from None
        if not math.isfinite(threshold):
            raise UsageError(f"bad momentum sync spec {spec!r}: threshold",
                             argument="momentum_sync")
        return Adaptive(threshold, *_ints(spec, rest[1:], 0, 2))
    raise UsageError(f"unknown momentum sync spec {spec!r}; expected none, every:K, "
                     "exp:K[:START], early:S[:EVERY], adaptive:T[:MIN_INTERVAL[:WARMUP]], "
                     "optionally followed by @GLOB[,GLOB...]", argument="momentum_sync")
