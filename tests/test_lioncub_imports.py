"""lioncub's module graph: no import circle, no private access across modules, and every
module importable on its own in a fresh interpreter.

The graph counts every import of a lioncub module anywhere in a module (top level, inside
functions, under ``if TYPE_CHECKING:``): a circle closed only for the type checker still
couples the modules, which is what the strategies' narrow views
(:mod:`lioncub.step_view`) removed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lioncub"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from ... import`` refers to inside ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """lioncub module -> the lioncub modules it imports (anywhere in its source).

    ``from .x import y`` counts as importing ``x`` (or ``x.y`` when that is a module);
    the package ``lioncub`` itself counts only where it is named (``import lioncub``,
    ``from lioncub import y`` with ``y`` not a module): a relative import runs the
    package's ``__init__`` before the submodule too, but that holds for every import of a
    submodule from outside and is no arrow of the module's own."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, True) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                targets = [(f"{base}.{a.name}", node.level == 0) for a in node.names]
            else:
                continue
            for t, named in targets:
                while t and t not in modules:  # the longest lioncub module it names
                    t = t.rpartition(".")[0]
                if not t or t == name or (t == "lioncub" and not named):
                    continue
                graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the
    end), or None."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = grey
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == grey:
                return [*stack[stack.index(n):], n]
            if color[n] == white:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = black
        return None

    for m in sorted(graph):
        if color[m] == white:
            found = visit(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_circles() -> None:
    """The checker itself: a circle through a type-only import is found, a tree is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .distributed import DistributedLion\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level)
    assert _resolve("lioncub.strategies", False, node) == "lioncub.distributed"


def test_lioncub_has_no_import_circle() -> None:
    graph = import_graph()
    # the graph is the real one: the known arrows are in it
    assert "lioncub.step_view" in graph["lioncub.strategies"]
    assert "lioncub.strategies" in graph["lioncub.variants"]
    assert "lioncub.torch_strategies" in graph["lioncub.torch_engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_strategies_depend_on_the_views_not_on_the_cores() -> None:
    graph = import_graph()
    assert "lioncub.distributed" not in graph["lioncub.strategies"]
    assert "lioncub.variants" not in graph["lioncub.strategies"]
    assert "lioncub.torch_engine" not in graph["lioncub.torch_strategies"]
    # the views are a leaf: they import no other lioncub module (the package aside)
    assert graph["lioncub.step_view"] <= {"lioncub.buckets", "lioncub.comm", "lioncub.lion"}


def test_no_private_member_access_in_lioncub() -> None:
    """ruff's SLF001 (private member accessed) holds on lioncub/ (pyproject.toml selects it
    there); checked here too so that the rule cannot be dropped silently."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    done = subprocess.run([str(ruff), "check", "--no-cache", "--select", "SLF001",
                           "--output-format", "concise", str(PACKAGE)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    """``import lioncub.<m>`` as the first import of a new interpreter (all at once). Any
    import of a submodule runs the package's ``__init__`` first, so the modules that
    ``__init__`` reaches are covered by ``import lioncub`` alone; every other module (the
    torch ones where torch is installed, the elastic front end; subpackages aside) gets its
    own interpreter."""
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    graph = import_graph()
    reached = {"lioncub"}
    todo = ["lioncub"]
    while todo:
        for n in graph[todo.pop()] - reached:
            reached.add(n)
            todo.append(n)
    assert {"lioncub.distributed", "lioncub.strategies", "lioncub.step_view"} <= reached
    names = ["lioncub", *(m for m in sorted(graph) if m not in reached
                          and m.count(".") == 1 and (have_torch or ".torch" not in m))]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "1"}
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for m in names}
    failed = {}
    for m, p in procs.items():
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        if p.returncode != 0:
            failed[m] = out[-2000:]
    assert not failed, failed
