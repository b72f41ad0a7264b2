"""Fault-tolerant training with :class:`~lioncub.distributed.DistributedLion`.

:class:`ElasticLion` runs an optimizer over the current epoch of a
:class:`bitcoll.elastic.ElasticGroup` and keeps going when ranks die or join. The loop::

    group = bitcoll.elastic.ElasticGroup.from_env(timeout=30)   # JobFinished: nothing to do
    opt = ElasticLion(group, params, lambda comm, **kw: DistributedLion(params, comm, **kw))
    while opt.step_count < steps:                     # the same count on every rank
        e = opt.epoch                                  # shard the data by e.rank / e.size
        opt.step(grads_of(params, batch(opt.step_count, e.rank, e.size)))  # False: lost
    opt.finish()                                       # replicas checked, joiners released
    group.close()

The public surface: :meth:`ElasticLion.step`, :attr:`~ElasticLion.step_count`,
:attr:`~ElasticLion.epoch`, :meth:`~ElasticLion.recover` (after a CommError of a collective
of the caller's own on ``group.comm``), :meth:`~ElasticLion.finish`, and the attributes
``opt`` (the current epoch's DistributedLion: ``opt.opt.state_dict()``,
``opt.opt.check_replicas()``), ``epochs`` (every epoch seen, in order), ``lost_steps`` and
``group``. ``examples/elastic_numpy.py`` is a complete program.

How a step runs (:meth:`ElasticLion.step`):

1. The parameters and this rank's optimizer state are copied (the *snapshot*: the state of
   the last committed step).
2. The optimizer's step runs (its collectives, then the update, in place).
3. :meth:`bitcoll.elastic.ElasticGroup.commit`: the step is committed once every rank has
   reached this point; the snapshot is dropped.
4. On a :class:`~bitcoll.errors.CommError` in 2 or 3 the group moves to a new epoch
   (:meth:`~bitcoll.elastic.ElasticGroup.recover`): this rank keeps its updated state when
   the step was committed elsewhere (it finished the step's exchange, so its update is the
   same), otherwise it restores the snapshot. A new optimizer is built over the new
   communicator (``make_optimizer(comm, broadcast_parameters=False)``: its construction
   checks that every rank holds bitwise the same parameters) and this rank's state is
   loaded into it. Only the step in flight is lost.
5. When processes joined (a restarted rank), the new optimizer is built first, unchecked
   (``make_optimizer(comm, broadcast_parameters=None)``); then the joiners receive the
   state from the others over the epoch's authenticated connections, in one
   :func:`bitcoll.elastic.share_state`: the parameters and the step, tie and sync counters
   (each holder sends one slice straight into the joiners' arrays) and the momenta as their
   average over the holders (each holder averages one slice and sends it to every rank,
   straight into the new optimizer's momenta, so every replica ends with the same
   momentum, and no rank copies its state on the way). ``check_replicas`` then runs.

Costs: a copy of the parameters and momenta per step (memory bandwidth, no communication)
and one all-reduce of 24 bytes per step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from bitcoll.elastic import ElasticGroup, Epoch, EvictedError, NoQuorumError, share_state
from bitcoll.errors import CommError, UsageError

from .distributed import DistributedLion

__all__ = ["ElasticLion", "MakeOptimizer"]

#: Builds the optimizer over a communicator; receives ``broadcast_parameters`` (True, False
#: or None) as a keyword and passes it on to :class:`DistributedLion`.
MakeOptimizer = Callable[..., DistributedLion]


class ElasticLion:
    """A :class:`DistributedLion` that survives lost ranks and takes new ones in.

    ``group``: a started :class:`bitcoll.elastic.ElasticGroup`; ``params``: the float32
    arrays the optimizer updates in place (the same objects ``make_optimizer`` uses);
    ``make_optimizer(comm, broadcast_parameters=...)``: builds the optimizer over a
    communicator (called once per epoch, collectively). A process that joins (its group's
    epoch says "receive") gets the job's state during construction.

    Attributes: ``opt`` (the current optimizer), ``step_count`` (committed steps),
    ``lost_steps`` (steps lost to failures on this rank), ``epochs`` (the epochs seen).
    """

    def __init__(self, group: ElasticGroup, params: Sequence[npt.NDArray[np.float32]],
                 make_optimizer: MakeOptimizer) -> None:
        self.group = group
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not isinstance(p, np.ndarray) or not p.flags.c_contiguous:
                raise UsageError(f"parameter {i} must be a C-contiguous numpy array (a CPU "
                                 "torch tensor: tensor.detach().numpy())")
        self.make_optimizer = make_optimizer
        self.committed = -1  # the last committed step (step_count - 1)
        self.lost_steps = 0
        self.epochs: list[Epoch] = []
        # this rank's committed optimizer state when the optimizer does not hold it (after a
        # lost step); None: the optimizer's own state is the committed one
        self._state: dict[str, Any] | None = None
        self.opt: DistributedLion
        self._settle(group.epoch, has_state=group.epoch.action != "receive")

    @property
    def step_count(self) -> int:
        """Steps committed so far (the same on every member of the epoch)."""
        return self.committed + 1

    @property
    def epoch(self) -> Epoch:
        """The current epoch (its ``rank`` and ``size`` are this process's place in it)."""
        return self.group.epoch

    def recover(self) -> Epoch:
        """Move to the next epoch after a :class:`~bitcoll.errors.CommError` of a collective
        the caller ran itself on ``group.comm`` between steps (e.g. an evaluation's
        all-reduce): the state stays that of the last committed step. Returns the new epoch.
        Raises :class:`bitcoll.elastic.NoQuorumError` and :class:`bitcoll.elastic.EvictedError`."""
        self._settle(self.group.recover(self.committed), has_state=True)
        return self.group.epoch

    def finish(self) -> None:
        """End the job on this rank (collective): check that every replica holds the same
        parameters (:meth:`DistributedLion.check_replicas`, moving to a new epoch and checking
        again when a rank fails meanwhile), then :meth:`bitcoll.elastic.ElasticGroup.finish`
        so that processes still waiting to join give up. Raises
        :class:`lioncub.replicas.ReplicaMismatchError` when the replicas differ."""
        while True:
            try:
                self.opt.check_replicas()
                break
            except (EvictedError, NoQuorumError):
                raise
            except CommError:
                self.recover()
        self.group.finish()

    # ------------------------------------------------------------------ steps
    def step(self, grads: Sequence[npt.NDArray[np.float32] | None]) -> bool:
        """One fault-tolerant step (collective over the current epoch). Returns True when
        it was committed, False when a failure cost it (the state is then that of the last
        committed step, or that step's result when it was committed elsewhere: check
        :attr:`step_count`). Raises :class:`bitcoll.elastic.NoQuorumError` and
        :class:`bitcoll.elastic.EvictedError` (see :mod:`bitcoll.elastic`)."""
        saved = [p.copy() for p in self.params]
        state = self.opt.state_dict()
        pending = False
        try:
            self.opt.step(grads)
            pending = True
            grow = self.group.commit(self.committed + 1)
        except (EvictedError, NoQuorumError):
            raise
        except CommError:
            epoch = self.group.recover(self.committed, pending)
            if epoch.action == "apply":
                self.committed += 1
                self._state = None  # the optimizer holds the step's result
                done = True
            else:
                for p, s in zip(self.params, saved, strict=True):
                    p[...] = s
                self._state = state
                self.lost_steps += 1
                done = False
            self._settle(epoch, has_state=True)
            return done
        self.committed += 1
        self._state = None
        if grow:
            self._settle(self.group.recover(self.committed), has_state=True)
        return True

    # ------------------------------------------------------------------ epochs
    def _settle(self, epoch: Epoch, has_state: bool) -> None:
        """Build the epoch's optimizer and give joiners the state; on a failure, move on to
        the next epoch and try again."""
        while True:
            self.epochs.append(epoch)
            try:
                self._adopt(epoch, has_state)
                return
            except (EvictedError, NoQuorumError):
                raise
            except CommError:
                epoch = self.group.recover(self.committed, False, has_state=has_state)
                if epoch.action == "receive":
                    has_state = False

    def _adopt(self, epoch: Epoch, has_state: bool) -> None:
        comm = self.group.comm
        receiving = not has_state or epoch.rank in epoch.joined
        if epoch.joined:
            # The new optimizer first, unchecked: the joiners' parameters and everyone's
            # averaged momenta then land straight in its arrays (no staging copies), and the
            # replicas are checked once they are in.
            opt = self.make_optimizer(comm, broadcast_parameters=None)
            momenta: list[Any] = opt.momenta
            if not all(isinstance(m, np.ndarray) and m.dtype == np.float32
                       and m.flags.c_contiguous for m in momenta):
                # an engine on another kind of array: staged through float32 host arrays
                momenta = [np.zeros(p.shape, np.float32) for p in self.params]
            got = self._share(epoch, receiving, momenta)
            opt.check_replicas()
            if got["scalars"] is not None:
                merged = self._fit(dict(got["scalars"]), opt)
                self.committed = int(got["committed"])
            else:  # the holders had no optimizer state yet
                merged = opt.state_dict(copy=False)
            merged["momentum"] = momenta  # the optimizer's own: loading copies nothing
            opt.load_state_dict(merged)
        else:
            # epoch 0: rank 0's starting weights everywhere; later: every rank holds the same
            opt = self.make_optimizer(comm, broadcast_parameters=epoch.number == 0)
            state = self._committed_state()
            if state is not None:
                opt.load_state_dict(self._fit(state, opt))
        self.opt = opt
        self._state = None  # the optimizer's own state is the committed one

    def _committed_state(self) -> dict[str, Any] | None:
        """This rank's committed optimizer state (None before it has an optimizer); its
        momenta may be the optimizer's own arrays: read them, never write them."""
        if self._state is not None:
            return self._state
        return self.opt.state_dict(copy=False) if hasattr(self, "opt") else None

    @staticmethod
    def _fit(state: dict[str, Any], opt: DistributedLion) -> dict[str, Any]:
        """``state`` made loadable into ``opt`` (another world size and levels)."""
        out = dict(state)
        out.update(world_size=opt.world_size, levels=opt.levels, rank=opt.rank)
        return out

    def _share(self, epoch: Epoch, receiving: bool, out: list[npt.NDArray[np.float32]]
               ) -> dict[str, Any]:
        """The job's state to the ranks that joined, in one :func:`share_state`: the
        parameters (each holder sends one slice), the holders' counters (a small JSON
        record) and the holders' average momenta (float32), which land in ``out`` (the new
        optimizer's momenta) on every rank; a holder's committed state is only read, so it
        survives a failure of the call. Returns the record."""
        comm = self.group.comm
        holder = not receiving and epoch.rank in epoch.holders
        state = None
        if holder:  # read only: no copy of the momenta
            state = self._committed_state()
        scalars = None if state is None else \
            {k: v for k, v in state.items() if k != "momentum"}
        raw = json.dumps({"scalars": scalars, "committed": self.committed}).encode() \
            if holder else b""
        n = np.array([len(raw)], np.int64)
        comm.allreduce(n, op="max", out=n)
        buf = np.zeros(int(n[0]), np.uint8)
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
        dst = [m.reshape(-1) for m in out]
        src = dst if state is None else \
            [np.ascontiguousarray(m, np.float32).reshape(-1) for m in state["momentum"]]
        flat = [p.reshape(-1) for p in self.params]
        share_state(comm, [*flat, buf], epoch.holders, average=src, out=dst)
        got: dict[str, Any] = json.loads(buf.tobytes().decode())
        return got
