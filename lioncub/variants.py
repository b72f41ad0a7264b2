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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VARIANTS", "VariantSpec", "SPECS", "get_spec"]


@dataclass(frozen=True)
class VariantSpec:
    """How one variant communicates and updates.

    ``kind``: "global" (float all-reduce of gradients), "majority" (1-bit majority vote),
    "mean" (exact sum of ternary signs applied as ``sum / p``), "sign-sum" (exact sum of ternary
    signs, apply its sign) or "quantized" (exact sum of quantized votes, apply its sign).
    ``algorithm``: the bitcoll algorithm passed to the collective (None: bitcoll's default).
    ``method``: the quantizer of "quantized" variants.
    """

    name: str
    kind: str
    algorithm: str | None
    method: str | None
    summary: str

    @property
    def yields_sums(self) -> bool:
        """True when the collective returns exact vote sums (so agreement is measurable)."""
        return self.kind in ("mean", "sign-sum", "quantized")

    @property
    def uses_levels(self) -> bool:
        """True when ``levels`` matters (the quantized variants)."""
        return self.kind == "quantized"

    @property
    def local_momentum(self) -> bool:
        """True when every worker keeps its own momentum (all but "global")."""
        return self.kind != "global"


SPECS: dict[str, VariantSpec] = {
    s.name: s for s in (
        VariantSpec("global", "global", None, None,
                    "Global Lion: float32 average of gradients, one shared momentum"),
        VariantSpec("dlion-mavo", "majority", "allgather", None,
                    "Distributed Lion, majority vote over an all-gather of sign bits"),
        VariantSpec("dlion-avg", "mean", "allgather", None,
                    "Distributed Lion, mean of the signs (all-gather), not re-signed"),
        VariantSpec("lioncub-mavo", "majority", None, None,
                    "Lion Cub, 1-bit majority through the bandwidth-optimal all-reduce"),
        VariantSpec("lioncub-sign", "sign-sum", None, None,
                    "Lion Cub, exact p-bit sum of ternary signs, sign of the sum"),
        VariantSpec("lioncub-l1", "quantized", None, "l1",
                    "Lion Cub, L1-scaled votes summed exactly, sign of the sum"),
        VariantSpec("lioncub-l0", "quantized", None, "l0",
                    "Lion Cub, geometric-mean-scaled votes summed exactly, sign of the sum"),
        VariantSpec("lioncub-linf", "quantized", None, "linf",
                    "Lion Cub, max-scaled votes summed exactly, sign of the sum"),
    )
}

#: The variant names, in the order of the table above.
VARIANTS: tuple[str, ...] = tuple(SPECS)


def get_spec(name: object) -> VariantSpec:
    """The spec of variant ``name``; UsageError for an unknown name."""
    from bitcoll.errors import UsageError

    if not isinstance(name, str) or name not in SPECS:
        raise UsageError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
    return SPECS[name]
