#!/usr/bin/env python3
"""Data-parallel training of a small character-level transformer with Lion Cub and its baselines.

Every rank holds a full replica of the model, draws its own minibatches, computes its own
gradient and calls :class:`lioncub.torch.DistributedLion`, which exchanges whatever the chosen
variant exchanges (float32 gradients, sign bits, quantized votes) through bitcoll and applies the
same update on every rank. The run compares Lion Cub with Global Lion and Distributed Lion on
identical data, seeds and step counts.

Running it::

    python -m launch -n 4 train.py                      # 4 ranks, TCP backend
    mpiexec -n 4 python train.py                        # 4 ranks, MPI backend
    python train.py --steps 100                         # one rank, no communication
    python -m launch -n 4 train.py --optimizer global --json-log runs/global.json
    torchrun --nproc-per-node 4 train.py                # torchrun's environment
    srun -N 4 --ntasks-per-node 1 python train.py       # Slurm (SLURM_* environment)
    python -m launch -n 4 train.py --backend gloo --hook   # DDP, votes during backward
    python -m launch -n 4 --max-restarts 2 train.py --fault-tolerant   # survives lost ranks

The backend is detected by ``bitcoll.init()``. The defaults (a 0.44M-parameter model, 400
steps of 16 x 128 characters per rank, lr 3e-4 with warm-up and cosine decay) take about two
minutes with 4 ranks sharing 2 cores, and bring the validation loss from ln(97) = 4.6 to about
2.26 nats per character. Rank 0 prints a progress bar, the validation loss every
``--eval-every`` steps and a final summary; ``--json-log`` writes every step, every
evaluation, the configuration and the summary to a JSON file.

This file is the training loop; its pieces live in :mod:`lioncub.recipe` (data, model
presets, options, logs, checkpoints, the DDP mode and the fault-tolerant loop), where
examples and benchmarks import them from. The manual (data, precision, DDP, replica checks,
checkpoints, timing, the JSON log, fault tolerance) is ``docs/train.md``.

Exit status: 0 on success, 1 when a communication or run-time error stopped the run, 2 for bad
options (argparse), 130 on Ctrl-C.
"""

from __future__ import annotations

import os

# The collective kernels run on one thread per rank; several ranks usually share the cores.
# Must be set before bitcoll (numba) is imported.
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

import bitcoll
from bitcoll.errors import BitcollError, CommError
from lioncub.recipe.checkpoints import (
    CHECKPOINT_FORMAT,
    TRAJECTORY_KEYS,
    load_checkpoint,
    save_checkpoint,
)
from lioncub.recipe.data import VOCAB_SIZE, BatchSampler, Corpus, load_corpus
from lioncub.recipe.ddp import DDPOptimizer, init_process_group
from lioncub.recipe.logs import (
    LOG_FORMAT,
    Progress,
    first_at_or_below,
    format_summary,
    summarize,
    write_json,
)
from lioncub.recipe.loop import (
    LossScale,
    check_replicas,
    default_threads,
    digest48,
    evaluate,
    lr_at,
    params_digest,
    replica_error,
    same_on_all_ranks,
    step_figures,
    step_record,
)
from lioncub.recipe.models import (
    DTYPES,
    OPTIMIZER_TAKES_DEVICE_PARAMS,
    CharTransformer,
    HostParams,
    autocast,
    token_loss,
)
from lioncub.recipe.options import build_parser, parse_args
from lioncub.replicas import ReplicaMismatchError
from lioncub.torch import DistributedLion

__all__ = ["build_parser", "parse_args", "run", "main"]

Say = Callable[[str], None]


