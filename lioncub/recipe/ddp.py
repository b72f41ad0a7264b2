"""``train.py``'s DistributedDataParallel mode (``--backend bitcoll|gloo``, ``--hook``).

The model is wrapped in torch's ``DistributedDataParallel`` over a ``torch.distributed``
process group of the chosen backend ("bitcoll": :mod:`bitcoll.torch`), met through
torchrun's store under torchrun, else through a TCP store that rank 0 opens on a free port of
``MASTER_ADDR`` (announced over bitcoll) (:func:`init_process_group`). Without a hook,
``--optimizer global`` lets DDP average the gradients during backward and steps Lion
(:class:`lioncub.torch.Lion`) on the mean gradient; any other variant keeps the gradients
local (``lioncub.torch.no_allreduce_hook``) and votes after backward in
:class:`lioncub.torch.DistributedLion`. ``--hook lioncub`` votes inside DDP's backward,
bucket by bucket (:mod:`lioncub.torch_hooks`: ``lioncub_hook`` and the stateless
``LionCubStep``, bit for bit DistributedLion's updates); ``--hook sign`` replaces the average
by a packed 1-bit majority vote with error feedback (``sign_hook``) and steps
``torch.optim.AdamW``. :class:`DDPOptimizer` hides the four behind one optimizer interface.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import bitcoll
from lioncub.replicas import ReplicaSet
from lioncub.stats import StepStats
from lioncub.torch import DistributedLion, Lion, no_allreduce_hook
from lioncub.torch_hooks import (
    LionCubHookState,
    LionCubStep,
    SignHookState,
    lioncub_hook,
    sign_hook,
)

__all__ = ["init_process_group", "DDPOptimizer"]

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_process_group(backend: str, comm: bitcoll.Communicator, solo: bool,
                       timeout: float) -> None:
    """``torch.distributed.init_process_group(backend)`` for the ranks of ``comm``: through
    torchrun's store under torchrun, else a TCP store on a free port of rank 0's
    ``MASTER_ADDR`` (default 127.0.0.1), the port broadcast over ``comm``. ``solo``: every
    rank a one-rank group of its own (``--no-comm``)."""
    import torch.distributed as dist

    if backend == "bitcoll":
        importlib.import_module("bitcoll.torch")  # registers the backend
    limit = datetime.timedelta(seconds=timeout)
    if solo:
        store = dist.HashStore()  # type: ignore[attr-defined]  # not in torch's stubs
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=limit)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, init_method="env://", rank=comm.rank,
                                world_size=comm.size, timeout=limit)
    else:
        port = np.array([_free_port() if comm.rank == 0 else 0], dtype=np.int64)
        comm.broadcast(port, 0)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{int(port[0])}",
                                rank=comm.rank, world_size=comm.size, timeout=limit)


class DDPOptimizer:
    """DDP mode's optimizer (see the module docstring), with the parts of
    DistributedLion's interface that the training loop uses: ``param_groups``,
    ``zero_grad``, ``step``, ``last_stats``, ``check_replicas``, ``state_dict`` and
    ``load_state_dict``. ``net`` is the DDP-wrapped model (for the training forward).
    ``args``: train.py's options (``hook``, ``backend``, ``optimizer``, ``lr``,
    ``weight_decay``, ``levels``, ``momentum_sync``); ``named``: the model's named
    parameters; ``opt_comm``: the optimizer's communicator (the hooks split theirs off it,
    or off the bitcoll process group's). Collective construction (DDP's broadcast of rank
    0's parameters, the hook's communicator and agreement check); call it after
    :func:`init_process_group`."""

    def __init__(self, args: Any, model: nn.Module,
                 named: Sequence[tuple[str, torch.Tensor]], comm: bitcoll.Communicator,
                 opt_comm: bitcoll.Communicator) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.net = DDP(model)
        self.comm = opt_comm
        self.named = named
        self.hooked = args.hook is not None
        self.hook_state: LionCubHookState | None = None
        self.sign_state: SignHookState | None = None
        self.inner: DistributedLion | None = None
        # the hooks' communicator: the bitcoll group's own (the hook splits a private one
        # off it), or one split off bitcoll.init()'s, so train.py's calls never meet them
        hook_comm = None if args.backend == "bitcoll" else opt_comm
        params = [p for _, p in named]
        self.opt: Any
        if args.hook == "lioncub":
            self.opt = LionCubStep(named, lr=args.lr, betas=(0.9, 0.99),
                                   weight_decay=args.weight_decay)
            self.hook_state = LionCubHookState(self.opt, hook_comm, variant=args.optimizer,
                                               levels=args.levels,
                                               momentum_sync=args.momentum_sync, private=True,
                                               agreement=args.agreement)
            self.net.register_comm_hook(self.hook_state, lioncub_hook)
        elif args.hook == "sign":
            self.opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
            self.sign_state = SignHookState(hook_comm, private=True)
            self.net.register_comm_hook(self.sign_state, sign_hook)
        elif args.optimizer == "global":  # DDP averages the gradients: Lion on the mean
            self.opt = Lion(params, lr=args.lr, betas=(0.9, 0.99),
                            weight_decay=args.weight_decay)
        else:  # local gradients, votes after backward
            self.net.register_comm_hook(None, no_allreduce_hook)
            self.inner = self.opt = DistributedLion(
                named, opt_comm, variant=args.optimizer, lr=args.lr, betas=(0.9, 0.99),
                weight_decay=args.weight_decay, levels=args.levels,
                momentum_sync=args.momentum_sync, agreement=args.agreement)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.opt.param_groups
        return groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()

    @property
    def last_stats(self) -> StepStats | None:
        """lioncub's statistics of the last step (the hook's or DistributedLion's), None for
        DDP's own averaging and the sign hook."""
        if self.hook_state is not None:  # the votes travelled during backward
            stats = self.hook_state.last_stats
            return None if stats is None else dataclasses.replace(stats, comm_seconds=0.0)
        return None if self.inner is None else self.inner.last_stats

    def check_replicas(self) -> None:
        """Collective: ReplicaMismatchError on every rank unless every rank's parameters are
        bitwise rank 0's."""
        if self.inner is not None:
            self.inner.check_replicas()
        elif self.hook_state is not None:
            self.hook_state.check_replicas()
        else:
            ReplicaSet([p.detach().numpy() for _, p in self.named],
                       [n for n, _ in self.named]).check(self.comm)

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.opt.state_dict()}
        if self.hook_state is not None:  # momenta as tensors (checkpoints load weights only)
            hook = self.hook_state.state_dict()
            hook["momentum"] = [torch.from_numpy(m) for m in hook["momentum"]]
            state["hook"] = hook
        if self.sign_state is not None:
            errors = self.sign_state.errors
            state["errors"] = [errors.get(p) for _, p in self.named]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.hook_state is not None:
            hook = dict(state["hook"])
            hook["momentum"] = [m.numpy() for m in hook["momentum"]]
            self.hook_state.load_state_dict(hook)
        if self.sign_state is not None:
            for (_, p), e in zip(self.named, state["errors"], strict=True):
                if e is not None:
                    self.sign_state.errors[p] = e.clone()

    def close(self) -> None:
        for st in (self.hook_state, self.sign_state):
            if st is not None:
                st.close()

