"""``train.py --fault-tolerant``: a training loop that survives lost ranks and takes
restarted ones back.

Start it with ``python -m launch -n 4 --max-restarts 2 train.py --fault-tolerant ...``: the
launcher serves the rendezvous store (so any rank, rank 0 included, may die) and restarts a
dead rank, which joins the running job (see ``docs/elastic.md``). The loop is built on
lioncub's elastic API:

1. :meth:`bitcoll.elastic.ElasticGroup.from_env` joins the job: the initial ranks form epoch
   0; a process that finds the job running (a restarted rank) waits until a step boundary
   takes it in. No ``bitcoll.init()``: the group's :attr:`~bitcoll.elastic.ElasticGroup.comm`
   is the communicator of the current epoch.
2. :class:`lioncub.elastic.ElasticLion` wraps :class:`lioncub.distributed.DistributedLion`
   over the model's float32 parameters (numpy views of the torch tensors, updated in place).
   Each of its steps is committed on every live rank or on none; a failure costs the step in
   flight, which is done again with the survivors; a joiner receives the parameters, the
   averaged momenta and the counters from the live ranks.
3. Step ``k``'s batches are :func:`lioncub.recipe.data.sharded_windows` of the epoch's rank
   and size: one sample of the stream shared out by whoever is alive, a function of the
   step alone (nothing to hand a joiner).
4. Every membership change is printed by the new epoch's rank 0 (the epoch, the committed
   step, the ranks that left and the ranks that joined) and recorded in the summary's
   ``membership``.
5. Collectives outside the optimizer's steps (the replica check every ``--check-every``
   steps, checkpoints) run at points every rank reaches after the same committed step,
   joiners included; after a failure inside one of them (:meth:`ElasticLion.recover
   <lioncub.elastic.ElasticLion.recover>` there, the next step's recovery on the ranks that
   got through) every rank does that step boundary again. The evaluations use no
   communication:
   the current rank 0 evaluates the whole validation set itself (the replicas are
   identical).
6. :meth:`lioncub.elastic.ElasticLion.finish` at the end: the replicas are checked (in a new
   epoch if a rank fails meanwhile), and restarted processes that still wait to join give up
   (and exit 0). The final checkpoint (``--save``) follows it.

The step records of the JSON log are the logging rank's own figures (its loss, times and
bytes; no per-step all-reduce), ``world_size`` the size of the step's epoch. ``--save``
writes the files of the live ranks (``rank<r>.pt`` by epoch rank); ``--resume`` is not
supported with ``--fault-tolerant``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from bitcoll.elastic import ElasticGroup, Epoch, JobFinished
from bitcoll.errors import CommError
from lioncub.distributed import DistributedLion
from lioncub.elastic import ElasticLion

from .checkpoints import CHECKPOINT_FORMAT, TRAJECTORY_KEYS, save_checkpoint
from .data import Corpus, sharded_windows
from .logs import LOG_FORMAT, Progress, first_at_or_below, format_summary, summarize, write_json
from .loop import (
    check_replicas,
    default_threads,
    digest48,
    evaluate,
    lr_at,
    same_on_all_ranks,
    step_figures,
    step_record,
)
from .models import DTYPES, autocast, token_loss

__all__ = ["run_fault_tolerant", "describe_epoch"]


def describe_epoch(epoch: Epoch, previous: Epoch | None) -> str:
    """One line about a membership change: the epoch, the committed steps, who left (ranks of
    ``previous``), who joined (ranks of ``epoch``) and the new world size."""
    parts = []
    if epoch.left:
        parts.append(f"rank{'s' if len(epoch.left) > 1 else ''} "
                     f"{', '.join(map(str, epoch.left))} left")
    if epoch.joined:
        parts.append(f"{len(epoch.joined)} process{'es' if len(epoch.joined) > 1 else ''} "
                     f"joined as rank{'s' if len(epoch.joined) > 1 else ''} "
                     f"{', '.join(map(str, epoch.joined))}")
    if not parts:
        parts.append("the same members reconnected")
    was = f" (was {previous.size})" if previous is not None else ""
    return (f"membership: epoch {epoch.number} after {epoch.step + 1} committed steps: "
            f"{'; '.join(parts)}; {epoch.size} rank{'s' if epoch.size > 1 else ''} now{was}")


def run_fault_tolerant(args: argparse.Namespace,
                       build: Callable[[argparse.Namespace], tuple[Corpus, nn.Module]],
                       describe: Callable[..., None], run_info: Callable[..., dict[str, Any]],
                       out: TextIO | None = None, **group_options: Any) -> dict[str, Any] | None:
    """Run ``train.py --fault-tolerant`` in this process (one rank of the elastic job).

    ``build(args)`` returns the corpus and the freshly initialised model; ``describe`` and
    ``run_info`` are train.py's (the opening lines, the log's config and run); rank 0 of the
    current epoch writes to ``out`` (default stdout); ``group_options`` go to
    :meth:`bitcoll.elastic.ElasticGroup.from_env` (``timeout`` is ``--comm-timeout``).
    Returns the log record on the rank that is rank 0 at the end, None on the others and on a
    process that arrived after the job finished. Raises bitcoll's errors
    (:class:`bitcoll.elastic.NoQuorumError`: too few survivors; ``EvictedError``: this
    process was left behind) and RuntimeError (different corpora, non-finite losses,
    differing replicas)."""
    stream = sys.stdout if out is None else out
    wall0 = time.perf_counter()
    corpus, model = build(args)
    dtype = DTYPES[args.dtype]
    names = [n for n, _ in model.named_parameters()]
    tensors: list[torch.Tensor] = [p for _, p in model.named_parameters()]
    arrays = [p.detach().numpy() for p in tensors]  # the optimizer updates the model in place
    n_params = sum(a.size for a in arrays)
    corpus_digest = digest48(corpus.digest.encode())
    try:
        group = ElasticGroup.from_env(timeout=args.comm_timeout, **group_options)
    except JobFinished:
        print("train.py: the job finished before this process could join it", file=sys.stderr)
        return None

    def make_optimizer(comm: Any, **kw: Any) -> DistributedLion:
        # collective, on every rank of an epoch (joiners included) at the same point
        if not same_on_all_ranks(comm, [corpus_digest])[0]:
            raise RuntimeError("the ranks built different corpora (different Python "
                               "installations?)")
        return DistributedLion(arrays, comm, variant=args.optimizer, lr=args.lr,
                               betas=(0.9, 0.99), weight_decay=args.weight_decay,
                               levels=args.levels, momentum_sync=args.momentum_sync,
                               agreement=args.agreement, names=names, **kw)

    try:
        threads = args.threads or default_threads(group.comm.local_size)
        torch.set_num_threads(threads)
        first = group.epoch
        opt = ElasticLion(group, arrays, make_optimizer)
        return _loop(args, group, opt, model, tensors, corpus, n_params, threads, stream,
                     wall0, dtype, first, describe, run_info)
    finally:
        group.close()


def _loop(args: argparse.Namespace, group: ElasticGroup, opt: ElasticLion, model: nn.Module,
          tensors: list[torch.Tensor], corpus: Corpus, n_params: int, threads: int,
          stream: TextIO, wall0: float, dtype: torch.dtype, first: Epoch,
          describe: Callable[..., None], run_info: Callable[..., dict[str, Any]]
          ) -> dict[str, Any] | None:
    """The training loop of :func:`run_fault_tolerant`."""
    initial = int(first.size if first.action != "receive" else group.epoch.size)

    def lead() -> bool:
        return group.epoch.rank == 0

    def say(text: str) -> None:
        if lead():
            progress.note(text)

    stop = args.steps if args.stop_after is None else args.stop_after
    progress = Progress(stop, stream, not args.no_progress, start=opt.step_count)
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    membership: list[dict[str, Any]] = []
    seen = 0  # epochs of opt.epochs already reported

    def report_epochs() -> None:
        nonlocal seen
        for i in range(max(seen, 1), len(opt.epochs)):
            e = opt.epochs[i]
            membership.append({"epoch": e.number, "step": e.step + 1, "world_size": e.size,
                               "left": list(e.left), "joined": list(e.joined)})
            say(describe_epoch(e, opt.epochs[i - 1]))
        seen = len(opt.epochs)

    info = run_info(args, group.epoch.size, group.comm.backend, threads, n_params, corpus,
                    opt.step_count)
    describe(args, group.epoch.size, group.comm.backend, threads, n_params, corpus, say)
    if first.action == "receive":  # a restarted process: never rank 0, so it says so itself
        stream.write(f"train.py: joined the running job after {opt.step_count} committed steps "
                     f"as rank {group.epoch.rank} of {group.epoch.size}\n")
        stream.flush()
    seen = len(opt.epochs)
    train_start = time.perf_counter()
    target: dict[str, Any] | None = None

    def do_eval(step: int) -> None:
        nonlocal target
        if not lead() or any(e["step"] == step for e in evals):
            return
        val_loss = evaluate(model, None, corpus.val, args.batch_size, args.seq_len,
                            args.eval_batches, "cpu", dtype, ranks=initial)
        if not math.isfinite(val_loss):
            raise RuntimeError(f"validation loss is {val_loss} at step {step}")
        step_s = float(sum(s["time"] for s in steps if s["step"] <= step
                           and not s.get("warmup")))
        rec = {"step": step, "val_loss": val_loss,
               "elapsed": time.perf_counter() - train_start, "step_seconds": step_s}
        evals.append(rec)
        progress.note(f"step {step:>{len(str(args.steps))}}/{args.steps}  "
                      f"val loss {val_loss:.4f}")
        if target is None and first_at_or_below([rec], args.target_loss) is not None:
            target = dict(rec)
            progress.note(f"target val loss {args.target_loss:g} reached at step {step}")

    def save(count: int) -> None:
        epoch = group.epoch
        save_checkpoint(args.save, group.comm, {
            "format": CHECKPOINT_FORMAT, "rank": epoch.rank, "world_size": epoch.size,
            "step": count, "epoch": epoch.number,
            "trajectory": {**{k: getattr(args, k) for k in TRAJECTORY_KEYS},
                           "fault_tolerant": True},
            "model": model.state_dict(), "optimizer": _tensors(opt.opt.state_dict()),
            "steps": steps, "evals": evals})
        say(f"checkpoint of step {count} written to {args.save} by the {epoch.size} live ranks")

    def at_boundary(count: int) -> None:
        """What follows committed step ``count`` on every rank of the epoch (a joiner starts
        here too). A failure inside a check or checkpoint moves every rank to the next epoch
        (``opt.recover()`` here, or the next step's recovery on the ranks that got through)
        and all of them, joiners included, do this step boundary again."""
        if count == args.steps or (args.eval_every and count % args.eval_every == 0) \
                or count == 0:
            do_eval(count)
        while True:
            try:
                if args.check_every and count % args.check_every == 0 and 0 < count < stop:
                    check_replicas(opt.opt.check_replicas, f"after step {count}")
                if args.save is not None and args.save_every and 0 < count < stop \
                        and count % args.save_every == 0:
                    save(count)
                return
            except CommError as exc:
                say(f"step {count}: a failure interrupted the check or checkpoint ({exc})")
                opt.recover()  # the state stays that of step `count`
                report_epochs()

    at_boundary(opt.step_count)
    warm = True
    while opt.step_count < stop:
        step = opt.step_count + 1
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.schedule)
        for g in opt.opt.param_groups:
            g["lr"] = lr
        epoch = group.epoch
        if warm:
            say("compiling kernels (first step only) ...")
        t0 = time.perf_counter()
        x, y = sharded_windows(corpus.train, args.batch_size, args.seq_len, args.seed, step,
                               epoch.rank, epoch.size)
        with autocast("cpu", dtype):
            loss = token_loss(model, x, y)
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        loss_value = loss.item()
        t1 = time.perf_counter()
        grads = [None if p.grad is None else p.grad.numpy() for p in tensors]
        done = opt.step(grads)
        t2 = time.perf_counter()
        report_epochs()
        if done and opt.step_count == step:
            figures = step_figures(opt.opt.last_stats, optional=True)
            rec = step_record(step, lr, loss_value, (t0, t1, t2), figures, warmup=warm,
                              applied=True, comm=None)
            rec["world_size"] = epoch.size
            rec["epoch"] = group.epoch.number  # after the step (joiners are taken in there)
            steps.append(rec)
            warm = False
            if lead():
                progress.update(step, rec["loss"], rec["time"], rec["compute"], rec["comm"],
                                rec["bytes_sent"])
        at_boundary(opt.step_count)
    train_time = time.perf_counter() - train_start
    if not evals:  # rank 0 changed and the new one has not evaluated yet
        do_eval(opt.step_count)
    # every replica checked (again in a new epoch if a rank fails meanwhile), then the
    # processes still waiting to join are released
    check_replicas(opt.finish, "after training")
    report_epochs()
    if args.save is not None:  # after finish(): no joiner can come in any more
        save(opt.step_count)
    if not lead():
        return None
    summary = summarize(args, steps, evals, world_size=group.epoch.size,
                        backend=group.comm.backend, n_params=n_params, target=target,
                        train_time=train_time, wall_time=time.perf_counter() - wall0,
                        identical=True)
    summary.update(membership=membership, lost_steps=opt.lost_steps, initial_world_size=initial)
    record = {"format": LOG_FORMAT, **info, "steps": steps, "evals": evals, "summary": summary}
    stream.write(format_summary(summary) + "\n")
    stream.flush()
    if args.json_log is not None:
        write_json(args.json_log, record)
        say(f"log written to {args.json_log}")
    return record


def _tensors(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` with its numpy arrays as tensors (checkpoints are loaded
    with ``weights_only=True``)."""
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            out[key] = [torch.from_numpy(np.array(v)) for v in value]
        elif isinstance(value, np.ndarray):
            out[key] = torch.from_numpy(np.array(value))
    return out