def run(args: argparse.Namespace, comm: bitcoll.Communicator,
        out: TextIO | None = None) -> dict[str, Any]:
    """Train as configured by ``args`` (see :func:`lioncub.recipe.options.parse_args`) on
    communicator ``comm``.

    Returns the log record (config, run, steps, evals, summary); identical on every rank
    except for progress output, which only rank 0 writes to ``out`` (default stdout). Raises
    ``bitcoll.errors.CommError`` when a collective fails, ``RuntimeError`` when the ranks
    disagree on the corpus or the initial model, or a checkpoint cannot be written, read or
    does not fit the run.
    """
    stream = sys.stdout if out is None else out
    wall0 = time.perf_counter()
    device, dtype = args.device, DTYPES[args.dtype]

    def say(text: str) -> None:
        if comm.rank == 0:
            stream.write(text + "\n")
            stream.flush()

    threads = args.threads or default_threads(comm.local_size)
    torch.set_num_threads(threads)
    corpus, model = build_corpus_and_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    same = same_on_all_ranks(comm, [digest48(corpus.digest.encode()), params_digest(model)])
    if not same[0]:
        raise RuntimeError("the ranks built different corpora (different Python installations?)")
    if not same[1]:
        raise RuntimeError("the ranks initialised different models (different torch builds?)")
    kwargs: dict[str, Any] = {}
    if (args.native and dtype != torch.float32) or args.momentum_dtype != "fp32":
        if not OPTIMIZER_TAKES_DEVICE_PARAMS:
            raise RuntimeError("--native and --momentum-dtype bf16 need a lioncub whose "
                               "DistributedLion takes 16-bit parameters; this one takes "
                               "float32 CPU parameters only (drop them to use autocast)")
        if args.momentum_dtype != "fp32":
            kwargs["momentum_dtype"] = DTYPES[args.momentum_dtype]
    if args.native:
        model.to(device=device, dtype=dtype)
        dtype = torch.float32  # no autocast: the parameters are in --dtype already
    else:
        model.to(device)
    host = HostParams(model) if device != "cpu" and not OPTIMIZER_TAKES_DEVICE_PARAMS else None
    named = host.named() if host is not None else list(model.named_parameters())
    params = [p for _, p in named]

    # --no-comm: each rank its own one-rank communicator (the compute floor). --overlap: the
    # optimizer's collectives start inside backward(), so it gets a communicator of its own
    # (train.py's own all-reduces then never interleave with them). --stale: the exchange
    # runs on while train.py's own all-reduces go on: a communicator of its own as well.
    opt_comm = comm.split(comm.rank) if args.no_comm else \
        comm.split(0) if args.overlap or args.stale else comm
    assert opt_comm is not None
    kwargs.update({k: True for k in ("overlap", "stale") if getattr(args, k)})
    ddp: DDPOptimizer | None = None
    try:
        if args.backend is None:
            opt: Any = DistributedLion(named, opt_comm, variant=args.optimizer, lr=args.lr,
                                       betas=(0.9, 0.99), weight_decay=args.weight_decay,
                                       levels=args.levels, momentum_sync=args.momentum_sync,
                                       agreement=args.agreement, **kwargs)
            net: nn.Module = model
        else:  # DistributedDataParallel around the model, its optimizer or hook
            init_process_group(args.backend, comm, args.no_comm, args.comm_timeout)
            opt = ddp = DDPOptimizer(args, model, named, comm, opt_comm)
            net = ddp.net
        return _train(args, comm, opt_comm, opt, model, net, host, params, corpus, n_params,
                      threads, stream, say, wall0, device, dtype)
    finally:
        if args.backend is not None:
            import torch.distributed as dist

            if ddp is not None:
                ddp.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        if opt_comm is not comm:
            opt_comm.close()


def build_corpus_and_model(args: argparse.Namespace) -> tuple[Corpus, CharTransformer]:
    """The corpus (``--corpus-mb``) and the freshly initialised model (``--seed``, float32 on
    the CPU). ValueError when a split is too short for ``--seq-len``."""
    corpus = load_corpus(args.corpus_mb)
    for name, split in (("training", corpus.train), ("validation", corpus.val)):
        if split.size < args.seq_len + 2:
            raise ValueError(f"the {name} split has {split.size} tokens, fewer than "
                             f"--seq-len + 2; raise --corpus-mb")
    torch.manual_seed(args.seed)
    model = CharTransformer(VOCAB_SIZE, args.d_model, args.layers, args.heads, args.seq_len)
    return corpus, model


