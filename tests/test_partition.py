import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bitcoll
from bitcoll.partition import block_bounds


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_partition_matches_array_split(n: int, p: int) -> None:
    parts = bitcoll.partition(n, p)
    ref = np.array_split(np.arange(n), p)
    assert [(int(a[0]), int(a[-1]) + 1) if a.size else None for a in ref] == [
        (a, b) if b > a else None for a, b in parts]
    assert [b - a for a, b in parts] == [a.size for a in ref]
    assert [bitcoll.block(n, p, r) for r in range(p)] == parts
    assert list(block_bounds(n, p)) == [a for a, _ in parts] + [n]


def test_partition_examples() -> None:
    assert bitcoll.partition(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert bitcoll.partition(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert bitcoll.partition(0, 3) == [(0, 0)] * 3


@pytest.mark.parametrize("n,p", [(-1, 2), (3, 0)])
def test_partition_rejects_bad_arguments(n: int, p: int) -> None:
    with pytest.raises(bitcoll.UsageError):
        bitcoll.partition(n, p)
