"""Lion Cub's vote inside DistributedDataParallel's backward: communication hooks.

Plain DistributedDataParallel (DDP) averages every gradient bucket with a float32 all-reduce
as soon as the bucket is ready, while ``backward()`` still runs. A vote is not linear (a sum
of signs is not the sign of a sum), so a hook that votes cannot hand its work to
``dist.all_reduce``: the hooks here call bitcoll's packed collectives instead (packed
majority ``sign_allreduce``, minimal-width ``quantized_allreduce``).

Lion Cub in DDP's hooks
-----------------------
:func:`lioncub_hook` runs one step of :class:`lioncub.torch.DistributedLion` split along
DDP's gradient buckets. For each bucket, as soon as DDP declares it ready:

1. Lion's interpolation ``c = beta1 m + (1 - beta1) g`` of every parameter of the bucket with
   this rank's own momentum ``m`` (kept per parameter, so it survives DDP's rebuilding of its
   buckets after the first iteration), the momentum advanced, then the variant's votes
   (the variant's :class:`lioncub.strategies.VariantStrategy`: ``prepare``);
2. the variant's collective on the votes, started with ``async_op=True`` on the hook's
   bitcoll communicator (``start``); ``backward()`` goes on meanwhile;
3. on the hook's own thread, once the collective completed: the update direction ``u`` of
   every element written into the bucket (``update``): ``majority`` (+-1), ``sign(sum)`` or
   ``sum / p``; DDP copies it into the parameters' ``.grad``;
4. after the last bucket of the step: the momentum schedule's averaging (the same
   collectives, on the same layout, as :class:`~lioncub.torch.DistributedLion`).

:class:`LionCubStep`, a stateless ``torch.optim.Optimizer``, then applies
``p <- p * (1 - lr * weight_decay) - lr * p.grad``. The parameters after the step are bit for
bit those of ``lioncub.torch.DistributedLion(...).step()`` on the same local gradients, for
every built-in variant (``global`` included: its hook averages the gradients in float32 and
steps the shared momentum), every momentum schedule, tie rule ("elementwise" excepted) and
``levels``. The numpy core :class:`lioncub.DistributedLion` holds the momenta and the
schedule (:attr:`LionCubHookState.core`): the tie rule alternates per core bucket
(``bucket_size``) as in the optimizer, and a DDP bucket that spans core buckets of both tie
parities is voted in one collective per run of parameters with the same rule.

Example, 4 ranks (``torchrun --nproc-per-node 4 train.py``)::

    import bitcoll, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lioncub.torch_hooks import LionCubStep, LionCubHookState, lioncub_hook

    dist.init_process_group("gloo")                 # or "bitcoll" (import bitcoll.torch)
    comm = bitcoll.init()                           # or None: the group's own communicator
    ddp = DDP(model)
    opt = LionCubStep(ddp.module.named_parameters(), lr=3e-4, weight_decay=0.1)
    state = LionCubHookState(opt, comm, variant="lioncub-l1", momentum_sync="exp:4")
    ddp.register_comm_hook(state, lioncub_hook)     # once, before the first backward
    for x, y in loader:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()               # votes travel during backward
        opt.step()                                  # p * decay - lr * u
    state.check_replicas()

Sign votes for any optimizer
----------------------------
:func:`sign_hook` (state :class:`SignHookState`) replaces DDP's average with a packed 1-bit
majority vote with error feedback (EF-signSGD with a majority vote): per parameter ``t``,
``v = g + e`` (``e``: this rank's compression error, zero at first), the vote ``sign(v)``
(``v == 0`` votes +1), ``e <- v - mean|v| * sign(v)``, and every rank's ``.grad`` becomes
``scale_t * majority`` where ``scale_t`` is the mean over the ranks of ``mean|v_t|`` (so
the gradient keeps a mean gradient's magnitude for SGD, Adam, ...). 1 bit per element on the
wire (plus one float64 per tensor), whatever the world size.

FSDP2
-----
:class:`LionCubFSDPState` does the same vote for ``fully_shard`` models, as FSDP's custom
reduce-scatter of each FSDP module (``state.install(model)``; :class:`LionCubStep` over the
sharded parameters): each call gets the module's full local gradients and returns this
rank's chunk of the update direction; the shards after the step are bit for bit the
matching elements of DistributedLion's parameters. Each rank keeps every parameter's
momentum in full (Lion Cub's momenta are per rank), see the class docstring for the limits.

Communicators and threads
-------------------------
The hooks take a :class:`bitcoll.Communicator` (``bitcoll.init()``), or a torch process group
of the "bitcoll" backend or None for the default group (then the group's communicator,
:func:`bitcoll.torch.communicator_of`). A bitcoll communicator refuses to be called by two
threads at once: the collectives are started from the thread that runs ``backward()`` and
the momentum averaging runs on the hook's own thread after the last bucket, never at the
same time; ``private=True`` (the default for a process group, whose communicator DDP itself
uses) gives the hook a communicator of its own (``comm.split(0)``, collective). No other
thread may use the hook's communicator while ``backward()`` runs.

Limits: float32 CPU parameters (the numpy core); every rank's DDP must have the same
buckets (DDP's default); with ``find_unused_parameters=True`` a parameter that no rank used
in a step keeps ``.grad`` as DDP leaves it and :class:`LionCubStep` skips it when it is None
(DistributedLion would still decay it and apply its momentum's vote). The hook state counts
steps by the last bucket, so run every ``backward()`` that DDP synchronizes to the end.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.optim import Optimizer

from bitcoll.errors import UsageError
from bitcoll.torch import hook_future

from .buckets import Bucket, Slot
from .comm import CommLike, WorkLike
from .distributed import DEFAULT_BUCKET_BYTES
from .distributed import DistributedLion as _Core
from .lion import Hyper, check_hyper
from .replicas import ReplicaSet
from .stats import StepStats
from .strategies import Buffers
from .sync import MomentumSync
from .torch import _betas, _check_group

__all__ = ["LionCubStep", "LionCubHookState", "lioncub_hook", "SignHookState", "sign_hook",
           "hook_communicator", "LionCubFSDPState", "LionCubReduceScatter"]

F32 = npt.NDArray[np.float32]


def hook_communicator(comm: Any, private: bool | None = None) -> CommLike:
    """The bitcoll communicator a hook uses for ``comm``: a bitcoll Communicator as given, or
    for a torch process group (None: the default group) of the "bitcoll" backend its
    communicator (:func:`bitcoll.torch.communicator_of`). ``private`` (default: True for a
    process group, False for a communicator): use ``comm.split(0)`` instead, a communicator of
    the hook's own (collective: every rank calls this at the same point). UsageError for a
    group that is not a bitcoll group, or when ``bitcoll.torch`` is not available."""
    group = comm is None or isinstance(comm, torch.distributed.ProcessGroup)
    if group:
        try:
            bt = importlib.import_module("bitcoll.torch")
        except ImportError as exc:
            raise UsageError("a process group needs the bitcoll torch.distributed backend "
                             "(bitcoll.torch); pass a bitcoll Communicator instead "
                             "(bitcoll.init())", argument="comm") from exc
        resolved = bt.communicator_of(comm)
    else:
        resolved = comm
    for attr in ("sign_allreduce", "quantized_allreduce", "allreduce", "rank", "size"):
        if not hasattr(resolved, attr):
            raise UsageError(f"comm must be a bitcoll Communicator or a bitcoll process group, "
                             f"got {type(comm).__name__}", argument="comm")
    if private is None:
        private = group
    if private:
        if getattr(resolved, "split", None) is None:
            raise UsageError(f"{type(resolved).__name__} has no split(): pass private=False")
        # a group's communicator splits on the group's worker thread, behind its collectives
        resolved = bt.submit(lambda c: c.split(0), comm).wait() if group \
            else resolved.split(0)
    out: CommLike = resolved
    return out


def _bucket_slots(bucket: Any, index: dict[int, int], sizes: Sequence[int]
                  ) -> tuple[torch.Tensor, list[Slot]]:
    """(the bucket's flat buffer, one slot per non-empty parameter in buffer coordinates with
    its index in ``index``). UsageError for a buffer that is not a float32 CPU tensor laid out
    as the concatenation of its parameters, or an unknown parameter."""
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32 or buffer.device.type != "cpu" \
            or not buffer.is_contiguous():
        raise UsageError(f"the hook takes float32 CPU gradient buckets, got {buffer.dtype} on "
                         f"{buffer.device}")
    slots: list[Slot] = []
    offset = 0
    for p in bucket.parameters():
        i = index.get(id(p))
        if i is None:
            raise UsageError("DistributedDataParallel's bucket holds a parameter that the "
                             "hook's optimizer does not have (build the optimizer from "
                             "ddp.module's parameters)")
        n = p.numel()
        if n != sizes[i]:
            raise UsageError(f"parameter {i} changed size since the optimizer was built")
        if n:
            slots.append(Slot(i, offset, n))
        offset += n
    if offset != buffer.numel():
        raise UsageError(f"the bucket's buffer holds {buffer.numel()} elements, its "
                         f"parameters {offset}: not a dense bucket")
    return buffer, slots


class _Worker:
    """One daemon thread running callables in order (the hooks' completions)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, task: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(task)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None


class LionCubStep(Optimizer):
    """The stateless step after :func:`lioncub_hook`: per parameter with a gradient,
    ``p <- p * (1 - lr * weight_decay) - lr * p.grad`` (float32 scalars rounded as
    :class:`lioncub.lion.Hyper` rounds them, each operation rounded: bitwise the update
    :class:`lioncub.torch.DistributedLion` applies, when ``.grad`` holds the hook's update
    direction). ``betas`` are not used here: the hook state reads them from this optimizer's
    param groups at the first bucket of every step (LR schedulers and per-group
    hyperparameters work as with DistributedLion).

    ``params``: tensors, ``named_parameters()`` (names drive the hook's selective momentum
    sync and error messages) or param groups. UsageError for bad hyperparameters or a sparse
    gradient."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        b1, b2 = _betas(betas)
        check_hyper(lr, b1, b2, weight_decay)
        super().__init__(params, {"lr": lr, "betas": (b1, b2), "weight_decay": weight_decay})
        for group in self.param_groups:
            _check_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply every parameter's ``.grad`` as the update direction (see the class
        docstring); returns ``closure()`` if given (evaluated with gradients enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            h = Hyper.of(*_check_group(group))
            lr, decay = float(h.lr), float(h.decay)
            for p in group["params"]:
                u = p.grad
                if u is None:
                    continue
                if u.is_sparse:
                    raise UsageError("LionCubStep does not support sparse gradients")
                p.mul_(decay)  # p * decay rounded, then lr * u rounded, then the difference
                p.sub_(torch.mul(u, lr))
        return loss


@dataclass
class _Open:
    """The step whose buckets the hooks are running."""

    hypers: list[Hyper]
    before: dict[str, int]
    start: float
    sums: dict[int, int] = field(default_factory=dict)
    waited: float = 0.0
    error: BaseException | None = None


class LionCubHookState:
    """The state of :func:`lioncub_hook` for one DDP model: the momenta, the schedule and the
    communicator (see the module docstring).

    ``optimizer``: the :class:`LionCubStep` over the DDP module's parameters (its param
    groups give the hyperparameters and names). ``comm``: a bitcoll Communicator, a
    "bitcoll" process group or None (the default group), resolved by
    :func:`hook_communicator` with ``private``. The other arguments are
    :class:`lioncub.torch.DistributedLion`'s, with the same meaning and defaults; a hook run
    is bitwise that optimizer built with the same arguments over the same parameters in the
    same order. ``tie="elementwise"`` is refused (DDP's bucket order is not the optimizer's).

    Construction is collective (the core's agreement check and, with
    ``broadcast_parameters=True``, rank 0's parameters copied to every rank). Attributes:
    :attr:`core` (the numpy :class:`lioncub.DistributedLion` holding momenta, schedule and
    counters; its ``last_stats`` is the last step's, where ``comm_seconds`` is the time the
    hook's thread waited for collectives, not exposed time), :attr:`comm`."""

    def __init__(self, optimizer: LionCubStep, comm: Any = None, variant: str = "lioncub-l1",
                 levels: int | None = None, tie: str = "alternate",
                 momentum_sync: MomentumSync | str | None = None,
                 bucket_size: int = DEFAULT_BUCKET_BYTES,
                 names: Sequence[str] | None = None, *, broadcast_parameters: bool = True,
                 private: bool | None = None, agreement: bool | None = None) -> None:
        if not isinstance(optimizer, LionCubStep):
            raise UsageError(f"optimizer must be a LionCubStep, got {type(optimizer).__name__}",
                             argument="optimizer")
        if tie == "elementwise":
            raise UsageError("tie='elementwise' depends on the order of the collectives, "
                             "which DDP's buckets change; use another tie rule", argument="tie")
        self.optimizer = optimizer
        tensors = [p for g in optimizer.param_groups for p in g["params"]]
        all_names = _names(optimizer, names, len(tensors))
        for i, (p, name) in enumerate(zip(tensors, all_names, strict=True)):
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous() \
                    or p.layout != torch.strided:
                raise UsageError(f"parameter {name} must be a dense contiguous float32 CPU "
                                 f"tensor, got {p.dtype} on {p.device}", argument="optimizer",
                                 index=i)
        groups = []
        core_names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        position = 0
        for g in optimizer.param_groups:
            arrays = []
            for p in g["params"]:
                if p.requires_grad:
                    arrays.append(self._host_array(p))
                    self._tensors.append(p)
                    core_names.append(all_names[position])
                position += 1
            lr, b1, b2, wd = _check_group(g)
            groups.append({"params": arrays, "lr": lr, "betas": (b1, b2), "weight_decay": wd})
        self.comm: CommLike = hook_communicator(comm, private)
        first = optimizer.param_groups[0]
        self.core = _Core(
            groups, self.comm, variant=variant, lr=first["lr"], betas=first["betas"],
            weight_decay=first["weight_decay"], levels=levels, tie=tie,
            momentum_sync=momentum_sync, bucket_size=bucket_size, names=core_names,
            broadcast_parameters=broadcast_parameters, agreement=agreement,
            replicas=ReplicaSet([self._host_array(p) for p in tensors], all_names))
        self._index = {id(p): i for i, p in enumerate(self._tensors)}
        self._sizes = [p.numel() for p in self._tensors]
        self._buffers: dict[int, Buffers] = {}
        self._open: _Open | None = None
        self._worker = _Worker("lioncub-hook")

    def _host_array(self, p: torch.Tensor) -> F32:
        """The numpy array the core holds for parameter ``p`` (its memory)."""
        out: F32 = p.detach().numpy()
        return out

    @property
    def last_stats(self) -> StepStats | None:
        """The core's :class:`lioncub.stats.StepStats` of the last completed step."""
        return self.core.last_stats

    def check_replicas(self) -> None:
        """:meth:`lioncub.torch.DistributedLion.check_replicas` (collective, on the hook's
        communicator; call it between steps)."""
        self.core.check_replicas()

    def state_dict(self) -> dict[str, Any]:
        """The core's :meth:`lioncub.DistributedLion.state_dict` (momenta, counters, schedule);
        save it with the optimizer's and restore with :meth:`load_state_dict`."""
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state)

    def close(self) -> None:
        """Stop the hook's thread (a later hook call starts it again)."""
        self._worker.close()

    # ------------------------------------------------------------------ the hook
    def _buffer(self, key: int, size: int) -> Buffers:
        buf = self._buffers.get(key)
        if buf is None or buf.f.size < size:
            buf = self._buffers[key] = self.core.strategy.buffers(size)
        return buf

    def _sync_hyper(self) -> None:
        for mine, core in zip(self.optimizer.param_groups, self.core.param_groups, strict=True):
            lr, b1, b2, wd = _check_group(mine)
            core["lr"], core["betas"], core["weight_decay"] = lr, (b1, b2), wd

    def _runs(self, slots: list[Slot]) -> list[list[Slot]]:
        """Runs of consecutive slots that share one collective: all of them, or for a
        variant that breaks ties the runs with the same tie rule."""
        core = self.core
        if not core.strategy.breaks_ties or not slots:
            return [slots]

        def rule(s: Slot) -> str:
            place = core.slot_of(s.index)
            assert place is not None
            return core.tie_for(place[0])

        runs = [[slots[0]]]
        for s in slots[1:]:
            if rule(s) == rule(runs[-1][-1]):
                runs[-1].append(s)
            else:
                runs.append([s])
        return runs

    def run(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The body of :func:`lioncub_hook` for one DDP bucket."""
        core = self.core
        if self._open is None:
            self._sync_hyper()
            self._open = _Open(*core.begin_step())
        step = self._open
        buffer, slots = _bucket_slots(bucket, self._index, self._sizes)
        flat: F32 = buffer.detach().numpy()
        buf = self._buffer(bucket.index(), buffer.numel())
        grads: list[F32 | None] = [None] * len(self._tensors)
        for s in slots:
            grads[s.index] = flat[s.offset:s.stop]
        pieces: list[tuple[Bucket, Buffers, WorkLike, int]] = []
        last = bool(bucket.is_last())
        src, fut = hook_future()  # fut fails for DDP's C++ reducer too
        try:
            for run in self._runs(slots):
                a = run[0].offset
                place = core.slot_of(run[0].index)
                assert place is not None
                sub = Bucket(place[0], tuple(Slot(s.index, s.offset - a, s.size) for s in run),
                             run[-1].stop - a)
                view = Buffers(buf.f[a:], None if buf.q is None else buf.q[a:], buf.s[a:])
                core.strategy.prepare(core, sub, view, grads, step.hypers)
                pieces.append((sub, view, core.strategy.start(core, sub, view), a))
        except BaseException as exc:
            self._open = None
            raise exc
        if last:
            self._open = None

        def complete() -> None:
            try:
                if step.error is not None:
                    raise step.error
                for sub, view, work, a in pieces:
                    t0 = time.perf_counter()
                    work.wait()
                    step.waited += time.perf_counter() - t0
                    core.strategy.update(core, sub, view, step.hypers, flat[a:a + sub.size],
                                         step.sums)
                if last:
                    core.end_step(step.sums, step.before, step.start, comm_seconds=step.waited)
            except BaseException as exc:
                step.error = exc
                src.set_exception(exc)
                return
            src.set_result(buffer)

        self._worker.submit(complete)
        return fut


def _names(optimizer: Optimizer, names: Sequence[str] | None, count: int) -> list[str]:
    if names is not None:
        names = list(names)
        if len(names) != count or not all(isinstance(n, str) for n in names):
            raise UsageError(f"names must be {count} strings (one per tensor)")
        return names
    if all("param_names" in g for g in optimizer.param_groups):
        return [str(n) for g in optimizer.param_groups for n in g["param_names"]]
    return [str(i) for i in range(count)]


def lioncub_hook(state: LionCubHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Lion Cub's vote of ``bucket`` (module docstring). Register
    with ``ddp.register_comm_hook(state, lioncub_hook)`` once, before the first backward.
    The returned future completes (on the hook's thread) with the bucket's buffer holding the
    update direction of every element; it carries the UsageError of a non-finite gradient
    or the CommError of a failed collective. Non-finite values and bad buckets raise
    UsageError from the hook itself (so from ``backward()``)."""
    return state.run(bucket)


# ---------------------------------------------------------------------- FSDP2
class _FSDPBucket:
    """The part of DDP's ``GradBucket`` that :meth:`LionCubHookState.run` reads, over the
    full gradients of one FSDP module's parameters laid end to end."""

    def __init__(self, flat: torch.Tensor, params: list[torch.Tensor], key: int,
                 last: bool) -> None:
        self._flat, self._params, self._key, self._last = flat, params, key, last

    def buffer(self) -> torch.Tensor:
        return self._flat

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def index(self) -> int:
        return self._key

    def is_last(self) -> bool:
        return self._last


class LionCubFSDPState(LionCubHookState):
    """Lion Cub's vote for FSDP2 (``torch.distributed.fsdp.fully_shard``): the state of
    :class:`LionCubReduceScatter`, FSDP's custom reduce-scatter of every module (install
    both with :meth:`install`).

    FSDP2 reduce-scatters each module's gradients once backward has produced them; the
    custom reduce-scatter receives the module's full local gradients (every rank's chunks
    of every parameter, padded) and must return this rank's chunk of the result. Here it
    runs the same steps as :func:`lioncub_hook` on the module's parameters, as one bucket:
    Lion's interpolation with this rank's momentum, the variant's votes and collective on
    the hook's bitcoll communicator, the update direction of every element; this rank's
    chunk of it becomes the sharded ``.grad``, and :class:`LionCubStep` over the sharded
    parameters applies ``p * (1 - lr * wd) - lr * u`` to the shards. The sharded parameters
    after the step are bit for bit the corresponding elements of
    :class:`lioncub.torch.DistributedLion`'s on the same local gradients.

    The arguments are :class:`LionCubHookState`'s; ``optimizer`` is a :class:`LionCubStep`
    over the FSDP model's (sharded) parameters, built after ``fully_shard``. What it costs:
    Lion Cub keeps a momentum per rank fed by that rank's gradients, so each rank holds the
    momentum of every parameter in full (not sharded, unlike FSDP's optimizer states), and
    the vote is an all-reduce of the module's votes of which each rank keeps its chunk.
    The collective runs when FSDP calls the reduce-scatter (on CPU FSDP waits for it before
    it goes on with backward).

    Limits (UsageError, from backward): float32 gradients (FSDP's ``reduce_dtype`` float32
    or unset, with float32 parameters); parameters sharded on dim 0 (``fully_shard``'s
    default); every parameter of a module gets a gradient in every step (the step ends when
    every parameter was voted); one param group per FSDP module; FSDP's divide factors and
    ``set_force_sum_reduction_for_comms`` left at their defaults (the output is an update
    direction, not a gradient to scale). ``check_replicas`` is not available (a rank holds
    only its shards). ``tie="elementwise"`` is refused as for DDP."""

    def __init__(self, optimizer: LionCubStep, comm: Any = None, variant: str = "lioncub-l1",
                 levels: int | None = None, tie: str = "alternate",
                 momentum_sync: MomentumSync | str | None = None,
                 bucket_size: int = DEFAULT_BUCKET_BYTES,
                 names: Sequence[str] | None = None, *, private: bool | None = None,
                 agreement: bool | None = None) -> None:
        super().__init__(optimizer, comm, variant, levels, tie, momentum_sync, bucket_size,
                         names, broadcast_parameters=False, private=private,
                         agreement=agreement)
        self._left: set[int] = set()  # parameters not voted yet in this step
        self._keys = 0

    def _host_array(self, p: torch.Tensor) -> F32:
        # The core keeps the momenta (full shape) and never reads the parameters' values in
        # a hook's step: a zero array of the full shape stands in (untouched zero pages).
        return np.zeros(tuple(p.shape), np.float32)

    def check_replicas(self) -> None:
        raise UsageError("check_replicas is not available under FSDP: a rank holds only its "
                         "shards of the parameters")

    def install(self, model: torch.nn.Module) -> int:
        """``set_custom_reduce_scatter(LionCubReduceScatter(self, m))`` on every FSDP module
        ``m`` of ``model`` (itself included); returns how many. UsageError if none is."""
        from torch.distributed.fsdp import FSDPModule

        count = 0
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(LionCubReduceScatter(self, m))  # type: ignore[arg-type]
                count += 1
        if not count:
            raise UsageError("the model has no FSDP module (call fully_shard first)")
        return count

    def new_key(self) -> int:
        """A bucket key of its own for one FSDP module (negative: DDP's are >= 0)."""
        self._keys += 1
        return -self._keys

    def closes_step(self, params: Iterable[torch.Tensor]) -> bool:
        """Count ``params`` as voted in this step; whether they were the last ones."""
        if not self._left:
            self._left = set(range(len(self._tensors)))
        self._left.difference_update(self._index[id(p)] for p in params
                                     if id(p) in self._index)
        return not self._left


class LionCubReduceScatter:
    """FSDP2's custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that votes
    the gradients of one FSDP module with Lion Cub (:class:`LionCubFSDPState`, whose
    :meth:`~LionCubFSDPState.install` makes these). Implements torch's
    ``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter`` interface: ``allocate``
    and ``__call__``."""

    def __init__(self, state: LionCubFSDPState, module: Any) -> None:
        self.state = state
        self.module = module
        self._key = state.new_key()
        self._scratch: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _layout(self, world: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """Per parameter of the module's FSDP group: (parameter, dim-0 rows, elements per
        row, padded rows per rank's chunk)."""
        # torch 2.13 exposes the order of a module's parameters in its reduce-scatter only
        # through FSDP's private state (the FSDPParamGroup's fsdp_params)
        state = self.module._get_fsdp_state()  # noqa: SLF001
        out = []
        for fp in state._fsdp_param_group.fsdp_params:  # noqa: SLF001
            if fp.fsdp_placement.dim != 0:
                raise UsageError("the FSDP Lion Cub vote needs parameters sharded on dim 0 "
                                 f"(fully_shard's default), got Shard({fp.fsdp_placement.dim})")
            size = tuple(fp.sharded_param.shape)  # a DTensor's shape is the full one
            rows = size[0] if size else 1
            per_row = int(np.prod(size[1:])) if len(size) > 1 else 1
            out.append((fp.sharded_param, rows, per_row, -(-rows // world)))
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, op: Any, async_op: bool = False) -> None:
        """Vote the module's gradients (``input_tensor``: ``world`` rows, row ``r`` the
        padded dim-0 chunks ``r`` of every parameter) and write this rank's chunk of the
        update direction into ``output_tensor`` (padding zero). Synchronous; returns None."""
        world, me = int(group.size()), int(group.rank())
        if input_tensor.dtype != torch.float32 or output_tensor.dtype != torch.float32:
            raise UsageError(f"the FSDP Lion Cub vote takes float32 gradients, got "
                             f"{input_tensor.dtype} (set FSDP's reduce_dtype to float32)")
        layout = self._layout(world)
        cols = sum(chunk * per_row for _, _, per_row, chunk in layout)
        if input_tensor.numel() != world * cols or output_tensor.numel() != cols:
            raise UsageError("FSDP reduce-scattered a subset of the module's parameters: the "
                             "Lion Cub vote needs a gradient for every parameter in every "
                             "step")
        rows_in = input_tensor.detach().reshape(world, cols).to("cpu")
        total = sum(rows * per_row for _, rows, per_row, _ in layout)
        if self._scratch is None or self._scratch.numel() != total:
            self._scratch = torch.empty(total, dtype=torch.float32)
        flat = self._scratch
        spans = []  # (column in a row, position in flat, rows, per_row, chunk)
        col = pos = 0
        for _, rows, per_row, chunk in layout:
            spans.append((col, pos, rows, per_row, chunk))
            for r in range(world):
                real = max(0, min(chunk, rows - r * chunk)) * per_row
                at = pos + r * chunk * per_row
                flat[at:at + real] = rows_in[r, col:col + real]
            col += chunk * per_row
            pos += rows * per_row
        params = [p for p, _, _, _ in layout]
        last = self.state.closes_step(params)
        self.state.run(_FSDPBucket(flat, params, self._key, last)).wait()
        out = torch.zeros(cols, dtype=torch.float32)
        for col, pos, rows, per_row, chunk in spans:
            real = max(0, min(chunk, rows - me * chunk)) * per_row
            at = pos + me * chunk * per_row
            out[col:col + real] = flat[at:at + real]
        output_tensor.reshape(-1).copy_(out)


# ---------------------------------------------------------------------- sign votes, any optimizer
class SignHookState:
    """The state of :func:`sign_hook`: this rank's compression error per parameter (keyed by
    the parameter, so DDP's bucket rebuild keeps it), the tie rule of the majority
    ("alternate", "positive" or "negative", see :meth:`bitcoll.Communicator.sign_allreduce`)
    and the communicator (``comm``, ``private``: :func:`hook_communicator`; collective when
    it splits). ``error_feedback=False`` votes the plain gradient signs."""

    def __init__(self, comm: Any = None, tie: str = "alternate", error_feedback: bool = True,
                 private: bool | None = None) -> None:
        if tie not in ("alternate", "positive", "negative"):
            raise UsageError(f"tie must be 'alternate', 'positive' or 'negative', got {tie!r}",
                             argument="tie")
        if not isinstance(error_feedback, bool):
            raise UsageError(f"error_feedback must be True or False, got {error_feedback!r}",
                             argument="error_feedback")
        self.comm: CommLike = hook_communicator(comm, private)
        self.tie = tie
        self.error_feedback = error_feedback
        self.errors: dict[torch.Tensor, torch.Tensor] = {}
        self._scratch: dict[int, tuple[F32, npt.NDArray[np.int8]]] = {}
        self._worker = _Worker("lioncub-sign-hook")

    def close(self) -> None:
        """Stop the hook's thread."""
        self._worker.close()

    def run(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.dtype != torch.float32 or buffer.device.type != "cpu" \
                or not buffer.is_contiguous():
            raise UsageError(f"sign_hook takes float32 CPU gradient buckets, got "
                             f"{buffer.dtype} on {buffer.device}")
        flat: F32 = buffer.detach().numpy()
        n = flat.size
        key = bucket.index()
        scratch = self._scratch.get(key)
        if scratch is None or scratch[0].size < n:
            scratch = self._scratch[key] = (np.empty(n, np.float32), np.empty(n, np.int8))
        v, votes = scratch[0][:n], scratch[1][:n]
        spans: list[tuple[int, int, F32 | None]] = []
        offset = 0
        for p in bucket.parameters():
            size = p.numel()
            part = v[offset:offset + size]
            g = flat[offset:offset + size]
            err = None
            if self.error_feedback:
                e = self.errors.get(p)
                if e is None:
                    e = self.errors[p] = torch.zeros(size, dtype=torch.float32)
                err = e.numpy()
                np.add(g, err, out=part)
            else:
                part[:] = g
            spans.append((offset, offset + size, err))
            offset += size
        if offset != n:
            raise UsageError(f"the bucket's buffer holds {n} elements, its parameters "
                             f"{offset}: not a dense bucket")
        scales = np.array([float(np.abs(v[a:b]).mean(dtype=np.float64)) if b > a else 0.0
                           for a, b, _ in spans], np.float64)
        if not np.isfinite(scales).all():
            raise UsageError(f"non-finite gradient in DDP bucket {key} on rank "
                             f"{self.comm.rank}")
        local = scales.copy()
        comm: Any = self.comm
        w_scales: WorkLike = comm.allreduce(scales, op="avg", out=scales, async_op=True)
        w_votes: WorkLike = comm.sign_allreduce(v, op="majority", tie=self.tie, out=votes,
                                                async_op=True)
        src, fut = hook_future()  # fut fails for DDP's C++ reducer too

        def complete() -> None:
            try:
                w_scales.wait()
                w_votes.wait()
                for k, (a, b, err) in enumerate(spans):
                    if err is not None:  # e = v - mean|v| * sign(v), v == 0 voting +1
                        own = np.where(v[a:b] >= 0, np.float32(1), np.float32(-1))
                        np.subtract(v[a:b], own * np.float32(local[k]), out=err)
                    np.multiply(votes[a:b], np.float32(scales[k]), out=flat[a:b])
            except BaseException as exc:
                src.set_exception(exc)
                return
            src.set_result(buffer)

        self._worker.submit(complete)
        return fut


def sign_hook(state: SignHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: packed 1-bit majority vote with error feedback (module
    docstring); every rank's gradients become ``scale * majority``. Register with
    ``ddp.register_comm_hook(SignHookState(comm), sign_hook)``."""
    return state.run(bucket)


# DDP's register_comm_hook compares the hook's annotations with the classes themselves, and
# this module's annotations are strings (``from __future__ import annotations``).
if torch.distributed.is_available():
    from torch._C._distributed_c10d import GradBucket as _GradBucket

    for _hook in (lioncub_hook, sign_hook):
        _hook.__annotations__.update(
            bucket=_GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]})