def describe(args: argparse.Namespace, size: int, backend: str, threads: int, n_params: int,
             corpus: Corpus, say: Say) -> None:
    """Rank 0's three opening lines: the run, the model and the corpus."""
    ddp = ""
    if args.backend is not None:
        ddp = f", DDP over {args.backend}" + (f" with the {args.hook} hook" if args.hook
                                               else "")
    say(f"train.py: {args.optimizer} on {size} rank{'s' if size > 1 else ''} ({backend}), "
        f"{threads} torch thread{'s' if threads > 1 else ''} per rank{ddp}"
        + (", no communication (--no-comm)" if args.no_comm else "")
        + (", fault-tolerant" if args.fault_tolerant else ""))
    say(f"model: {args.model} preset, {n_params / 1e6:.2f}M parameters (d_model "
        f"{args.d_model}, {args.layers} layers, {args.heads} heads); batch {args.batch_size} x "
        f"{args.seq_len} characters per rank; {args.dtype}"
        f"{' parameters' if args.native else ' autocast' if args.dtype != 'fp32' else ''} on "
        f"{args.device}")
    say(f"corpus: {corpus.train.size / 1e6:.2f} MB training ({corpus.train_files} files), "
        f"{corpus.val.size / 1e6:.2f} MB validation ({corpus.val_files} files) of the Python "
        f"standard library")


