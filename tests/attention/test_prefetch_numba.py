"""The prefetch intrinsics compile for the array shapes the kernels use, change nothing, and
ask for the level each names."""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, prefetch_at, prefetch_to_l2_at


def _summing_with(prefetch):
    """A jitted sum of the blocks that prefetches (`prefetch`) each block while the one before
    it is summed."""
    @njit
    def summed(cache, blocks):
        block_bytes = cache[0].size * cache.itemsize
        total = 0.0
        for i in range(blocks.shape[0]):
            if i + 1 < blocks.shape[0]:
                for offset in range(0, block_bytes, CACHE_LINE_BYTES):
                    prefetch(cache, blocks[i + 1], offset)
            total += cache[blocks[i]].sum()
        return total
    return summed


_sum_with_prefetch = _summing_with(prefetch_at)
_sum_with_l2_prefetch = _summing_with(prefetch_to_l2_at)


@pytest.mark.parametrize("shape", [(6, 16), (6, 4, 2, 8)])
def test_prefetch_leaves_results_unchanged(shape):
    cache = np.random.default_rng(0).random(shape).astype(np.float32)
    blocks = np.array([5, 0, 3, 3, 1], dtype=np.int32)
    expected = sum(float(cache[b].sum()) for b in blocks)
    assert _sum_with_prefetch(cache, blocks) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("summed", [_sum_with_prefetch, _sum_with_l2_prefetch])
def test_each_level_leaves_results_unchanged(summed):
    cache = np.random.default_rng(1).random((6, 4, 2, 8)).astype(np.float32)
    blocks = np.array([2, 5, 0], dtype=np.int32)
    assert summed(cache, blocks) == pytest.approx(sum(float(cache[b].sum()) for b in blocks),
                                                  rel=1e-5)
    # LLVM's locality argument: 3 keeps the line in every level, 2 stops at L2.
    locality = 3 if summed is _sum_with_prefetch else 2
    ir = next(iter(summed.inspect_llvm().values()))
    calls = re.findall(r"call void @llvm\.prefetch\.p0\(ptr [^,]+, i32 0, i32 (\d), i32 1\)", ir)
    assert calls and set(calls) == {str(locality)}


def test_only_arrays_are_accepted():
    @njit
    def bad(x):
        prefetch_at(x, 0, 0)

    with pytest.raises(TypingError):
        bad(1.0)
