"""``train.py``'s command line: :func:`build_parser` (every option, its default and help) and
:func:`parse_args` (the options' cross-checks; exit status 2 with a message on bad options)."""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import lioncub
from bitcoll.errors import UsageError
from lioncub.quantize import check_levels
from lioncub.sync import parse_sync

from .models import DTYPES, OPTIMIZER_TAKES_DEVICE_PARAMS, PRESETS

__all__ = ["build_parser", "parse_args"]

def _int_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return check


_positive_int = _int_from(1)
_nonneg_int = _int_from(0)


def _float_in(low: float, high: float, *, low_open: bool = False) -> Any:
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (value > low if low_open else value >= low) and value <= high
        if not ok or math.isnan(value):
            lo = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {lo}{low:g}, {high:g}], got {text}")
        return value
    return check


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` except for options whose default is None or False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # the launch lines' options (--nproc-per-node) must not be broken at their hyphens
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (``--help`` lists every option with its default)."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Data-parallel training of a character-level transformer on the Python "
                    "standard library's sources with Lion Cub or one of its baselines. Run it "
                    "with `python -m launch -n N train.py`, `mpiexec -n N python train.py` or "
                    "plainly on one rank.",
        epilog="launch lines: `python -m launch -n 4 train.py` (one host); "
               "`torchrun --nproc-per-node 4 train.py` (torchrun's environment); "
               "`torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
               "--rdzv-endpoint HOST:29500 train.py` (two hosts); "
               "`srun -N 4 --ntasks-per-node 1 python train.py` (Slurm); "
               "`mpiexec -n 4 python train.py` (MPI). Add `--backend gloo --hook` for "
               "DistributedDataParallel with the votes inside backward. The first step "
               "compiles bitcoll's and lioncub's kernels (cached for later runs).",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="lioncub-l1", choices=list(lioncub.VARIANTS),
                   metavar="NAME",
                   help="distributed Lion variant, one of: " + ", ".join(lioncub.VARIANTS))
    g.add_argument("--lr", type=_float_in(0.0, 1.0, low_open=True), default=3e-4,
                   help="peak learning rate")
    g.add_argument("--weight-decay", type=_float_in(0.0, 10.0), default=0.0,
                   help="decoupled weight decay (theta *= 1 - lr * wd per step)")
    g.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning-rate schedule after warm-up (cosine decays to lr/10)")
    g.add_argument("--warmup", type=_nonneg_int, default=None,
                   help="linear warm-up steps (default: 5%% of --steps)")
    g.add_argument("--levels", type=_positive_int, default=None,
                   help="quantization levels s of the lioncub-l1/l0/linf votes (in [-s, s]); "
                        "default: the optimizer's own")
    g.add_argument("--momentum-sync", default=None, metavar="SPEC",
                   help="momentum synchronization schedule, passed to the optimizer: none, "
                        "every:K, exp:K[:START], early:S[:EVERY], "
                        "adaptive:T[:MIN_INTERVAL[:WARMUP]], optionally followed by "
                        "@GLOB[,GLOB...] (default: the optimizer's own)")
    g.add_argument("--agreement", action="store_const", const=True, default=None,
                   help="compute and log the vote agreement of the exact-sum variants at "
                        "every step (their collective then returns the exact sums instead of "
                        "only their signs: more bytes); default: only when the momentum sync "
                        "needs it")
    g.add_argument("--overlap", action="store_true",
                   help="start each bucket's votes and collective during the backward pass as "
                        "soon as its gradients are final (lioncub's overlap=True; the "
                        "optimizer gets a communicator of its own); not with --dtype fp16 "
                        "(the gradients are unscaled only after backward)")
    g.add_argument("--stale", action="store_true",
                   help="one-step-stale updates for slow or far links: each step's exchange "
                        "runs during the next step's forward and backward pass, its update is "
                        "applied one step late (lioncub's stale=True; float32 on the CPU, not "
                        "with --overlap or --backend)")
    g = p.add_argument_group("DistributedDataParallel")
    g.add_argument("--backend", choices=("bitcoll", "gloo"), default=None,
                   help="wrap the model in torch's DistributedDataParallel over a process "
                        "group of this torch.distributed backend (default: no DDP, the "
                        "optimizer does all the communication)")
    g.add_argument("--hook", nargs="?", const="lioncub", default=None,
                   choices=("lioncub", "sign"),
                   help="with --backend: vote inside DDP's backward, bucket by bucket: "
                        "'lioncub' (also plain --hook: the --optimizer variant's votes, "
                        "bitwise DistributedLion) or 'sign' (packed majority of gradient signs "
                        "with error feedback, then AdamW)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=_positive_int, default=400, help="training steps")
    g.add_argument("--seed", type=_nonneg_int, default=0,
                   help="model initialisation seed (same on every rank); rank r samples its "
                        "batches with default_rng([seed, r])")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per rank")
    g.add_argument("--seq-len", type=_positive_int, default=128, help="characters per sequence")
    g.add_argument("--eval-every", type=_nonneg_int, default=50,
                   help="validation every N steps (0: only before and after training)")
    g.add_argument("--eval-batches", type=_positive_int, default=4,
                   help="validation batches per rank")
    g.add_argument("--corpus-mb", type=_float_in(0.0, 1000.0, low_open=True), default=2.0,
                   help="corpus size in MB (10**6 bytes), validation included")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per rank (default: usable cores // ranks on this host, "
                        "at least 1)")
    g.add_argument("--comm-timeout", type=_float_in(0.0, 86400.0, low_open=True),
                   default=300.0, help="deadline of every collective, seconds")
    g.add_argument("--no-comm", action="store_true",
                   help="compute floor: every rank trains its own replica on its own batches "
                        "with the optimizer on a one-rank communicator (nothing exchanged; "
                        "replicas diverge and are not checked; the validation loss is the mean "
                        "over the replicas)")
    g.add_argument("--check-every", type=_nonneg_int, default=100, metavar="N",
                   help="compare a digest of the parameters across the ranks every N steps "
                        "(0: only after training); differing replicas stop the run naming "
                        "the rank")
    g.add_argument("--fault-tolerant", action="store_true",
                   help="survive lost ranks and take restarted ones back (lioncub.elastic's "
                        "ElasticLion over bitcoll.elastic's membership epochs; start it with "
                        "`python -m launch -n 4 --max-restarts 2 train.py --fault-tolerant`): "
                        "a step that a failure interrupts is lost on every rank and done "
                        "again, each step's batches are shared out by the epoch's rank and "
                        "size, and every membership change is logged; float32 parameters on "
                        "the CPU, not with --backend, --overlap, --stale, --no-comm, "
                        "--resume or --dtype fp16")
    g.add_argument("--target-loss", type=_float_in(0.0, 100.0, low_open=True), default=None,
                   metavar="X", help="report the step and time at which the validation loss "
                                     "first reaches X (checked at every evaluation)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(PRESETS), default="tiny",
                   help="size preset: " + ", ".join(
                       f"{k} (d_model {v.d_model}, {v.layers} layers, {v.heads} heads, "
                       f"~{v.approx_params})" for k, v in PRESETS.items())
                   + "; --d-model, --layers and --heads override its values")
    g.add_argument("--d-model", type=_positive_int, default=None,
                   help="embedding width (default: the preset's)")
    g.add_argument("--layers", type=_positive_int, default=None,
                   help="transformer blocks (default: the preset's)")
    g.add_argument("--heads", type=_positive_int, default=None,
                   help="attention heads (default: the preset's)")
    g = p.add_argument_group("precision and device")
    g.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="compute dtype: fp32, or bf16/fp16 through torch.autocast (parameters, "
                        "gradients, momenta and the exchanged votes stay float32; fp16 adds "
                        "dynamic loss scaling, overflowing steps are skipped on every rank)")
    g.add_argument("--native", action="store_true",
                   help="keep the parameters themselves in --dtype (no autocast, no float32 "
                        "copy; the optimizer updates 16-bit parameters); needs a lioncub whose "
                        "DistributedLion takes 16-bit and device parameters")
    g.add_argument("--momentum-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the optimizer's momentum buffers (bf16 halves the optimizer "
                        "state; same lioncub requirement as --native)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs; the optimizer takes the device's parameters "
                        "when lioncub supports it, else it works on a float32 host copy "
                        "(gradients copied to the host, parameters back, every step)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", type=Path, default=None, metavar="DIR",
                   help="write a checkpoint to DIR (one rank<r>.pt per rank) at the end of the "
                        "run (and every --save-every steps)")
    g.add_argument("--save-every", type=_nonneg_int, default=0, metavar="N",
                   help="also checkpoint every N steps (0: only at the end)")
    g.add_argument("--stop-after", type=_positive_int, default=None, metavar="STEP",
                   help="stop after STEP of the --steps schedule (with --save: to continue "
                        "later with --resume)")
    g.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue the run checkpointed in DIR (same ranks and training "
                        "options): model, optimizer state, random generators, data position, "
                        "step and log are restored, so the continued run equals an "
                        "uninterrupted one bit for bit")
    g = p.add_argument_group("output")
    g.add_argument("--json-log", type=Path, default=None, metavar="PATH",
                   help="write the per-step / per-eval log, config and summary here (rank 0)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar or periodic step lines (evaluations and the summary "
                        "are still printed)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the options; exits with status 2 and a message on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.model]
    for name in ("d_model", "layers", "heads"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
        parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__} {why}); "
                     "use --device cpu")
    if args.stop_after is not None and args.stop_after > args.steps:
        parser.error(f"--stop-after {args.stop_after} must not exceed --steps {args.steps}")
    if args.save_every and args.save is None:
        parser.error("--save-every needs --save DIR")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if (args.d_model // args.heads) % 2:
        parser.error(f"--d-model / --heads = {args.d_model // args.heads} must be even")
    try:
        if args.momentum_sync is not None:
            parse_sync(args.momentum_sync)
        if args.levels is not None:
            check_levels(args.levels)
    except UsageError as exc:
        parser.error(str(exc))
    if args.overlap and args.dtype == "fp16":
        parser.error("--overlap cannot be used with --dtype fp16: loss scaling unscales the "
                     "gradients after backward, when overlapped buckets have already started")
    if args.overlap and args.device == "cuda" and not OPTIMIZER_TAKES_DEVICE_PARAMS:
        parser.error("--overlap with --device cuda needs a lioncub whose DistributedLion "
                     "takes device parameters")
    if args.stale:
        for flag, bad in (("--overlap", args.overlap), ("--backend", args.backend is not None),
                          ("--device cuda", args.device != "cpu"),
                          ("--dtype other than fp32", args.dtype != "fp32"),
                          ("--momentum-dtype bf16", args.momentum_dtype != "fp32"),
                          ("--native", args.native)):
            if bad:
                parser.error(f"--stale cannot be used with {flag} (lioncub's stale mode "
                             "runs on its numpy core: float32 parameters on the CPU)")
    if args.fault_tolerant:
        for flag, bad in (("--backend", args.backend is not None), ("--overlap", args.overlap),
                          ("--stale", args.stale), ("--no-comm", args.no_comm),
                          ("--resume", args.resume is not None),
                          ("--dtype fp16", args.dtype == "fp16"), ("--native", args.native),
                          ("--momentum-dtype bf16", args.momentum_dtype != "fp32"),
                          ("--device cuda", args.device != "cpu")):
            if bad:
                parser.error(f"--fault-tolerant cannot be used with {flag} (the elastic "
                             "optimizer updates float32 parameters on the CPU, and every "
                             "collective of the run must be one it can recover from)")
    if args.hook is not None and args.backend is None:
        parser.error("--hook needs --backend bitcoll or gloo (DistributedDataParallel)")
    if args.backend is not None:
        for flag, bad in (("--overlap", args.overlap), ("--native", args.native),
                          ("--momentum-dtype bf16", args.momentum_dtype != "fp32"),
                          ("--device cuda", args.device != "cpu"),
                          ("--dtype fp16", args.dtype == "fp16")):
            if bad:
                parser.error(f"{flag} cannot be used with --backend (DDP mode takes fp32 or "
                             "bf16 autocast on the CPU)")
    if args.warmup is None:
        args.warmup = args.steps // 20
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    return args
