#!/usr/bin/env python3
"""Set-up and run commands for bitcoll / lioncub.

    python3 dev.py train [train.py options]   # the main job: a 4-rank Lion Cub training run
    python3 dev.py test                        # the whole suite: lint, types, docs, tests, MPI
    python3 dev.py docs                        # build the documentation site into site/ (strict)
    python3 dev.py bench [bench/gate.py options] # the performance regression gate
    python3 dev.py setup                       # only create or update .venv, run nothing

Each command creates (or reuses) the virtual environment ``.venv`` next to this file and
installs the project with everything it needs (``pip install -e
.[EXTRAS]`` under ``constraints.txt``, with EXTRAS as in :data:`EXTRAS`: ``bench`` is
matplotlib, for the loss-curve plots of ``bench/``; ``integrity`` is blake3, for
``bitcoll.init(integrity=True)``; ``docs`` is mkdocs-material and mkdocstrings; ``examples``
is JAX on the CPU, for ``examples/``), again whenever ``pyproject.toml`` or ``constraints.txt``
changed. Only Python 3.10+ with venv and pip is assumed.

The training job runs under the project's own launcher; the same ``train.py`` runs under
``torchrun --nproc-per-node 4 train.py``, ``mpiexec -n 4 python train.py`` and Slurm's
``srun -n 4 python train.py`` (see ``docs/launchers.md``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
MPIEXEC = VENV / "bin" / "mpiexec"
STAMP = VENV / ".bitcoll-install-stamp"
MPI_WORLD_SIZES = (2, 3, 4)
EXTRAS = "mpi,torch,test,bench,integrity,docs,examples"


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"command timed out after {timeout} s", flush=True)
        return 124


def _run_captured(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """:func:`_run` with the command's output (stdout and stderr) returned, not printed."""
    text = "+ " + " ".join(str(c) for c in cmd) + "\n"
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else \
            (exc.stdout or "")
        return 124, text + out + f"command timed out after {timeout} s\n"
    return done.returncode, text + done.stdout


def ensure_venv() -> None:
    """Create .venv if needed and (re)install the project when its requirements changed."""
    if not PY.exists():
        print("dev.py: creating the virtual environment .venv", flush=True)
        if _run([sys.executable, "-m", "venv", str(VENV)]) != 0:
            sys.exit("could not create the virtual environment .venv")
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    want = digest.hexdigest()
    if STAMP.exists() and STAMP.read_text().strip() == want:
        return
    print("dev.py: installing the project and its dependencies into .venv (a minute or two on a "
          "fresh machine; pip lists each package as it goes)", flush=True)
    rc = _run([str(PY), "-m", "pip", "install", "--disable-pip-version-check",
               "--progress-bar", "off", "-c", "constraints.txt", "-e", f".[{EXTRAS}]"])
    if rc != 0:
        sys.exit("installation failed")
    STAMP.write_text(want + "\n")
    print("dev.py: .venv is ready", flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("NUMBA_NUM_THREADS", "1")  # more ranks than cores
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material's banner about its successor
    return env


def _docs_cmd() -> list[str]:
    """Build the site into site/; strict: a broken link, anchor or reference fails."""
    return [str(PY), "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", "site"]


def cmd_test() -> int:
    """The whole suite. The static steps (ruff, mypy twice, the docs build) read the sources
    only: they run one after another on a background thread beside the single-process pytest
    run (which leaves much of the second core idle: its ranks start, wait and time out), and
    their output is printed once that pytest run is over. The MPI runs come last, with
    nothing beside them (more ranks than cores)."""
    env = _env()
    static: list[tuple[str, list[str], float]] = [
        ("ruff", [str(PY), "-m", "ruff", "check", "bitcoll", "lioncub", "launch", "bench",
                  "tests", "examples", "docs/hooks.py", "train.py", "dev.py"], 300),
        # the files mypy checks (bench/ included) are pyproject.toml's [tool.mypy] files
        ("mypy", [str(PY), "-m", "mypy"], 900),
        # the library on the oldest Python it supports (pyproject: requires-python >= 3.10)
        ("mypy (Python 3.10)", [str(PY), "-m", "mypy", "--python-version", "3.10", "-p",
                                "bitcoll", "-p", "lioncub", "-p", "launch"], 900),
        ("docs (mkdocs build --strict)", _docs_cmd(), 600),
    ]
    steps: list[tuple[str, list[str], float]] = [
        ("pytest (single-process and TCP multi-process)",
         [str(PY), "-m", "pytest", "-q", "--color=no", "-m", "not mpi", "tests"], 2400),
    ]
    for n in MPI_WORLD_SIZES:
        steps.append((f"pytest-mpi, {n} ranks",
                      [str(MPIEXEC), "-n", str(n), str(PY), "-m", "pytest", "--with-mpi", "-q",
                       "--color=no", "-m", "mpi", "tests"], 900))
    failed: dict[str, bool] = {}
    static_done: list[tuple[str, int, str]] = []

    def run_static() -> None:
        for name, cmd, timeout in static:
            rc, out = _run_captured(cmd, env, timeout)
            static_done.append((name, rc, out))

    names = ", ".join(name for name, _, _ in static)
    print(f"\n=== {names}: in the background (their output follows the pytest run)",
          flush=True)
    background = threading.Thread(target=run_static, name="static steps")
    background.start()
    try:
        for i, (name, cmd, timeout) in enumerate(steps):
            print(f"\n=== {name}", flush=True)
            rc = _run(cmd, env=env, timeout=timeout)
            if rc != 0:
                print(f"=== {name}: FAILED (exit {rc})", flush=True)
            failed[name] = rc != 0
            if i == 0:  # the single-process pytest run: the static steps' output
                background.join()
                for s_name, s_rc, s_out in static_done:
                    print(f"\n=== {s_name}\n{s_out}", end="", flush=True)
                    if s_rc != 0:
                        print(f"=== {s_name}: FAILED (exit {s_rc})", flush=True)
                    failed[s_name] = s_rc != 0
    finally:
        background.join()
    order = [name for name, _, _ in static] + [name for name, _, _ in steps]
    bad = [name for name in order if failed.get(name, True)]
    verdict = "all steps passed" if not bad else "FAILED: " + ", ".join(bad)
    print("\n=== summary: " + verdict)
    return 1 if bad else 0


def cmd_docs() -> int:
    rc = _run(_docs_cmd(), env=_env(), timeout=600)
    if rc == 0:
        print(f"dev.py: documentation built into {ROOT / 'site'} (open site/index.html)")
    return rc


def cmd_bench(args: list[str]) -> int:
    """The regression gate (bench/gate.py): the headline ratios against the stored ones."""
    return _run([str(PY), "bench/gate.py", *args], env=_env())


def cmd_train(args: list[str]) -> int:
    env = _env()
    return _run([str(PY), "-m", "launch", "-n", "4", "train.py", *args], env=env)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("test", "train", "docs", "bench", "setup"):
        print(__doc__)
        return 2
    ensure_venv()
    if sys.argv[1] == "test":
        return cmd_test()
    if sys.argv[1] == "train":
        return cmd_train(sys.argv[2:])
    if sys.argv[1] == "bench":
        return cmd_bench(sys.argv[2:])
    if sys.argv[1] == "docs":
        return cmd_docs()
    return 0  # setup: the environment is ready


if __name__ == "__main__":
    sys.exit(main())
