"""Run the examples and the documentation's code the way a user does: as programs under
``python -m launch -n N`` or ``mpiexec -n N``, each with a hard timeout.

Used by ``test_examples.py`` and ``test_docs_snippets.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 180.0
"""Seconds one program may run (all its ranks) before it is killed and the test fails."""


def mpiexec() -> str | None:
    """The MPI launcher beside this interpreter (the venv's MPICH), else one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def command(launcher: str, ranks: int, script: Path) -> list[str]:
    if launcher == "launch":
        return [sys.executable, "-m", "launch", "-n", str(ranks), str(script)]
    if launcher == "mpiexec":
        exe = mpiexec()
        assert exe is not None, "no mpiexec"
        return [exe, "-n", str(ranks), sys.executable, str(script)]
    if launcher == "python":
        return [sys.executable, str(script)]
    raise ValueError(f"unknown launcher {launcher!r}")


def run(launcher: str, ranks: int, script: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``ranks`` ranks from the repository root; the result's output is
    stdout and stderr together. Raises AssertionError (with the output) unless it exits 0."""
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(command(launcher, ranks, script), cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} under {launcher} -n {ranks} did not finish within "
                             f"{RUN_TIMEOUT:.0f} s; output so far:\n{exc.output}") from None
    assert proc.returncode == 0, \
        f"{script} under {launcher} -n {ranks} exited {proc.returncode}:\n{proc.stdout}"
    return proc


MARK = re.compile(r"<!--\s*test:\s*(?P<how>fragment|launch|mpiexec|python)\s*(?P<n>\d+)?\s*-->")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True)
class Snippet:
    """A fenced ``python`` block of a markdown file, with the ``<!-- test: ... -->`` mark on
    the line before it (``how`` is "fragment" when unmarked: compiled, not run)."""

    path: Path
    line: int
    code: str
    how: str
    ranks: int

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$')


def _included(line: str) -> str:
    """A ``--8<-- "path"`` line (pymdownx.snippets, paths from the repository root) is the
    text of that file, as on the site."""
    m = INCLUDE.match(line.strip())
    return line if m is None else (ROOT / m.group("path")).read_text(encoding="utf-8")


def snippets(path: Path) -> list[Snippet]:
    """Every fenced python block of ``path``. An unclosed fence is an AssertionError."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{path}:{start + 1}: unclosed code fence"
        if m.group("lang") == "python":
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.search(before)
            how = mark.group("how") if mark else "fragment"
            ranks = int(mark.group("n") or 1) if mark else 1
            code = "\n".join(_included(line) for line in lines[start + 1:j]) + "\n"
            found.append(Snippet(path, start + 2, code, how, ranks))
        i = j + 1
    return found