def run_info(args: argparse.Namespace, size: int, backend: str, threads: int, n_params: int,
             corpus: Corpus, start_step: int) -> dict[str, Any]:
    """The ``config`` and ``run`` parts of the JSON log."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}
    return {"config": config, "run": {
        "world_size": size, "backend": backend, "threads_per_rank": threads,
        "n_params": n_params, "corpus": corpus.describe(),
        "tokens_per_step": args.batch_size * args.seq_len * size,
        "python": platform.python_version(), "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_at": start_step}}


def _train(args: argparse.Namespace, comm: bitcoll.Communicator,
           opt_comm: bitcoll.Communicator, opt: Any, model: nn.Module, net: nn.Module,
           host: HostParams | None, params: list[torch.Tensor], corpus: Corpus, n_params: int,
           threads: int, stream: TextIO, say: Say, wall0: float, device: str,
           dtype: torch.dtype) -> dict[str, Any]:
    """The training loop of :func:`run` (``net``: the module to train through, ``model`` or
    its DDP wrapper; ``opt``: DistributedLion or a :class:`DDPOptimizer`)."""
    rank, size = comm.rank, comm.size
    sampler = BatchSampler(corpus.train, args.batch_size, args.seq_len, args.seed, rank)
    scaler = LossScale(args.dtype == "fp16")
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    start_step, elapsed0 = 0, 0.0
    if args.resume is not None:
        ckpt = load_checkpoint(args.resume, comm, args)
        model.load_state_dict(ckpt["model"])
        if host is not None:
            host.pull_params()
        opt.load_state_dict(ckpt["optimizer"])
        sampler.set_state(ckpt["sampler"])
        torch.set_rng_state(ckpt["torch_rng"])
        scaler.load_state_dict(ckpt["loss_scale"])
        steps, evals = list(ckpt["steps"]), list(ckpt["evals"])
        start_step, elapsed0 = int(ckpt["step"]), float(ckpt["elapsed"])
    stop = args.steps if args.stop_after is None else args.stop_after
    info = run_info(args, size, comm.backend, threads, n_params, corpus, start_step)
    describe(args, size, comm.backend, threads, n_params, corpus, say)
    if start_step:
        say(f"resumed from {args.resume} at step {start_step}")
    progress = Progress(stop, stream, rank == 0 and not args.no_progress, start=start_step)
    train_start = time.perf_counter() - elapsed0
    target = first_at_or_below(evals, args.target_loss)

    def do_eval(step: int) -> None:
        nonlocal target
        if args.stale:
            opt.flush()  # the update in flight, before the parameters are read
        val_loss = evaluate(model, comm, corpus.val, args.batch_size, args.seq_len,
                            args.eval_batches, device, dtype)
        if not math.isfinite(val_loss):
            raise RuntimeError(f"validation loss is {val_loss} at step {step}")
        step_s = float(sum(s["time"] for s in steps[:step] if not s.get("warmup")))
        rec = {"step": step, "val_loss": val_loss,
               "elapsed": time.perf_counter() - train_start, "step_seconds": step_s}
        evals.append(rec)
        if rank == 0:
            progress.note(f"step {step:>{len(str(args.steps))}}/{args.steps}  "
                          f"val loss {val_loss:.4f}")
        if target is None and first_at_or_below([rec], args.target_loss) is not None:
            target = dict(rec)
            if rank == 0:
                progress.note(f"target val loss {args.target_loss:g} reached at step {step}: "
                              f"{step_s:.1f} s of steps, {rec['elapsed']:.1f} s elapsed")

    def checkpoint(step: int) -> None:
        if args.stale:
            opt.flush()
        save_checkpoint(args.save, comm, {
            "format": CHECKPOINT_FORMAT, "rank": rank, "world_size": size, "step": step,
            "trajectory": {k: getattr(args, k) for k in TRAJECTORY_KEYS},
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state(), "torch_rng": torch.get_rng_state(),
            "loss_scale": scaler.state_dict(), "steps": steps, "evals": evals,
            "elapsed": time.perf_counter() - train_start})
        say(f"checkpoint of step {step} written to {args.save}")

    if start_step == 0:
        do_eval(0)
    for step in range(start_step + 1, stop + 1):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        if step == start_step + 1:
            say("compiling kernels (first step only) ...")
        t0 = time.perf_counter()
        x, y = sampler.next()
        with autocast(device, dtype):
            loss = token_loss(net, x.to(device), y.to(device))
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss * scaler.scale if scaler.enabled else loss)
        loss_value = loss.item()
        if device == "cuda":
            torch.cuda.synchronize()  # the backward pass runs asynchronously
        t1 = time.perf_counter()
        if host is not None:
            host.pull_grads()
        applied = scaler.unscale(params, opt_comm)
        figures: tuple[float, int, int, int, float | None] = (0.0, 0, 0, 0, None)
        if applied:
            opt.step()
            figures = step_figures(opt.last_stats, args.stale or args.backend is not None)
        if host is not None:
            host.push_params()
        if device == "cuda":
            torch.cuda.synchronize()
        rec = step_record(step, lr, loss_value, (t0, t1, time.perf_counter()), figures,
                          warmup=step == start_step + 1, applied=applied, comm=comm)
        steps.append(rec)
        progress.update(step, rec["loss"], rec["time"], rec["compute"], rec["comm"],
                        rec["bytes_sent"])
        if args.check_every and step % args.check_every == 0 and step < stop \
                and not args.no_comm:
            check_replicas(opt.check_replicas, f"after step {step}")  # one verdict everywhere
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            do_eval(step)
        if args.save is not None and (step == stop or (args.save_every
                                                       and step % args.save_every == 0)):
            checkpoint(step)
    train_time = time.perf_counter() - train_start

    mismatch: ReplicaMismatchError | None = None
    identical: bool | None = None
    if not args.no_comm:
        try:
            opt.check_replicas()  # every rank gets the same verdict
        except ReplicaMismatchError as exc:
            mismatch = exc
        identical = mismatch is None
    summary = summarize(args, steps, evals, world_size=size, backend=comm.backend,
                        n_params=n_params, target=target, train_time=train_time,
                        wall_time=time.perf_counter() - wall0, identical=identical)
    record = {"format": LOG_FORMAT, **info, "steps": steps, "evals": evals, "summary": summary}
    if rank == 0:
        stream.write(format_summary(summary) + "\n")
        stream.flush()
        if args.json_log is not None:
            write_json(args.json_log, record)
            say(f"log written to {args.json_log}")
    if mismatch is not None:
        raise replica_error(mismatch, "after training")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    rank: int | str = os.environ.get("RANK", "?")  # until the communicator says
    try:
        if args.fault_tolerant:
            from lioncub.recipe.fault_tolerant import run_fault_tolerant

            run_fault_tolerant(args, build_corpus_and_model, describe, run_info)
            return 0
        with bitcoll.init(timeout=args.comm_timeout) as comm:
            rank = comm.rank
            run(args, comm)
    except KeyboardInterrupt:
        print(f"train.py: rank {rank}: interrupted", file=sys.stderr)
        return 130
    except (BitcollError, CommError, RuntimeError, ValueError, OSError) as exc:
        print(f"train.py: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
