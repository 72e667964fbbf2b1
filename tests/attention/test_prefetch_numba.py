"""The prefetch intrinsic compiles for the array shapes the kernels use and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, prefetch_at


@njit
def _sum_with_prefetch(cache, blocks):
    block_bytes = cache[0].size * cache.itemsize
    total = 0.0
    for i in range(blocks.shape[0]):
        if i + 1 < blocks.shape[0]:
            for offset in range(0, block_bytes, CACHE_LINE_BYTES):
                prefetch_at(cache, blocks[i + 1], offset)
        total += cache[blocks[i]].sum()
    return total


@pytest.mark.parametrize("shape", [(6, 16), (6, 4, 2, 8)])
def test_prefetch_leaves_results_unchanged(shape):
    cache = np.random.default_rng(0).random(shape).astype(np.float32)
    blocks = np.array([5, 0, 3, 3, 1], dtype=np.int32)
    expected = sum(float(cache[b].sum()) for b in blocks)
    assert _sum_with_prefetch(cache, blocks) == pytest.approx(expected, rel=1e-5)


def test_only_arrays_are_accepted():
    @njit
    def bad(x):
        prefetch_at(x, 0, 0)

    with pytest.raises(TypingError):
        bad(1.0)
