"""``DistributedLion``: data-parallel Lion / Distributed Lion / Lion Cub on numpy parameters.

Each rank holds the same float32 parameters and calls :meth:`DistributedLion.step` with its own
gradients; the variant (:mod:`lioncub.variants`) decides what travels and how the update is
formed. Every rank applies the same update, so the parameters stay bitwise identical on every
rank after every step.

This module is the part every variant shares (layout, pipeline, overlap, statistics, momentum
sync, replicas, checkpoints); what differs between variants is the variant's strategy object
(:mod:`lioncub.strategies`), which the step calls per bucket to allocate the buffers, compute
this rank's contribution, start the collective and apply its result. The core never branches
on the variant.

Starting weights
----------------
The parameters must start identical on every rank. By default the constructor copies rank 0's
values into every rank's parameters (``broadcast_parameters=True``, the convention of torch's
DistributedDataParallel). With ``broadcast_parameters=False`` it checks instead: every rank
hashes each of its parameters, the checksums are all-gathered, and every rank raises the same
:class:`lioncub.replicas.ReplicaMismatchError` (a UsageError) naming the lowest rank whose
parameters differ from rank 0's and the first differing parameter (index, and name when
``names`` were given). :meth:`DistributedLion.check_replicas` runs that check at any time, e.g.
after training; :meth:`DistributedLion.broadcast_parameters` copies a rank's parameters to
every rank at any time (:mod:`lioncub.replicas`).

How a step runs
---------------
1. The parameters are packed, in order, into *buckets* of at most ``bucket_size`` bytes of
   float32 (:mod:`lioncub.buckets`); each bucket takes one collective per step.
2. For bucket ``k`` this rank computes its contribution into a flat buffer (the gradient
   copy for "global"; otherwise ``c = beta1 m + (1 - beta1) g`` with its own momentum, which
   it advances at the same time, then the integer votes for the quantized variants) and
   starts the collective with ``async_op=True`` (the strategy's ``prepare`` and ``start``).
3. While that collective is on the wire, bucket ``k + 1`` is computed (the kernels release
   the GIL); then the result of bucket ``k`` is awaited and applied to the parameters (the
   strategy's ``finish``).
   Two sets of flat buffers alternate, so at most two buckets are in flight.
4. After the last bucket the momentum schedule (:mod:`lioncub.sync`) picks the tensors whose
   momenta are averaged over the ranks (float32 ``allreduce(op="avg")``).

Overlap with the backward pass: :meth:`DistributedLion.ready` declares a parameter's final
gradient as soon as it exists; a bucket whose gradients are all declared is computed and its
collective started at once, buckets in descending order (the order backward produces them);
:meth:`DistributedLion.step` then starts the rest, waits and applies every update. The
results are bitwise those of a plain step.

Parameters without a gradient
-----------------------------
A gradient given as None counts as a **zero gradient** on that rank: the tensor keeps its
place in the bucket layout on every rank, this rank's vote comes from its momentum alone
(``c = beta1 m``; its momentum decays by ``beta2``), and the parameter receives the same
aggregated update as on every other rank (weight decay included). The layout therefore never
depends on which gradients exist, and ranks can never disagree about it. (In the 1-bit
majority variants a zero ``c`` votes +1, as bitcoll's 1-bit code cannot carry 0.)

One-step-stale updates, ``stale=True``
--------------------------------------
For slow or far links: :meth:`DistributedLion.step` applies the update of the step before
(whose exchange has had the whole forward and backward pass of this step to finish), then
starts this step's exchange and returns without waiting for it. The update of step ``t`` is
therefore applied at step ``t + 1``: gradients are computed on parameters one update behind,
the price of hiding the exchange entirely (measured in ``docs/cost-model.md``). Every rank
still applies the same updates in the same order, so the parameters stay bitwise identical.
:meth:`DistributedLion.flush` applies the update in flight (collective); call it before
evaluating or saving and at the end of training (:meth:`~DistributedLion.check_replicas` and
:meth:`~DistributedLion.broadcast_parameters` flush first; ``state_dict`` refuses while an
update is in flight). Every bucket in flight keeps its own buffers; ``ready()`` is refused.

Ties of the 1-bit majority (even world size), ``tie=``
------------------------------------------------------
``"alternate"`` (default): the optimizer alternates the rule between steps and buckets, bucket
``b`` at tie counter ``k`` (one count per step) resolves ties to +1 when ``k + b`` is even and
to -1 otherwise (the alternation of Lion Cub's reference code). The counter is part of
:meth:`state_dict`, so a restored run breaks ties exactly as the uninterrupted one.
``"positive"`` / ``"negative"``: always +1 / -1. ``"elementwise"``: bitcoll's own "alternate"
rule (element ``i`` on the communicator's ``j``-th majority call: +1 when ``i + j`` is even);
it alternates within a vector, but its counter lives in the communicator, so a run restored
into a new communicator does not reproduce the original's ties.

Errors
------
Bad arguments raise :class:`bitcoll.errors.UsageError` before anything is sent when they are
visible locally (wrong gradient count, shape or dtype, bad hyperparameters). A non-finite
gradient is found while computing a bucket and raises UsageError on that rank; buckets already
started complete, the step is left half done and the other ranks fail at their next
collective (PeerLostError once this rank closes its communicator, or at their deadline).
Communication errors are bitcoll's :class:`~bitcoll.errors.CommError` family.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from bitcoll.config import MAX_SUM_RANGE
from bitcoll.errors import UsageError

from .buckets import Bucket, Slot, fingerprint, make_buckets
from .comm import CommLike
from .lion import Hyper, check_hyper
from .quantize import check_levels, default_levels
from .replicas import ReplicaSet
from .stats import StepStats
from .strategies import Buffers, VariantStrategy
from .sync import MomentumSync, parse_sync
from .variants import VariantSpec, get_spec

__all__ = ["DistributedLion", "DEFAULT_BUCKET_BYTES", "TIE_RULES"]

F32 = npt.NDArray[np.float32]

#: Default bucket size: 25 MiB of float32 (6,553,600 elements).
DEFAULT_BUCKET_BYTES = 25 * 2**20
TIE_RULES = ("alternate", "positive", "negative", "elementwise")
_STATE_FORMAT = "lioncub.DistributedLion/1"
_MAX_SUM = MAX_SUM_RANGE  # bitcoll's exact sums travel in at most 16-bit fields


@dataclass
class _Early:
    """The state of a step whose buckets :meth:`DistributedLion.ready` started."""

    grads: list[Any]                   # the gradients declared so far (None: not yet)
    declared: set[int]                 # parameter indices declared
    missing: list[int]                 # per bucket: slots not declared yet
    next: int                          # the next bucket to start (descending order)
    hypers: list[Any]                  # hyperparameters read at the first ready()
    before: dict[str, int]             # comm stats at the first ready()
    inflight: dict[int, tuple[Any, Any, Any]]  # bucket index -> (bucket, buffers, work)
    seconds: float = 0.0               # wall time spent inside ready()


@dataclass
class _InFlight:
    """Stale mode: a step whose collectives :meth:`DistributedLion.step` started and the next
    step (or :meth:`DistributedLion.flush`) completes."""

    works: list[tuple[Any, Any, Any]]  # (bucket, buffers, work) in start order
    hypers: list[Any]                  # the step's hyperparameters
    before: dict[str, int]             # comm stats when it began
    start: float                       # when it began (perf_counter)


def _normalize_groups(params: object, lr: float, betas: object, weight_decay: float
                      ) -> list[dict[str, Any]]:
    """``params`` as torch-style groups ``{"params": [arrays], "lr", "betas",
    "weight_decay"}`` (a flat list of arrays is one group with the defaults)."""
    if isinstance(params, np.ndarray):
        raise UsageError("params must be a list of arrays (or of param-group dicts), "
                         "not a single array", argument="params")
    if not isinstance(params, Iterable):
        raise UsageError(f"params must be a list of numpy arrays, got {type(params).__name__}",
                         argument="params")
    items = list(params)
    if not items:
        raise UsageError("params is empty", argument="params")
    defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    if all(isinstance(x, Mapping) for x in items):
        groups = []
        for g in items:
            unknown = set(g) - {"params", "lr", "betas", "weight_decay"}
            if "params" not in g or unknown:
                raise UsageError(f"a param group needs 'params' and may set lr, betas, "
                                 f"weight_decay; got keys {sorted(g)}", argument="params")
            ps = g["params"]
            group = {**defaults, **{k: v for k, v in g.items() if k != "params"},
                     "params": [ps] if isinstance(ps, np.ndarray) else list(ps)}
            groups.append(group)
        return groups
    if any(isinstance(x, Mapping) for x in items):
        raise UsageError("params mixes arrays and param-group dicts", argument="params")
    return [{**defaults, "params": items}]


def _check_betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise UsageError(f"betas must be a pair (beta1, beta2), got {betas!r}", argument="betas")
    _, b1, b2, _ = check_hyper(0.0, betas[0], betas[1], 0.0)
    return b1, b2


class DistributedLion:
    """Data-parallel Lion over a bitcoll communicator, in place on float32 numpy arrays.

    Parameters
    ----------
    params
        float32 numpy arrays, C-contiguous and writable (updated in place), identical on
        every rank; or torch-style param groups ``[{"params": [...], "lr": ..., "betas":
        ..., "weight_decay": ...}, ...]`` (missing keys take the defaults below).
    comm
        a :class:`bitcoll.Communicator` (or any :class:`lioncub.comm.CommLike`).
    variant
        one of :data:`lioncub.VARIANTS` (table in :mod:`lioncub.variants`).
    lr, betas, weight_decay
        Lion's hyperparameters (defaults of every group).
    levels
        vote levels of the quantized variants (int in [1, 127], ``levels * world_size <=
        32767``); None: :func:`lioncub.quantize.default_levels` (``floor(127 / p)`` capped at
        31). Validated but unused by the other variants.
    tie
        tie rule of the 1-bit majority variants: "alternate", "positive", "negative",
        "elementwise" (see the module docstring).
    momentum_sync
        a :class:`lioncub.sync.MomentumSync`, a string spec (``"every:10"``, ``"exp:4"``,
        ``"adaptive:0.3"``, ``"every:10@*.bias"``, ...) or None (no synchronization). Ignored
        by "global", whose single momentum is already identical everywhere.
    bucket_size
        bytes of float32 per bucket (default 25 MiB); a larger tensor gets its own bucket.
    names
        one name per parameter (for selective sync, the stats and error messages); default
        ``"0"``, ``"1"``, ... in parameter order (errors then name parameters by index only).
    broadcast_parameters
        True (default): after the checks below, every rank's parameters are overwritten with
        rank 0's (:meth:`broadcast_parameters`). False: the ranks' parameters are compared
        (:meth:`check_replicas`) and, if any rank's differ from rank 0's, every rank raises
        :class:`lioncub.replicas.ReplicaMismatchError` (a UsageError). None: neither; the
        caller makes the replicas agree and checks them (as :class:`lioncub.elastic.ElasticLion`
        does when a joiner's parameters arrive after the optimizer's construction).
    agreement
        the exact-sum variants (``dlion-avg``, ``lioncub-sign``, ``lioncub-l1/l0/linf``):
        whether each step computes the vote agreement ``sum |sum| / (n p levels)`` per tensor
        (:attr:`last_stats`, the ``"adaptive"`` momentum sync). True: the collective returns
        the exact sums. False: it returns only their signs, which is all the update needs
        (the all-gather half of the collective moves 2 bits per element instead of
        ``ceil(log2(2 levels p + 1))``; ``dlion-avg``, which applies ``sum / p``, always
        moves sums). None (default): True exactly when the momentum sync needs it.
    replicas
        the arrays that the initial broadcast or check and :meth:`check_replicas` cover, as a
        :class:`lioncub.replicas.ReplicaSet`; default: the parameters, named by ``names``.
        The torch front end passes every tensor of its param groups, frozen ones included.

    Construction is collective: every rank must construct its optimizer at the same point.
    One small all-reduce checks that the ranks agree on the layout, the variant, the
    levels, the tie rule, the sync schedule, the replica arrays' shapes and
    ``broadcast_parameters`` (UsageError on every rank otherwise); then one broadcast per
    8 MiB of parameters, or one all-gather of 8 bytes per parameter, makes or checks the
    starting weights.

    Attributes: ``param_groups`` (dicts with ``params`` (the arrays), ``lr``, ``betas``,
    ``weight_decay``; changing the hyperparameters between steps is allowed), ``variant``,
    ``spec`` (its :class:`lioncub.variants.VariantSpec`), ``strategy`` (its
    :class:`lioncub.strategies.VariantStrategy` object), ``levels`` (effective vote levels:
    1 for ternary signs), ``agreement`` (resolved: whether steps compute it), ``buckets``,
    ``names``, ``momentum_sync``, ``replicas``, ``step_count``, ``last_stats``
    (:class:`lioncub.stats.StepStats` of the last step, None
    before the first).
    """

    def __init__(self, params: Iterable[Any], comm: CommLike, variant: str = "lioncub-l1",
                 lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, levels: int | None = None,
                 tie: str = "alternate",
                 momentum_sync: MomentumSync | str | None = None,
                 bucket_size: int = DEFAULT_BUCKET_BYTES,
                 names: Sequence[str] | None = None, *,
                 broadcast_parameters: bool | None = True,
                 replicas: ReplicaSet | None = None, stale: bool = False,
                 agreement: bool | None = None) -> None:
        self.spec = get_spec(variant)
        self.variant = self.spec.name
        self.strategy = self._make_strategy(self.spec)
        self.comm: CommLike = comm
        self.world_size = int(comm.size)
        self.rank = int(comm.rank)
        check_hyper(lr, *_check_betas(betas), weight_decay)
        self.param_groups = _normalize_groups(params, lr, betas, weight_decay)
        self.params: list[F32] = []
        self._group_of: list[int] = []
        seen: set[int] = set()
        for gi, group in enumerate(self.param_groups):
            check_hyper(group["lr"], *_check_betas(group["betas"]), group["weight_decay"])
            for p in group["params"]:
                self._check_param(p, len(self.params), seen)
                self.params.append(p)
                self._group_of.append(gi)
        n = len(self.params)
        self._sizes: list[int] = [self._size_of(p) for p in self.params]
        for (_, end, i), (start, _, j) in itertools.pairwise(sorted(self._spans())):
            if start < end:
                raise UsageError(f"parameters {min(i, j)} and {max(i, j)} share memory",
                                 argument="params", index=max(i, j))
        if names is None:
            self.names: tuple[str, ...] = tuple(str(i) for i in range(n))
        else:
            names = list(names)
            if len(names) != n or not all(isinstance(x, str) for x in names):
                raise UsageError(f"names must be {n} strings (one per parameter)", argument="names")
            if len(set(names)) != n:
                raise UsageError("names must be unique", argument="names")
            self.names = tuple(names)
        if broadcast_parameters is not None and not isinstance(broadcast_parameters, bool):
            raise UsageError(f"broadcast_parameters must be True, False or None, got "
                             f"{broadcast_parameters!r}", argument="broadcast_parameters")
        if replicas is None:
            replicas = ReplicaSet(self.params, None if names is None else self.names,
                                  unnamed="pass names= to name parameters")
        elif not isinstance(replicas, ReplicaSet):
            raise UsageError(f"replicas must be a lioncub.replicas.ReplicaSet, got "
                             f"{type(replicas).__name__}", argument="replicas")
        self.replicas = replicas

        if levels is not None:
            levels = check_levels(levels)
        if self.strategy.uses_levels:
            self.levels = default_levels(self.world_size) if levels is None else levels
        else:
            self.levels = 1
        if self.levels * self.world_size > _MAX_SUM:
            raise UsageError(f"levels * world size = {self.levels * self.world_size} exceeds "
                             f"{_MAX_SUM}; use at most {_MAX_SUM // self.world_size} levels",
                             argument="levels")
        if tie not in TIE_RULES:
            raise UsageError(f"unknown tie rule {tie!r}; expected one of {', '.join(TIE_RULES)}",
                             argument="tie")
        self.tie = tie
        self.momentum_sync = parse_sync(momentum_sync)
        if self.momentum_sync.needs_agreement and not self.strategy.yields_sums:
            raise UsageError(f"momentum sync {self.momentum_sync.spec()!r} needs vote "
                             f"agreement, which variant {self.variant!r} does not produce; "
                             "use dlion-avg, lioncub-sign or a quantized lioncub variant",
                             argument="momentum_sync")
        if agreement is not None and not isinstance(agreement, bool):
            raise UsageError(f"agreement must be True, False or None, got {agreement!r}",
                             argument="agreement")
        if agreement and not self.strategy.yields_sums:
            raise UsageError(f"variant {self.variant!r} has no vote agreement (its collective "
                             "returns no exact sums)", argument="agreement")
        if agreement is False and self.momentum_sync.needs_agreement:
            raise UsageError(f"momentum sync {self.momentum_sync.spec()!r} needs the vote "
                             "agreement; agreement=False turns it off", argument="agreement")
        self.agreement = self.strategy.yields_sums and (
            self.momentum_sync.needs_agreement if agreement is None else agreement)
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, np.integer)) \
                or bucket_size < 4:
            raise UsageError(f"bucket_size must be a number of bytes >= 4, got {bucket_size!r}",
                             argument="bucket_size")
        self.bucket_size = int(bucket_size)
        self.buckets: list[Bucket] = make_buckets(self._sizes, self.bucket_size // 4)
        self._place: list[tuple[int, Slot] | None] = [None] * n
        for b in self.buckets:
            for s in b.slots:
                self._place[s.index] = (b.index, s)
        self._allocate_state()
        self._buffers: list[Buffers] = []
        self._step = 0
        self._tie_counter = 0
        if not isinstance(stale, bool):
            raise UsageError(f"stale must be True or False, got {stale!r}", argument="stale")
        self.stale = stale
        self._in_flight: _InFlight | None = None  # stale mode: the exchange of the last step
        self._comm_seconds = 0.0
        self._device_to_host = 0  # bytes copied this step (engines on another device)
        self._host_to_device = 0
        self._early: _Early | None = None  # buckets started by ready() before step()
        self.last_stats: StepStats | None = None
        self._check_agreement_across_ranks(broadcast_parameters)
        if broadcast_parameters:
            self.broadcast_parameters()
        elif broadcast_parameters is not None:
            self.check_replicas()

    # ------------------------------------------------------------------ set-up helpers
    # (_make_strategy, _check_param, _size_of, _spans, _allocate_state, _check_grads,
    # _buffer, _prepare, _start, _finish, average_momenta, _momentum_copies, _check_momentum
    # and _load_momentum are what an engine on another kind of array overrides:
    # lioncub.torch_engine)
    def _make_strategy(self, spec: VariantSpec) -> VariantStrategy:
        """The variant's strategy object (:mod:`lioncub.strategies`), before anything is
        sent."""
        return spec.make_strategy()

    @staticmethod
    def _size_of(p: Any) -> int:
        """Elements of parameter ``p``."""
        return int(p.size)

    def _spans(self) -> list[tuple[int, int, int]]:
        """``(start address, end address, index)`` of every non-empty parameter."""
        return [(p.ctypes.data, p.ctypes.data + p.nbytes, i)
                for i, p in enumerate(self.params) if p.size]

    def _allocate_state(self) -> None:
        """The flat parameter views and the per-bucket momenta (zeros)."""
        self._flat: list[F32] = [p.reshape(-1) for p in self.params]
        self._bucket_mom: list[F32] = [np.zeros(b.size, dtype=np.float32)
                                       for b in self.buckets]
        self._mom: list[F32] = [np.zeros(0, dtype=np.float32)] * len(self.params)
        for b in self.buckets:
            for s in b.slots:
                self._mom[s.index] = self._bucket_mom[b.index][s.offset:s.stop]

    @staticmethod
    def _check_param(p: object, index: int, seen: set[int]) -> None:
        if not isinstance(p, np.ndarray):
            raise UsageError(f"parameter {index} must be a numpy array, got {type(p).__name__}",
                             argument="params", index=index)
        if p.dtype != np.float32:
            raise UsageError(f"parameter {index} must be float32, got {p.dtype}",
                             argument="params", index=index)
        if not p.flags.c_contiguous or not p.flags.writeable:
            raise UsageError(f"parameter {index} must be C-contiguous and writable "
                             "(it is updated in place)", argument="params", index=index)
        if id(p) in seen:
            raise UsageError(f"parameter {index} appears twice", argument="params", index=index)
        seen.add(id(p))

    def _check_agreement_across_ranks(self, broadcast: bool | None) -> None:
        """One tiny all-reduce: every rank must have the same layout and settings."""
        fp = fingerprint([tuple(p.shape) for p in self.params], self.buckets, self.variant,
                         self.levels, self.tie, self.momentum_sync.spec(), self.world_size,
                         self.replicas.layout(), broadcast, self.agreement)
        probe = np.array([fp, -fp], dtype=np.float64)
        self.comm.allreduce(probe, op="max", out=probe)
        if probe[0] != fp or -probe[1] != fp:
            raise UsageError("the ranks constructed DistributedLion differently (parameter "
                             "shapes or order, bucket size, variant, levels, tie rule, "
                             "momentum sync schedule, replica arrays or "
                             "broadcast_parameters differ)")

    def _buffer(self, k: int) -> Buffers:
        """Pipeline stage ``k``'s buffers (the strategy's, sized for the largest bucket)."""
        while len(self._buffers) <= k:
            size = max((b.size for b in self.buckets), default=0)
            self._buffers.append(self.strategy.buffers(size))
        return self._buffers[k]

    # ------------------------------------------------------------------ properties
    @property
    def step_count(self) -> int:
        """Number of completed steps."""
        return self._step

    @property
    def momenta(self) -> list[F32]:
        """This rank's momentum of every parameter, as views shaped like the parameters
        (writing them changes the optimizer's state)."""
        return [m.reshape(p.shape) for m, p in zip(self._mom, self.params, strict=True)]

    # ------------------------------------------------------------------ the step
    def _check_grads(self, grads: object) -> list[F32 | None]:
        if isinstance(grads, np.ndarray) or not isinstance(grads, Sequence):
            raise UsageError("grads must be a list with one array (or None) per parameter",
                             argument="grads")
        if len(grads) != len(self.params):
            raise UsageError(f"got {len(grads)} gradients for {len(self.params)} parameters",
                             argument="grads")
        return [self._check_grad(i, g) for i, g in enumerate(grads)]

    def _check_grad(self, i: int, g: object) -> F32 | None:
        """Parameter ``i``'s gradient, checked and flattened (None stays None)."""
        p = self.params[i]
        if g is None:
            return None
        if not isinstance(g, np.ndarray):
            raise self._bad_grad(i, f"must be a numpy array or None, got {type(g).__name__}")
        if g.dtype != np.float32:
            raise self._bad_grad(i, f"must be float32, got {g.dtype}")
        if g.shape != p.shape:
            raise self._bad_grad(i, f"has shape {g.shape}, the parameter has {p.shape}")
        return np.ascontiguousarray(g).reshape(-1)

    def _bad_grad(self, i: int, problem: str) -> UsageError:
        """The UsageError for parameter ``i``'s gradient: ``gradient i (name) <problem>``."""
        return UsageError(f"gradient {i} ({self.names[i]}) {problem}", argument="grads", index=i)

    def _hypers(self) -> list[Hyper]:
        per_group = []
        for group in self.param_groups:
            b1, b2 = _check_betas(group["betas"])
            per_group.append(Hyper.of(group["lr"], b1, b2, group["weight_decay"]))
        return [per_group[g] for g in self._group_of]

    # ------------------------------------------------------------------ the strategies' view
    # (lioncub.step_view.StepView: what a strategy, or a front end driving one, reads of the
    # core during a step)
    def tie_for(self, bucket: int) -> str:
        """The tie rule bitcoll's majority uses for bucket ``bucket`` at this step:
        "positive" / "negative" (``tie="alternate"``: alternating with the tie counter and
        the bucket index; or the fixed rule), "alternate" for ``tie="elementwise"``."""
        if self.tie == "alternate":
            return "positive" if (self._tie_counter + bucket) % 2 == 0 else "negative"
        if self.tie == "elementwise":
            return "alternate"
        return self.tie

    def non_finite(self, index: int) -> UsageError:
        """The UsageError for a non-finite gradient (or momentum) of parameter ``index`` on
        this rank (names the parameter and the rank)."""
        return UsageError(f"non-finite value in the gradient (or momentum) of parameter "
                          f"{index} ({self.names[index]}) on rank {self.rank}",
                          argument="grads", index=index)

    def flat_param(self, index: int) -> F32:
        """Parameter ``index`` as a flat float32 view of its memory."""
        return self._flat[index]

    def flat_momentum(self, index: int) -> F32:
        """This rank's momentum of parameter ``index``, a flat float32 view of its bucket's
        momentum buffer."""
        return self._mom[index]

    def slot_of(self, index: int) -> tuple[int, Slot] | None:
        """Where parameter ``index`` lies: ``(bucket index, its slot)``, None for an empty
        parameter (in no bucket)."""
        return self._place[index]

    def _prepare(self, bucket: Bucket, buf: Buffers, grads: list[F32 | None],
                 hypers: list[Hyper]) -> None:
        """Compute this rank's contribution of ``bucket`` into ``buf`` (the strategy's)."""
        self.strategy.prepare(self, bucket, buf, grads, hypers)

    def _start(self, bucket: Bucket, buf: Buffers) -> Any:
        """Start the bucket's collective (the strategy's, async); return its Work."""
        t0 = time.perf_counter()
        work = self.strategy.start(self, bucket, buf)
        self._comm_seconds += time.perf_counter() - t0
        return work

    def _finish(self, bucket: Bucket, buf: Buffers, work: Any, hypers: list[Hyper],
                sums: dict[int, int]) -> None:
        """Wait for the bucket's collective and apply the update to its parameters (the
        strategy's)."""
        t0 = time.perf_counter()
        work.wait()
        self._comm_seconds += time.perf_counter() - t0
        self.strategy.finish(self, bucket, buf, hypers, sums)

    # ------------------------------------------------------------------ overlap
    def ready(self, index: int, grad: Any) -> None:
        """Declare parameter ``index``'s final gradient of the coming step (None: a zero
        gradient), so that its bucket can start before :meth:`step` (overlap with the
        backward pass; collective once started).

        A bucket starts as soon as every parameter in it is declared **and** every bucket
        after it (higher index) has started: buckets start in descending order on every
        rank (the order in which backward produces gradients), whatever the timing, so the
        ranks' collectives always match. A bucket whose gradients are never declared starts
        at :meth:`step`, which then starts the rest (still descending), waits for all of
        them and applies the updates: parameters change only inside :meth:`step`. The
        gradient given here is the one used (``step``'s entry for that parameter is
        ignored); its memory must stay unchanged until the bucket starts. Hyperparameters
        are read at the first ``ready()`` of a step. The results are bitwise those of a
        plain :meth:`step` (every bucket's collective and update are independent of the
        order) except with ``tie="elementwise"``, whose tie counter follows the order of
        the calls: UsageError. Declaring a parameter twice before :meth:`step` is a
        UsageError. Memory: every bucket in flight holds its own buffers. No other
        collective may be called on the communicator between the first ``ready()`` and
        :meth:`step`: ranks start buckets at different points (a rank that lacks a gradient
        starts its buckets only at :meth:`step`), so such a call could meet a bucket's
        collective on another rank.
        """
        if self.stale:
            raise UsageError("ready() is for overlapping a step's exchange with its backward "
                             "pass; with stale=True the exchange already overlaps the next "
                             "step's forward and backward pass")
        if self.tie == "elementwise":
            raise UsageError("ready() starts buckets in another order than step(), which "
                             "changes tie='elementwise''s ties; use another tie rule")
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < len(self.params):
            raise UsageError(f"index must be a parameter index in [0, {len(self.params)}), "
                             f"got {index!r}", argument="index")
        index = int(index)
        t0 = time.perf_counter()
        early = self._early
        if early is None:
            early = self._early = _Early(
                grads=[None] * len(self.params), declared=set(),
                missing=[len(b.slots) for b in self.buckets], next=len(self.buckets) - 1,
                hypers=self._hypers(), before=self.comm.stats.snapshot(), inflight={})
            self._comm_seconds = 0.0
            self._device_to_host = self._host_to_device = 0
        if index in early.declared:
            raise UsageError(f"the gradient of parameter {index} ({self.names[index]}) was "
                             "declared twice before step(); with gradient accumulation, "
                             "declare only the last micro-step's gradients",
                             argument="index", index=index)
        early.grads[index] = self._check_grad(index, grad)
        early.declared.add(index)
        place = self._place[index]
        if place is not None:
            early.missing[place[0]] -= 1
            self._start_declared(early, force=False)
        early.seconds += time.perf_counter() - t0

    def _start_declared(self, early: _Early, force: bool) -> None:
        """Start buckets in descending order while they are complete (all, with force)."""
        while early.next >= 0 and (force or early.missing[early.next] == 0):
            bucket = self.buckets[early.next]
            buf = self._buffer(bucket.index)
            self._prepare(bucket, buf, early.grads, early.hypers)
            early.inflight[bucket.index] = (bucket, buf, self._start(bucket, buf))
            early.next -= 1

    @property
    def pending(self) -> bool:
        """True between a :meth:`ready` and the :meth:`step` that completes it."""
        return self._early is not None

    def step(self, grads: Sequence[npt.NDArray[np.float32] | None]) -> None:
        """One optimizer step from this rank's gradients (collective: every rank calls it).

        ``grads``: one entry per parameter, in parameter order: a float32 array of the
        parameter's shape (any memory layout; a non-contiguous one is copied) or None (a zero
        gradient, see the module docstring). Updates the parameters (identically on every
        rank) and this rank's momenta in place, then sets :attr:`last_stats`.
        """
        flat_grads = self._check_grads(grads)
        if self.stale:
            self._step_stale(flat_grads)
            return
        early, self._early = self._early, None
        sums: dict[int, int] = {}
        if early is not None:  # buckets started by ready(): the rest, then every update
            hypers = early.hypers
            before = early.before
            start = time.perf_counter() - early.seconds
            for i, g in enumerate(flat_grads):
                if i not in early.declared:
                    early.grads[i] = g
            self._start_declared(early, force=True)
            for b in sorted(early.inflight, reverse=True):
                self._finish(*early.inflight[b], hypers, sums)
        else:
            hypers, before, start = self.begin_step()
            pending: tuple[Bucket, Buffers, Any] | None = None
            for bucket in self.buckets:
                buf = self._buffer(bucket.index % 2)
                self._prepare(bucket, buf, flat_grads, hypers)
                work = self._start(bucket, buf)
                if pending is not None:
                    self._finish(*pending, hypers, sums)
                pending = (bucket, buf, work)
            if pending is not None:
                self._finish(*pending, hypers, sums)
        self.end_step(sums, before, start)

    def _step_stale(self, flat_grads: list[Any]) -> None:
        """Stale mode's step: apply the update of the step before (its collectives have had
        this step's forward and backward pass to finish), then start this step's collectives
        and return without waiting for them."""
        self.flush()
        hypers, before, start = self.begin_step()
        works = []
        for bucket in self.buckets:
            buf = self._buffer(bucket.index)  # every bucket in flight keeps its buffers
            self._prepare(bucket, buf, flat_grads, hypers)
            works.append((bucket, buf, self._start(bucket, buf)))
        self._in_flight = _InFlight(works, hypers, before, start)

    def flush(self) -> None:
        """Stale mode (``stale=True``): wait for the exchange of the last :meth:`step` and
        apply its update (collective when the momentum schedule selects tensors, as every
        step's end is). A no-op when nothing is in flight, and always without ``stale``.
        :meth:`step` calls it first; call it before reading the parameters for evaluation,
        before :meth:`state_dict`, :meth:`check_replicas` and at the end of training."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        sums: dict[int, int] = {}
        for bucket, buf, work in flight.works:
            self._finish(bucket, buf, work, flight.hypers, sums)
        self.end_step(sums, flight.before, flight.start)

    def _check_settled(self, what: str) -> None:
        if self._in_flight is not None:
            raise UsageError(f"{what}() while the last step's update is in flight "
                             "(stale=True): call flush() on every rank first")

    def begin_step(self) -> tuple[list[Hyper], dict[str, int], float]:
        """The start of a step: ``(hyperparameters per parameter, the communicator's traffic
        counters, the start time)``, the step's timers reset. :meth:`step` begins with it; a
        front end that runs the buckets itself (:mod:`lioncub.torch_hooks`: inside
        DistributedDataParallel's communication hooks, with its own bucket layout) calls it,
        runs the strategy's ``prepare`` / ``start`` / ``update`` per bucket, then
        :meth:`end_step`."""
        hypers = self._hypers()
        before = self.comm.stats.snapshot()
        self._comm_seconds = 0.0
        self._device_to_host = self._host_to_device = 0
        return hypers, before, time.perf_counter()

    def end_step(self, sums: Mapping[int, int], before: Mapping[str, int],
                 start: float, comm_seconds: float | None = None) -> None:
        """The end of a step, the same for every variant (collective when the momentum
        schedule selects tensors): count the step, advance the tie counter, average the
        momenta the schedule selects and set :attr:`last_stats`. ``sums``: the exact vote
        sums ``sum |total|`` per parameter index (variants that yield sums); ``before`` and
        ``start``: from :meth:`begin_step`; ``comm_seconds``: the seconds the step waited
        for its collectives, when a front end ran them (None: the core's own count)."""
        if comm_seconds is not None:
            self._comm_seconds = comm_seconds
        self._step += 1
        if self.strategy.breaks_ties:
            self._tie_counter += 1

        agreement: dict[int, float] | None = None
        if self.agreement:
            denom = self.world_size * self.levels
            agreement = {i: total / (self._sizes[i] * denom) for i, total in sums.items()}
        synced = self._sync_momenta(agreement)
        elapsed = time.perf_counter() - start
        after = self.comm.stats.snapshot()
        self.last_stats = StepStats(
            step=self._step,
            compute_seconds=max(0.0, elapsed - self._comm_seconds),
            comm_seconds=self._comm_seconds,
            bytes_sent=after["bytes_sent"] - before["bytes_sent"],
            bytes_received=after["bytes_received"] - before["bytes_received"],
            messages_sent=after["messages_sent"] - before["messages_sent"],
            messages_received=after["messages_received"] - before["messages_received"],
            synced=tuple(self.names[i] for i in synced),
            agreement=None if agreement is None
            else {self.names[i]: a for i, a in sorted(agreement.items())},
            device_to_host_bytes=self._device_to_host,
            host_to_device_bytes=self._host_to_device,
        )

    # ------------------------------------------------------------------ momentum sync
    def _sync_momenta(self, agreement: Mapping[int, float] | None) -> list[int]:
        """Average the momenta the schedule selects; return their indices."""
        if not self.strategy.local_momentum:
            return []
        chosen = [i for i in self.momentum_sync.select(self._step, agreement, self.names)
                  if self._place[i] is not None]
        if not chosen:
            return []
        by_bucket: dict[int, list[Slot]] = {}
        for i in chosen:
            place = self._place[i]
            assert place is not None
            by_bucket.setdefault(place[0], []).append(place[1])
        for b, slots in sorted(by_bucket.items()):
            self.average_momenta(b, slots)
        return sorted(chosen)

    def average_momenta(self, bucket: int, slots: Sequence[Slot] | None = None) -> None:
        """Replace this rank's momenta of ``slots`` of ``bucket`` (all of them when None) by
        their average over the ranks (collective; one float32 all-reduce)."""
        mom = self._bucket_mom[bucket]
        everything = self.buckets[bucket].slots
        t0 = time.perf_counter()
        if slots is None or len(slots) == len(everything):
            self.comm.allreduce(mom, op="avg", out=mom)
        else:
            scratch = self._buffer(0).f
            pos = 0
            for s in slots:
                scratch[pos:pos + s.size] = mom[s.offset:s.stop]
                pos += s.size
            self.comm.allreduce(scratch[:pos], op="avg", out=scratch[:pos])
            pos = 0
            for s in slots:
                mom[s.offset:s.stop] = scratch[pos:pos + s.size]
                pos += s.size
        self._comm_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ replicas
    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every rank's parameters (every array of :attr:`replicas`) with rank
        ``root``'s, bitwise and in place (collective: every rank calls it). The constructor
        calls it with ``root=0`` unless ``broadcast_parameters=False``.

        Momenta are not touched (they are zero before the first step). Raises UsageError for
        a bad ``root``; communication failures are bitcoll's CommError family. In stale mode
        the update in flight is applied first (:meth:`flush`)."""
        self.flush()
        self.replicas.broadcast(self.comm, root)

    def check_replicas(self) -> None:
        """Check that every rank holds bitwise the same parameters (every array of
        :attr:`replicas`) as rank 0 (collective: one all-gather of 8 bytes per parameter).

        Returns None when they agree. Otherwise every rank raises the same
        :class:`lioncub.replicas.ReplicaMismatchError` (a UsageError) naming the lowest rank
        whose parameters differ from rank 0's and the first parameter where they do (index,
        and name when ``names`` were given); the communicator stays usable. In stale mode
        the update in flight is applied first (:meth:`flush`)."""
        self.flush()
        self.replicas.check(self.comm)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """This rank's optimizer state (copies): step count, tie counter, per-rank momenta
        (one float32 array per parameter, shaped like it), the sync schedule's state and the
        param groups' hyperparameters. Save one per rank; the "global" variant's momenta
        are identical on every rank. ``copy=False``: the momenta are :attr:`momenta` (views
        of the optimizer's own arrays, changed by the next step) instead of copies. In stale
        mode, UsageError while an update is in flight (call :meth:`flush` on every rank
        first: it is collective)."""
        self._check_settled("state_dict")
        groups = []
        index = 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({"lr": group["lr"], "betas": tuple(group["betas"]),
                           "weight_decay": group["weight_decay"],
                           "params": list(range(index, index + count))})
            index += count
        return {
            "format": _STATE_FORMAT,
            "variant": self.variant,
            "world_size": self.world_size,
            "rank": self.rank,
            "levels": self.levels,
            "tie": self.tie,
            "step": self._step,
            "tie_counter": self._tie_counter,
            "momentum": self._momentum_copies() if copy else self.momenta,
            "sync": self.momentum_sync.state_dict(),
            "param_groups": groups,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of an optimizer built the same way (same variant,
        world size, levels, tie rule, parameter shapes and groups, sync schedule). Each rank
        loads its own rank's state. Raises UsageError on any mismatch, before changing
        anything (also while a stale-mode update is in flight: :meth:`flush` first)."""
        self._check_settled("load_state_dict")
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise UsageError("not a lioncub.DistributedLion state dict", argument="state")
        for key, value in (("variant", self.variant), ("world_size", self.world_size),
                           ("levels", self.levels), ("tie", self.tie)):
            if state.get(key) != value:
                raise UsageError(f"state dict has {key}={state.get(key)!r}, this optimizer "
                                 f"has {value!r}", argument="state")
        momenta = state["momentum"]
        if len(momenta) != len(self.params):
            raise UsageError(f"state dict has {len(momenta)} momenta for "
                             f"{len(self.params)} parameters", argument="state")
        for i, m in enumerate(momenta):
            self._check_momentum(i, m)
        groups = state["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise UsageError("state dict has a different param-group structure", argument="state")
        for g in groups:
            check_hyper(g["lr"], *_check_betas(g["betas"]), g["weight_decay"])
        self.momentum_sync.load_state_dict(state["sync"])
        for i, m in enumerate(momenta):
            self._load_momentum(i, m)
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine["lr"] = saved["lr"]
            mine["betas"] = tuple(saved["betas"])
            mine["weight_decay"] = saved["weight_decay"]
        self._step = int(state["step"])
        self._tie_counter = int(state["tie_counter"])

    def _momentum_copies(self) -> list[Any]:
        """Copies of this rank's momenta, shaped like the parameters (for state_dict)."""
        return [m.reshape(p.shape).copy() for m, p in zip(self._mom, self.params, strict=True)]

    def _check_momentum(self, i: int, m: Any) -> None:
        """UsageError unless ``m`` can be loaded as the momentum of parameter ``i``."""
        m = np.asarray(m)
        p = self.params[i]
        if m.shape != p.shape or m.dtype != np.float32:
            raise UsageError(f"momentum {i} has shape {m.shape} / dtype {m.dtype}, "
                             f"expected {p.shape} / float32", argument="state", index=i)

    def _load_momentum(self, i: int, m: Any) -> None:
        """Overwrite this rank's momentum of parameter ``i`` with ``m`` (checked); nothing
        to copy when ``m`` is that momentum's own memory (a view from :attr:`momenta`)."""
        src, dst = np.asarray(m).reshape(-1), self._mom[i]
        if src.size and src.dtype == dst.dtype and src.ctypes.data == dst.ctypes.data:
            return
        dst[:] = src

    def __repr__(self) -> str:
        return (f"<DistributedLion variant={self.variant} levels={self.levels} "
                f"params={len(self.params)} buckets={len(self.buckets)} "
                f"rank={self.rank}/{self.world_size} step={self._step}>")
