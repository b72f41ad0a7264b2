"""What ``train.py`` shows and writes: rank 0's progress display, the summary, the JSON log.

JSON log (:data:`LOG_FORMAT`)::

    {"format": "lioncub-train-log/1", "config": {...}, "run": {...}, "steps": [...],
     "evals": [...], "summary": {...}}

``steps[i]`` has ``step`` (1-based), ``lr``, ``loss`` (training loss averaged over ranks),
``time``, ``compute``, ``comm`` (seconds) and ``bytes_sent``, ``bytes_received`` (per rank,
averaged over ranks), ``forward_backward`` and ``optimizer`` (seconds, the parts of
``compute``), ``warmup`` (true on a session's first step), ``skipped`` (true when fp16
overflowed), ``synced_tensors`` (how many tensors had their momentum averaged after the step)
and, for the variants whose collective returns exact vote sums, ``agreement`` (the mean over
tensors of the optimizer's vote-agreement figure, in [0, 1]); in a fault-tolerant run also
``world_size`` (the ranks of the step's epoch) and ``epoch`` (the membership epoch after
the step). ``evals[i]`` has ``step`` (0 = before
training), ``val_loss``, ``elapsed`` (seconds since the start of training) and
``step_seconds`` (sum of the step times so far, warm-up steps left out).
``summary["target_reached"]`` is the first evaluation at or below ``--target-loss`` (None
when not reached or not asked for); a fault-tolerant run's summary adds ``membership`` (one
record per membership change: epoch, step, world size, ranks that left and joined) and
``lost_steps``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from bitcoll.transport.base import format_bytes

__all__ = ["LOG_FORMAT", "fmt_duration", "Progress", "format_summary", "write_json",
           "first_at_or_below", "summarize"]

LOG_FORMAT = "lioncub-train-log/1"


def fmt_duration(seconds: float) -> str:
    """``"12.3s"`` below a minute, ``"4m05s"`` from a minute on."""
    s = round(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


class Progress:
    """Rank 0's progress display on ``stream``.

    On a terminal one line is redrawn with carriage returns (at most 10 times a second); on
    anything else a plain line is printed every ``max(1, total // 20)`` steps and at the end.
    ``note()`` prints a message on its own line without breaking the bar.
    """

    def __init__(self, total: int, stream: TextIO, enabled: bool, start: int = 0) -> None:
        self.total = total
        self.start = start
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = max(1, total // 20)
        self._last_draw = 0.0
        self._width = 0
        self._start = time.perf_counter()
        self._first_done: float | None = None

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0

    def update(self, step: int, loss: float, step_time: float, compute: float, comm: float,
               sent: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self._start
        # The first step includes one-time set-up (kernel compilation, buffers): the ETA uses
        # the pace of the later steps.
        if step == self.start + 1 or self._first_done is None:
            self._first_done = now
            eta = step_time * (self.total - step)
        else:
            eta = (now - self._first_done) / (step - self.start - 1) * (self.total - step)
        if self.tty:
            if now - self._last_draw < 0.1 and step < self.total:
                return
            self._last_draw = now
            width = 20
            filled = int(width * step / self.total)
            bar = "#" * filled + "." * (width - filled)
            line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] "
                    f"loss {loss:.4f}  {step_time * 1e3:.0f} ms/step "
                    f"(comm {comm * 1e3:.0f} ms, sent {format_bytes(sent)})  "
                    f"ETA {fmt_duration(eta)}")
            line = line[:max(20, shutil.get_terminal_size().columns - 1)]
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
            if step == self.total:
                self.stream.write("\n")
                self._width = 0
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(
                f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
                f"step {step_time * 1e3:.0f} ms (compute {compute * 1e3:.0f} ms, "
                f"comm {comm * 1e3:.0f} ms)  sent {format_bytes(sent)}/step  "
                f"elapsed {fmt_duration(elapsed)}  ETA {fmt_duration(eta)}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()


def format_summary(summary: dict[str, Any]) -> str:
    """The final summary as a two-column text table."""
    step_t = summary["mean_step_time"]
    fb_t = summary["mean_forward_backward_time"]
    opt_t = summary["mean_optimizer_time"]
    comm_t = summary["mean_comm_time"]
    identical = summary["replicas_identical"]
    target = summary["target_reached"]

    def share(t: float) -> str:
        return f"{100 * t / step_t:.0f}%" if step_t > 0 else "-"

    rows = [
        ("optimizer", summary["optimizer"] + (" (--no-comm)" if summary["no_comm"] else "")),
        ("world size", f"{summary['world_size']} ({summary['backend']})"),
        ("model", f"{summary['model']}, {summary['n_params'] / 1e6:.2f}M parameters, "
                  f"{summary['dtype']}{' ' + summary['precision'] if summary['precision'] else ''} "
                  f"on {summary['device']}"),
        ("steps", str(summary["steps"]) if summary["steps_done"] == summary["steps"]
         else f"{summary['steps_done']} of {summary['steps']}"),
        ("final train loss", f"{summary['final_train_loss']:.4f} "
                             f"(mean of last {summary['final_train_window']} steps)"),
        ("final val loss", f"{summary['final_val_loss']:.4f}"),
        ("mean step time", f"{step_t * 1e3:.1f} ms"),
        ("  forward + backward", f"{fb_t * 1e3:.1f} ms ({share(fb_t)})"),
        ("  optimizer", f"{opt_t * 1e3:.1f} ms ({share(opt_t)})"),
        ("  communication", f"{comm_t * 1e3:.1f} ms ({share(comm_t)})"),
        ("first step (warm-up)", f"{summary['first_step_time'] * 1e3:.0f} ms (comm "
                                 f"{summary['first_step_comm'] * 1e3:.0f} ms), not in the means"),
        ("bytes sent / step", f"{format_bytes(summary['bytes_sent_per_step'])} per rank"),
        ("bytes received / step", f"{format_bytes(summary['bytes_received_per_step'])} per rank"),
        ("replicas identical", "not checked (--no-comm)" if identical is None
         else "yes" if identical else "NO"),
        ("total wall time", fmt_duration(summary["wall_time"])),
    ]
    if summary["target_loss"] is not None:
        rows.insert(6, (f"val loss <= {summary['target_loss']:g}",
                        "not reached" if target is None else
                        f"step {target['step']}, {target['step_seconds']:.1f} s of steps "
                        f"({target['elapsed']:.1f} s elapsed)"))
    if summary["skipped_steps"]:
        rows.insert(3, ("skipped (fp16 overflow)", str(summary["skipped_steps"])))
    if "membership" in summary:  # a fault-tolerant run
        changes = summary["membership"]
        left = sum(len(m["left"]) for m in changes)
        joined = sum(len(m["joined"]) for m in changes)
        rows.insert(2, ("membership changes", f"{len(changes)} ({left} left, {joined} joined, "
                                              f"started with {summary['initial_world_size']}); "
                                              f"{summary['lost_steps']} steps lost"))
    w = max(len(k) for k, _ in rows)
    v = max(len(str(val)) for _, val in rows)
    rule = "+" + "-" * (w + 2) + "+" + "-" * (v + 2) + "+"
    lines = [rule] + [f"| {k:<{w}} | {val:<{v}} |" for k, val in rows] + [rule]
    return "\n".join(lines)


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as indented JSON to ``path`` atomically (through a temporary file),
    creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def first_at_or_below(evals: Sequence[dict[str, Any]], target: float | None
                      ) -> dict[str, Any] | None:
    """The first evaluation whose ``val_loss`` is <= ``target`` (its ``step``, ``val_loss``,
    ``elapsed`` and ``step_seconds``), None when there is none or ``target`` is None."""
    if target is None:
        return None
    return next(({"step": e["step"], "val_loss": e["val_loss"], "elapsed": e["elapsed"],
                  "step_seconds": e.get("step_seconds", 0.0)}
                 for e in evals if e["val_loss"] <= target), None)


def summarize(args: Any, steps: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], *,
              world_size: int, backend: str, n_params: int, target: dict[str, Any] | None,
              train_time: float, wall_time: float, identical: bool | None) -> dict[str, Any]:
    """The run's summary (the ``summary`` of the JSON log, shown by :func:`format_summary`)
    from ``train.py``'s options ``args`` and the step and evaluation records. The mean step
    figures leave out the first three steps of every session (the first one is the warm-up:
    kernel compilation, buffers; reported on its own); the final training loss is the mean
    over the last ``max(1, min(20, steps // 10))`` steps."""
    sessions = [i for i, s in enumerate(steps) if s.get("warmup")]
    excluded = {i + k for i in sessions for k in range(3)}
    timed = [s for i, s in enumerate(steps) if i not in excluded] or list(steps[-1:])
    first = steps[sessions[-1]] if sessions else steps[0]
    window = max(1, min(20, len(steps) // 10))

    def mean_of(key: str) -> float:
        return float(np.mean([s[key] for s in timed]))

    return {
        "optimizer": args.optimizer, "world_size": world_size, "backend": backend,
        "model": args.model, "n_params": n_params, "dtype": args.dtype, "device": args.device,
        "precision": ("native parameters" if args.native else "autocast")
        if args.dtype != "fp32" else "", "momentum_dtype": args.momentum_dtype,
        "no_comm": args.no_comm,
        "steps": args.steps, "steps_done": len(steps),
        "final_train_loss": float(np.mean([s["loss"] for s in steps[-window:]])),
        "final_train_window": window,
        "final_val_loss": evals[-1]["val_loss"],
        "best_val_loss": min(e["val_loss"] for e in evals),
        "mean_step_time": mean_of("time"),
        "mean_forward_backward_time": mean_of("forward_backward"),
        "mean_optimizer_time": mean_of("optimizer"),
        "mean_compute_time": mean_of("compute"),
        "mean_comm_time": mean_of("comm"),
        "timed_steps_skipped": len(steps) - len(timed),
        "first_step_time": first["time"], "first_step_comm": first["comm"],
        "skipped_steps": sum(1 for s in steps if s.get("skipped")),
        "bytes_sent_per_step": float(np.mean([s["bytes_sent"] for s in steps])),
        "bytes_received_per_step": float(np.mean([s["bytes_received"] for s in steps])),
        "target_loss": args.target_loss, "target_reached": target,
        "train_time": train_time,
        "wall_time": wall_time,
        "replicas_identical": identical,
    }
