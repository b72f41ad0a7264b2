"""``torch.optim`` front ends: :class:`Lion` and :class:`DistributedLion`.

torch is imported only by the ``lioncub.torch*`` modules (this one,
:mod:`lioncub.torch_engine`, :mod:`lioncub.torch_strategies` and
:mod:`lioncub.torch_layout`); ``import lioncub`` does not need it. Both classes are
:class:`torch.optim.Optimizer` subclasses: param groups (per-group ``lr``, ``betas``,
``weight_decay``), ``zero_grad``, ``state_dict`` / ``load_state_dict`` and LR schedulers work
as usual.

* :class:`Lion` is single-process Lion written with torch tensor operations (any device and
  floating dtype).
* :class:`DistributedLion` runs on one of two engines (``backend=``):

  - ``"numpy"``: the numpy core :class:`lioncub.DistributedLion` on the same memory:
    parameters, gradients and momenta are shared between torch and numpy
    (``Tensor.numpy()`` / ``torch.from_numpy``), so nothing is copied except into the flat
    buckets the collectives need. Float32 CPU tensors only.
  - ``"torch"``: :class:`lioncub.torch_engine.TorchEngine`, the same algorithm written with
    torch operations on the parameters' device (CPU or CUDA; float32, bfloat16 or float16
    parameters; float32 or bfloat16 momenta): on a GPU only the packed votes go to the host
    and only the packed result comes back (``last_stats.device_to_host_bytes`` /
    ``host_to_device_bytes``); on a CPU bitcoll packs the votes (``packing=``).
  - ``"auto"`` (default): "numpy" when every tensor is a float32 CPU tensor, the momentum
    is float32 and ``packing`` is "auto", "torch" otherwise.

  Either way, parameters must be dense and contiguous; do not replace a parameter's storage
  (``p.data = ...``) after construction (checked at every step).
* :func:`no_allreduce_hook` is a DistributedDataParallel communication hook that leaves
  every rank's gradients local, for models wrapped in DDP (see its docstring).

Example, 4 ranks (``python -m launch -n 4 train.py``)::

    import bitcoll, lioncub.torch
    comm = bitcoll.init()
    opt = lioncub.torch.DistributedLion(model.named_parameters(), comm,
                                        variant="lioncub-l1", lr=3e-4, weight_decay=0.1,
                                        momentum_sync="exp:4")
    for x, y in loader:                     # each rank its own shard
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                          # parameters stay identical on every rank
        print(opt.last_stats.comm_seconds)
    opt.check_replicas()                    # UsageError on every rank if the replicas differ

With DistributedDataParallel (DDP would otherwise average the gradients before the
optimizer, which makes every vote agree: Global Lion with extra traffic)::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=lioncub.torch.no_allreduce_hook)
    opt = lioncub.torch.DistributedLion(ddp.module.named_parameters(), comm)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from bitcoll.errors import UsageError

from .comm import CommLike
from .distributed import DEFAULT_BUCKET_BYTES
from .distributed import DistributedLion as _CoreDistributedLion
from .lion import check_hyper
from .replicas import ReplicaSet
from .stats import StepStats
from .sync import MomentumSync
from .torch_engine import MOMENTUM_DTYPES, PACKINGS, PARAM_DTYPES, TensorReplicas, TorchEngine

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

__all__ = ["Lion", "DistributedLion", "no_allreduce_hook"]

_STATE_FORMAT = "lioncub.torch.DistributedLion/1"
#: Engines of :class:`DistributedLion` (``backend=``).
BACKENDS = ("auto", "numpy", "torch")


def _betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise UsageError(f"betas must be a pair (beta1, beta2), got {betas!r}", argument="betas")
    _, b1, b2, _ = check_hyper(0.0, betas[0], betas[1], 0.0)
    return b1, b2


def _check_group(group: dict[str, Any]) -> tuple[float, float, float, float]:
    b1, b2 = _betas(group["betas"])
    lr, _, _, wd = check_hyper(group["lr"], b1, b2, group["weight_decay"])
    return lr, b1, b2, wd


class Lion(Optimizer):
    """Lion (Chen et al. 2023) as a torch optimizer.

    Per parameter with a gradient (parameters whose ``grad`` is None are skipped)::

        p <- p * (1 - lr * weight_decay)
        c  = beta1 * m + (1 - beta1) * g          (computed as torch.lerp(m, g, 1 - beta1))
        p <- p - lr * sign(c)
        m <- beta2 * m + (1 - beta2) * g          (m.lerp_(g, 1 - beta2))

    ``lerp`` rounds differently from the two-product form in the last bit, so trajectories
    agree with :func:`lioncub.lion_update` to float32 rounding, not bit for bit. State per
    parameter: ``"exp_avg"`` (the momentum). Raises UsageError for bad hyperparameters or a
    sparse gradient.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        b1, b2 = _betas(betas)
        check_hyper(lr, b1, b2, weight_decay)
        super().__init__(params, {"lr": lr, "betas": (b1, b2), "weight_decay": weight_decay})
        for group in self.param_groups:
            _check_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Lion step on every parameter with a gradient; returns ``closure()`` if given
        (evaluated with gradients enabled, before the update)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, b1, b2, wd = _check_group(group)
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise UsageError("Lion does not support sparse gradients", argument="grad")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                update = torch.lerp(m, grad, 1.0 - b1).sign_()
                p.add_(update, alpha=-lr)
                m.lerp_(grad, 1.0 - b2)
        return loss


