"""The code shown in README.md and docs/ works: every fenced python block marked
``<!-- test: launch N -->`` (or ``mpiexec N``, ``python``) on the line before it runs as a
program on N ranks with a hard timeout, and every other python block (a fragment that needs a
model or data of the reader's) at least compiles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from docs_runner import ROOT, Snippet, mpiexec, run, snippets

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
ALL = [s for page in PAGES for s in snippets(page)]
RUNNABLE = [s for s in ALL if s.how != "fragment"]


def test_the_front_page_examples_run() -> None:
    """README's bitcoll and lioncub examples are among the programs that run."""
    readme = [s for s in RUNNABLE if s.path.name == "README.md"]
    assert len(readme) >= 2, [s.name for s in readme]


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_compiles(snippet: Snippet) -> None:
    compile(snippet.code, snippet.name, "exec")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.name for s in RUNNABLE])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    if "torch" in snippet.code and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    if snippet.how == "mpiexec" and (mpiexec() is None
                                     or importlib.util.find_spec("mpi4py") is None):
        pytest.skip("no MPI here")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    run(snippet.how, snippet.ranks, script)
