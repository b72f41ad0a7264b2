"""The programs in examples/ run as a user runs them, on 2-3 ranks, under the project's
launcher and under mpiexec, each with a hard timeout (see ``docs_runner``)."""

from __future__ import annotations

import importlib.util

import pytest
from docs_runner import ROOT, mpiexec, run

EXAMPLES = ROOT / "examples"

CASES = [
    # (script, launcher, ranks, what rank 0 prints at the end)
    ("numpy_logistic.py", "launch", 3, "3 ranks: loss 0.693 -> averaged gradients"),
    ("numpy_logistic.py", "mpiexec", 2, "2 ranks: loss 0.693 -> averaged gradients"),
    ("jax_training.py", "launch", 2, "2 ranks: loss"),
    ("torch_ddp.py", "launch", 2, "rank 1: loss"),
    ("char_transformer.py", "launch", 2, "2 ranks: validation loss 4.5"),
    ("mpi4py_embedding.py", "mpiexec", 3, "3 ranks in 2 groups: bitcoll's sums match"),
]

NEEDS = {"jax_training.py": "jax", "torch_ddp.py": "torch", "char_transformer.py": "torch",
         "mpi4py_embedding.py": "mpi4py"}


#: Examples run by a test of their own (a fault injected, several launches).
ELSEWHERE = {"elastic_numpy.py": "tests/test_elastic_example.py"}


def test_every_example_is_run() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == {c[0] for c in CASES} | set(ELSEWHERE)
    assert all((ROOT / test).is_file() for test in ELSEWHERE.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("script", "launcher", "ranks", "expect"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_example(script: str, launcher: str, ranks: int, expect: str) -> None:
    module = NEEDS.get(script)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    if launcher == "mpiexec" and (mpiexec() is None
                                  or importlib.util.find_spec("mpi4py") is None):
        pytest.skip("no MPI here")
    proc = run(launcher, ranks, EXAMPLES / script)
    assert expect in proc.stdout, proc.stdout
