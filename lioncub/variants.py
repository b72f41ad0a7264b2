"""The distributed Lion variants: what each worker sends, how it is aggregated, what is applied.

``p`` workers, worker ``i`` with its own gradient ``g_i``; ``c_i = beta1 m_i + (1 - beta1) g_i``
is Lion's interpolation with worker ``i``'s own momentum ``m_i`` (every variant except
``"global"`` keeps one momentum per worker, fed by that worker's gradient only).

================  =========================================  ==================================
name              collective (bitcoll)                       update applied on every worker
================  =========================================  ==================================
``global``        ``allreduce(g_i, op="avg")``, float32      Lion on the mean gradient with one
                                                             shared momentum (the baseline)
``dlion-mavo``    ``sign_allreduce(c_i, op="majority",       ``lr * majority`` (+-1)
                  algorithm="allgather")``
``dlion-avg``     ``sign_allreduce(c_i, op="sum",            ``lr * sum / p``, in [-1, 1], not
                  algorithm="allgather")``                   re-signed
``lioncub-mavo``  ``sign_allreduce(c_i, op="majority")``     ``lr * majority`` (+-1)
                  (bandwidth-optimal 1-bit all-reduce)
``lioncub-sign``  ``sign_allreduce(c_i, op="sum")``          ``lr * sign(sum)``
                  (exact p-bit sum of ternary signs)
``lioncub-l1``    ``quantized_allreduce(quantize(c_i, "l1",  ``lr * sign(sum)``
                  levels), levels)``
``lioncub-l0``    same with the "l0" quantizer               ``lr * sign(sum)``
``lioncub-linf``  same with the "linf" quantizer             ``lr * sign(sum)``
================  =========================================  ==================================

``dlion-*`` are Distributed Lion (arXiv 2404.00438) as published: every worker gathers every
worker's sign bits. ``lioncub-*`` are Lion Cub (arXiv 2411.16462): votes aggregated inside a
bandwidth-optimal all-reduce, optionally weighted by magnitude (quantizers in
:mod:`lioncub.quantize`). In the 1-bit majority paths ``c_i == 0`` votes +1 (a bit cannot carry
0); ties (even ``p``) follow the optimizer's tie rule.

The registry
------------
:data:`SPECS` maps every variant name to its :class:`VariantSpec`, which names the strategy
class that implements it (:mod:`lioncub.strategies`: one class per aggregation rule, one
strategy object per optimizer) with the bitcoll algorithm and quantizer it uses. A new variant
is one strategy class and one :func:`register` line, run on every rank before the optimizer is
constructed::

    register(VariantSpec("my-variant", MyStrategy, summary="what it does"))

:data:`VARIANTS` lists the built-in variants (the table above); :data:`SPECS` also holds the
registered ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from bitcoll.errors import UsageError

from .strategies import (
    GlobalAverage,
    MajorityVote,
    QuantizedSum,
    SignMean,
    SignSum,
    VariantStrategy,
)

__all__ = ["VARIANTS", "VariantSpec", "SPECS", "get_spec", "register", "unregister"]


@dataclass(frozen=True)
class VariantSpec:
    """One variant: its public ``name``, the :class:`lioncub.strategies.VariantStrategy`
    subclass ``strategy`` that implements it, the bitcoll ``algorithm`` passed to its
    collective (None: bitcoll's default), the quantizer ``method`` of the quantized variants
    (None otherwise) and a one-line ``summary``.

    ``kind`` (the strategy's aggregation rule: "global" (float all-reduce of gradients),
    "majority" (1-bit majority vote), "mean" (exact sum of ternary signs applied as
    ``sum / p``), "sign-sum" (exact sum of ternary signs, apply its sign) or "quantized"
    (exact sum of quantized votes, apply its sign), or a registered strategy's own),
    ``yields_sums``, ``uses_levels`` and ``local_momentum`` are the strategy's.
    """

    name: str
    strategy: type[VariantStrategy]
    algorithm: str | None = None
    method: str | None = None
    summary: str = ""

    @property
    def kind(self) -> str:
        """The strategy's aggregation rule (:attr:`VariantStrategy.kind`)."""
        return self.strategy.kind

    @property
    def yields_sums(self) -> bool:
        """True when the collective returns exact vote sums (so agreement is measurable)."""
        return self.strategy.yields_sums

    @property
    def uses_levels(self) -> bool:
        """True when ``levels`` matters (the quantized variants)."""
        return self.strategy.uses_levels

    @property
    def local_momentum(self) -> bool:
        """True when every worker keeps its own momentum (all built-ins but "global")."""
        return self.strategy.local_momentum

    def make_strategy(self) -> VariantStrategy:
        """A new strategy object for one optimizer."""
        return self.strategy(self)


#: The registry: variant name -> spec, the built-ins in the order of the table above.
SPECS: dict[str, VariantSpec] = {}


def register(spec: VariantSpec) -> VariantSpec:
    """Add variant ``spec`` to :data:`SPECS` and return it, so that ``variant=spec.name``
    selects it. Every rank must register the same variants (the optimizer's construction
    checks that the ranks agree on the name). UsageError for a name already registered, a
    ``strategy`` that is not a :class:`VariantStrategy` subclass with a ``kind``, or a spec
    the strategy rejects."""
    if not isinstance(spec, VariantSpec):
        raise UsageError(f"register() takes a VariantSpec, got {type(spec).__name__}",
                         argument="spec")
    if not isinstance(spec.name, str) or not spec.name:
        raise UsageError(f"a variant name must be a non-empty string, got {spec.name!r}",
                         argument="spec")
    if spec.name in SPECS:
        raise UsageError(f"variant {spec.name!r} is already registered", argument="spec")
    if not (isinstance(spec.strategy, type) and issubclass(spec.strategy, VariantStrategy)
            and isinstance(getattr(spec.strategy, "kind", None), str)):
        raise UsageError(f"variant {spec.name!r}: strategy must be a VariantStrategy subclass "
                         f"with a kind, got {spec.strategy!r}", argument="spec")
    spec.make_strategy()  # the strategy's own checks of the spec
    SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a variant added by :func:`register`; UsageError for a built-in or unknown
    name."""
    if name in VARIANTS:
        raise UsageError(f"variant {name!r} is built in and cannot be unregistered",
                         argument="name")
    if name not in SPECS:
        raise UsageError(f"variant {name!r} is not registered", argument="name")
    del SPECS[name]


for _spec in (
    VariantSpec("global", GlobalAverage, None, None,
                "Global Lion: float32 average of gradients, one shared momentum"),
    VariantSpec("dlion-mavo", MajorityVote, "allgather", None,
                "Distributed Lion, majority vote over an all-gather of sign bits"),
    VariantSpec("dlion-avg", SignMean, "allgather", None,
                "Distributed Lion, mean of the signs (all-gather), not re-signed"),
    VariantSpec("lioncub-mavo", MajorityVote, None, None,
                "Lion Cub, 1-bit majority through the bandwidth-optimal all-reduce"),
    VariantSpec("lioncub-sign", SignSum, None, None,
                "Lion Cub, exact p-bit sum of ternary signs, sign of the sum"),
    VariantSpec("lioncub-l1", QuantizedSum, None, "l1",
                "Lion Cub, L1-scaled votes summed exactly, sign of the sum"),
    VariantSpec("lioncub-l0", QuantizedSum, None, "l0",
                "Lion Cub, geometric-mean-scaled votes summed exactly, sign of the sum"),
    VariantSpec("lioncub-linf", QuantizedSum, None, "linf",
                "Lion Cub, max-scaled votes summed exactly, sign of the sum"),
):
    register(_spec)
del _spec

#: The built-in variant names, in the order of the table above.
VARIANTS: tuple[str, ...] = tuple(SPECS)


def get_spec(name: object) -> VariantSpec:
    """The spec of variant ``name`` (built in or registered); UsageError for an unknown
    name."""
    if not isinstance(name, str) or name not in SPECS:
        raise UsageError(f"unknown variant {name!r}; expected one of {', '.join(SPECS)}",
                         argument="variant")
    return SPECS[name]