class DistributedLion(Optimizer):
    """The distributed Lion variants (:data:`lioncub.VARIANTS`) as a torch optimizer.

    ``params``: tensors, ``model.named_parameters()``, or param groups (dicts whose
    ``"params"`` are tensors or ``(name, tensor)`` pairs, with optional ``lr``, ``betas``,
    ``weight_decay``). Every tensor must be dense and contiguous; with the numpy engine
    float32 on the CPU, with the torch engine float32, bfloat16 or float16, the trainable
    ones all on one device.
    Tensors with ``requires_grad=False`` stay in the param groups but are left out of the
    distributed layout and never updated. ``names``: one name per tensor (overrides names
    from ``named_parameters()``); names drive selective momentum sync, ``last_stats`` and
    error messages; default: the tensor's index in the flattened param groups (errors then
    name tensors by that index only: pass ``model.named_parameters()`` or ``names=`` to get
    names).

    Starting weights (``broadcast_parameters``): True (default, as DDP does): construction
    overwrites every tensor of the param groups, frozen ones included, with rank 0's values.
    False: construction compares them across ranks instead and, if any rank's differ from
    rank 0's, raises :class:`lioncub.replicas.ReplicaMismatchError` (a UsageError) on every
    rank, naming the lowest differing rank and the first differing tensor (its index in the
    flattened param groups, and its name when known). :meth:`check_replicas` runs that check
    at any time (e.g. after training); :meth:`broadcast_parameters` copies a rank's values
    at any time.

    ``backend``: "auto" (default), "numpy" or "torch" (module docstring); the engine in use
    is :attr:`backend`. ``momentum_dtype``: the momentum's dtype with the torch engine,
    ``torch.float32`` (default, also what None means) or ``torch.bfloat16`` (half the
    memory; the arithmetic stays float32 and the momentum is rounded once per step).

    ``packing`` (torch engine): where the votes are packed into bits. "device" packs them
    with torch operations on the parameters' device, so that only packed bytes cross to the
    host and back (``last_stats.device_to_host_bytes`` / ``host_to_device_bytes``); "host"
    (CPU parameters only) hands them to bitcoll unpacked, whose collective packs them on the
    way to the wire, as the numpy engine does: nothing crosses a bus on a CPU, and the votes
    are not packed twice. The results and the bytes on the wire are the same. "auto"
    (default): "host" on a CPU, "device" elsewhere. The numpy engine takes only "auto"
    (another value with ``backend="auto"`` selects the torch engine).

    ``stale``: True applies each step's update one step later, so that its exchange overlaps
    the next step's forward and backward pass (for slow or far links; numpy backend only,
    not with ``overlap``; :meth:`flush` applies the last one; see
    :class:`lioncub.distributed.DistributedLion`).
    ``overlap``: True starts each bucket's work (direction, votes, packing and its
    collective) during ``backward()``, as soon as every gradient of the bucket is final and
    every later bucket has started (hooks ``register_post_accumulate_grad_hook``; buckets
    go from the last layers to the first, in the same order on every rank;
    :meth:`lioncub.DistributedLion.ready`). :meth:`step` starts the buckets whose
    gradients did not all arrive (e.g. a parameter without a gradient this step), waits,
    and applies every update: parameters change only in :meth:`step`, and the results are
    bitwise those without overlap. With gradient accumulation, run every backward but the
    last inside :meth:`no_sync` (a gradient declared twice before :meth:`step` raises
    UsageError from ``backward()``). Hyperparameters (LR schedulers) are read when the first
    bucket starts; do not change them between ``backward()`` and :meth:`step`. Not with
    ``tie="elementwise"`` (its ties depend on the order of the calls). Make no other
    collective call on ``comm`` between ``backward()`` and :meth:`step` (log the loss after
    the step, or give the optimizer a communicator of its own, ``comm.split(0)``): where a
    bucket starts depends on which gradients a rank has, so such a call could meet a bucket's
    collective on another rank. Memory: every bucket in flight keeps its own collective
    (host) buffers.

    The other arguments are those of :class:`lioncub.DistributedLion`, which the engine
    implements: at :meth:`step` every trainable tensor's ``grad`` (None counts as a zero
    gradient on this rank, see :mod:`lioncub.distributed`) goes to the engine, which updates
    the tensors in place. Gradients must be on the parameter's device (any floating dtype
    with the torch engine, float32 with the numpy one). Construction and :meth:`step` are
    collective (every rank calls them).

    ``state[p]["momentum"]`` is a tensor view of this rank's momentum of ``p`` (on the
    parameter's device with the torch engine).
    :meth:`state_dict` returns this rank's state (momenta as tensors, the param groups'
    hyperparameters, and the core's step count, tie counter and sync schedule state under
    ``"lioncub"``); :meth:`load_state_dict` restores it exactly.
    """

    def __init__(self, params: Iterable[Any], comm: CommLike, variant: str = "lioncub-l1",
                 lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, levels: int | None = None,
                 tie: str = "alternate",
                 momentum_sync: MomentumSync | str | None = None,
                 bucket_size: int = DEFAULT_BUCKET_BYTES,
                 names: Sequence[str] | None = None, *,
                 broadcast_parameters: bool = True, backend: str = "auto",
                 momentum_dtype: torch.dtype | None = None, overlap: bool = False,
                 packing: str = "auto", stale: bool = False,
                 agreement: bool | None = None) -> None:
        b1, b2 = _betas(betas)
        check_hyper(lr, b1, b2, weight_decay)
        self._constructed = False
        super().__init__(params, {"lr": lr, "betas": (b1, b2), "weight_decay": weight_decay})
        self._all: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        all_names, self._named = self._names(names)
        self._all_names = all_names
        self._backend = self._choose_backend(backend, momentum_dtype, packing)
        core_groups = []
        core_names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._global_index: list[int] = []
        index = 0
        for group in self.param_groups:
            _check_group(group)
            arrays = []
            for p in group["params"]:
                self._check_tensor(p, all_names[index], index)
                if p.requires_grad:
                    arrays.append(p.detach().numpy() if self._backend == "numpy"
                                  else p.detach())
                    self._tensors.append(p)
                    self._global_index.append(index)
                    core_names.append(all_names[index])
                index += 1
            core_groups.append({"params": arrays, "lr": group["lr"], "betas": group["betas"],
                                "weight_decay": group["weight_decay"]})
        options: dict[str, Any] = {
            "variant": variant, "lr": lr, "betas": (b1, b2), "weight_decay": weight_decay,
            "levels": levels, "tie": tie, "momentum_sync": momentum_sync,
            "bucket_size": bucket_size, "names": core_names,
            "broadcast_parameters": broadcast_parameters, "replicas": self._replica_set(),
            "agreement": agreement}
        if stale is not False and (self._backend != "numpy" or overlap):
            raise UsageError("stale=True needs the numpy backend (float32 CPU parameters, "
                             "backend='auto' or 'numpy') and overlap=False (the exchange "
                             "already overlaps the next step)", argument="stale")
        if self._backend == "numpy":
            self._core = _CoreDistributedLion(core_groups, comm, **options, stale=stale)
        else:
            self._core = TorchEngine(core_groups, comm, **options,
                                     momentum_dtype=momentum_dtype or torch.float32,
                                     packing=packing)
        self._ptrs = [p.data_ptr() for p in self._tensors]
        self._accumulating = False
        self._local_index = {id(p): i for i, p in enumerate(self._tensors)}
        self._hooks: list[Any] = []
        if not isinstance(overlap, bool):
            raise UsageError(f"overlap must be True or False, got {overlap!r}", argument="overlap")
        if overlap:
            if tie == "elementwise":
                raise UsageError("overlap=True starts buckets in another order, which "
                                 "changes tie='elementwise''s ties; use another tie rule",
                                 argument="overlap")
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                for p in self._tensors]
        self.overlap = overlap
        momenta: list[Any] = list(self._core.momenta)
        for p, m in zip(self._tensors, momenta, strict=True):
            self.state[p]["momentum"] = m if isinstance(m, torch.Tensor) \
                else torch.from_numpy(m)
        self._constructed = True

    # ------------------------------------------------------------------ set-up helpers
    def _choose_backend(self, backend: object, momentum_dtype: object, packing: str) -> str:
        if backend not in BACKENDS:
            raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}",
                             argument="backend")
        if momentum_dtype is not None and momentum_dtype not in MOMENTUM_DTYPES:
            raise UsageError(f"momentum_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{momentum_dtype!r}", argument="momentum_dtype")
        plain = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in self._all) \
            and momentum_dtype in (None, torch.float32)
        if packing not in PACKINGS:
            raise UsageError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}",
                             argument="packing")
        if backend == "numpy" and packing != "auto":
            raise UsageError(f"packing={packing!r} is an option of the torch engine; the "
                             "numpy backend packs inside bitcoll's collectives", argument="packing")
        if backend == "numpy" and momentum_dtype not in (None, torch.float32):
            raise UsageError("the numpy backend keeps float32 momenta; use backend='torch' "
                             "for another momentum_dtype", argument="momentum_dtype")
        if backend == "auto":
            return "numpy" if plain and packing == "auto" else "torch"
        return str(backend)

    def _names(self, names: Sequence[str] | None) -> tuple[list[str], bool]:
        """(one name per tensor, whether they are real names rather than indices)."""
        count = len(self._all)
        if names is not None:
            names = list(names)
            if len(names) != count or not all(isinstance(n, str) for n in names):
                raise UsageError(f"names must be {count} strings (one per tensor)",
                                 argument="names")
            return names, True
        if all("param_names" in g for g in self.param_groups):
            return [str(n) for g in self.param_groups for n in g["param_names"]], True
        return [str(i) for i in range(count)], False

    def _replica_set(self) -> ReplicaSet:
        """Every tensor of the param groups (frozen ones included), as it is now."""
        for index, (p, name) in enumerate(zip(self._all, self._all_names, strict=True)):
            self._check_tensor(p, name, index)
        names = self._all_names if self._named else None
        unnamed = "pass model.named_parameters() or names= to name tensors"
        if self._backend == "torch":
            return TensorReplicas(self._all, names, unnamed=unnamed)
        return ReplicaSet([p.detach().numpy() for p in self._all], names, unnamed=unnamed)

    def _check_tensor(self, p: torch.Tensor, name: str, index: int) -> None:
        if self._backend == "torch":
            if p.dtype not in PARAM_DTYPES or p.layout != torch.strided:
                raise UsageError(f"parameter {name} must be a dense float32, bfloat16 or "
                                 f"float16 tensor, got {p.dtype} ({p.layout})", argument="params",
                                 index=index)
        elif p.dtype != torch.float32 or p.device.type != "cpu" or p.layout != torch.strided:
            raise UsageError(f"parameter {name} must be a dense float32 CPU tensor, got "
                             f"{p.dtype} on {p.device} ({p.layout}); backend='torch' takes "
                             "other dtypes and devices", argument="params", index=index)
        if not p.is_contiguous():
            raise UsageError(f"parameter {name} must be contiguous", argument="params",
                             index=index)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the distributed layout is fixed afterwards."""
        if getattr(self, "_constructed", False):
            raise UsageError("DistributedLion cannot add param groups after construction "
                             "(every rank's bucket layout is fixed); build a new optimizer",
                             argument="param_group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ properties
    @property
    def core(self) -> _CoreDistributedLion:
        """The engine doing the work: the numpy core :class:`lioncub.DistributedLion`, or
        its subclass :class:`lioncub.torch_engine.TorchEngine`."""
        return self._core

    @property
    def last_stats(self) -> StepStats | None:
        """:class:`lioncub.stats.StepStats` of the last step (None before the first)."""
        return self._core.last_stats

    @property
    def backend(self) -> str:
        """The engine in use: "numpy" or "torch"."""
        return self._backend

    @property
    def variant(self) -> str:
        return self._core.variant

    # ------------------------------------------------------------------ replicas
    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every tensor of the param groups (frozen ones included) on every rank
        with rank ``root``'s values, bitwise and in place (collective). Construction does this
        with ``root=0`` unless ``broadcast_parameters=False``. Raises UsageError for a bad
        ``root``, or on the rank where a tensor is no longer a contiguous float32 CPU tensor
        (the other ranks then fail in the collective, at their deadline)."""
        self._replica_set().broadcast(self._core.comm, root)

    def check_replicas(self) -> None:
        """Check that every rank holds bitwise the same tensors (every tensor of the param
        groups, frozen ones included) as rank 0 (collective: one all-gather of 8 bytes per
        tensor). Returns None when they agree; otherwise every rank raises the same
        :class:`lioncub.replicas.ReplicaMismatchError` (a UsageError) naming the lowest rank
        that differs from rank 0 and the first differing tensor (index in the flattened
        param groups, and name when known). A tensor that is no longer a contiguous float32
        CPU tensor raises UsageError on its rank only, before the all-gather."""
        self._replica_set().check(self._core.comm)

    # ------------------------------------------------------------------ step
    def _sync_hyper(self) -> None:
        for mine, core in zip(self.param_groups, self._core.param_groups, strict=True):
            lr, b1, b2, wd = _check_group(mine)
            core["lr"], core["betas"], core["weight_decay"] = lr, (b1, b2), wd

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One distributed step (collective). Returns ``closure()`` if given (evaluated with
        gradients enabled, before the update). Raises UsageError for a gradient that does not
        fit the engine (numpy: a dense float32 CPU tensor of the parameter's shape; torch: a
        dense floating tensor of its shape on its device), or a parameter whose storage was
        replaced."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._core.pending:
            self._sync_hyper()
        self._core.step([self._grad(p, ptr) for p, ptr in zip(self._tensors, self._ptrs,
                                                               strict=True)])
        return loss

    def flush(self) -> None:
        """``stale=True``: apply the update still in flight from the last :meth:`step`
        (collective; see :meth:`lioncub.distributed.DistributedLion.flush`). Call it before
        evaluating, before ``state_dict()`` and at the end of training; a no-op otherwise."""
        if isinstance(self._core, _CoreDistributedLion):
            self._core.flush()

    def _grad(self, p: torch.Tensor, ptr: int) -> Any:
        """``p``'s gradient as the engine takes it (a numpy view for the numpy engine)."""
        if p.data_ptr() != ptr:
            raise UsageError("a parameter's storage was replaced after the optimizer was "
                             "built; the optimizer updates the original memory", argument="params")
        g = p.grad
        if g is None or self._backend == "torch":
            return g  # the torch engine checks its gradients itself
        if g.dtype != torch.float32 or g.device.type != "cpu" or g.layout != torch.strided:
            raise UsageError(f"gradients must be dense float32 CPU tensors, got {g.dtype} "
                             f"on {g.device} ({g.layout})", argument="grad")
        return g.detach().numpy()

    # ------------------------------------------------------------------ overlap
    def _check_idle(self) -> None:
        if self._core.pending:
            raise UsageError("buckets of the coming step are in flight (overlap=True): call "
                             "step() first")

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        """post-accumulate-grad hook: declare ``p``'s gradient final unless accumulating."""
        if self._accumulating:
            return
        i = self._local_index[id(p)]
        if not self._core.pending:
            self._sync_hyper()
        self._core.ready(i, self._grad(p, self._ptrs[i]))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """With ``overlap=True``: backward passes inside this context only accumulate
        gradients (no bucket starts); the backward after it is the last micro-step, whose
        gradients start the buckets. Without overlap it does nothing. Like
        DistributedDataParallel's ``no_sync``::

            for micro in batches[:-1]:
                with opt.no_sync():
                    loss_fn(model(micro)).backward()
            loss_fn(model(batches[-1])).backward()   # buckets start during this backward
            opt.step()
        """
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"state": {index: {"momentum": tensor}}, "param_groups":
        [hyperparameters and "params" indices], "lioncub": {...}}`` (copies). UsageError
        between a backward pass that started buckets (``overlap=True``) and :meth:`step`."""
        self._check_idle()
        core = self._core.state_dict()
        momenta = core.pop("momentum")
        core.pop("param_groups")
        state = {gi: {"momentum": m if isinstance(m, torch.Tensor) else torch.from_numpy(m)}
                 for gi, m in zip(self._global_index, momenta, strict=True)}
        groups = []
        index = 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            count = len(group["params"])
            saved["params"] = list(range(index, index + count))
            index += count
            groups.append(saved)
        return {"format": _STATE_FORMAT, "state": state, "param_groups": groups,
                "lioncub": core}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of an optimizer built the same way on the same rank.
        Raises UsageError on any mismatch, before changing anything."""
        self._check_idle()
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
            raise UsageError("not a lioncub.torch.DistributedLion state dict",
                             argument="state_dict")
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise UsageError("state dict has a different param-group structure",
                             argument="state_dict")
        saved_state = state_dict["state"]
        momenta = []
        for gi in self._global_index:
            entry = saved_state.get(gi)
            if entry is None or "momentum" not in entry:
                raise UsageError(f"state dict has no momentum for parameter {gi}",
                                 argument="state_dict")
            m = entry["momentum"]
            momenta.append(m.detach().cpu().numpy() if self._backend == "numpy" else m)
        core_groups = []
        for group, mine in zip(groups, self.param_groups, strict=True):
            count = sum(1 for p in mine["params"] if p.requires_grad)
            core_groups.append({"lr": group["lr"], "betas": tuple(group["betas"]),
                                "weight_decay": group["weight_decay"],
                                "params": list(range(count))})
        core = dict(state_dict["lioncub"])
        core["momentum"] = momenta
        core["param_groups"] = core_groups
        self._core.load_state_dict(core)
        for group, mine in zip(groups, self.param_groups, strict=True):
            for k, v in group.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v


def no_allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DistributedDataParallel communication hook that sends nothing: every rank keeps its
    own gradients.

    Plain DDP averages the gradients over the ranks during ``backward()``; every rank then
    hands the same averaged gradient to the optimizer, every rank's vote agrees, and a
    distributed Lion variant degenerates into Global Lion plus the traffic of a float32
    all-reduce. Registered with ``ddp_model.register_comm_hook(state=None,
    hook=lioncub.torch.no_allreduce_hook)``, DDP skips its all-reduce and every parameter's
    ``grad`` after ``backward()`` is bitwise this rank's local gradient, as without DDP;
    :class:`DistributedLion` then does the communication. DDP's other duties are unchanged
    (rank 0's parameters and buffers are broadcast when the model is wrapped, buffers before
    each forward unless ``broadcast_buffers=False``).

    Returns an already completed future holding ``bucket.buffer()`` unchanged. ``state`` is
    ignored.
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP's register_comm_hook compares the hook's annotations with the classes themselves, and
# this module's annotations are strings (``from __future__ import annotations``).
if torch.distributed.is_available():
    from torch._C._distributed_c10d import GradBucket as _GradBucket

    no_allreduce_hook.__annotations__.update(
        bucket=_GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]})
