"""decode_vector_ir's block loops against numpy on one cache block: every count of query heads
up to two register blocks, head sizes of one to several vector blocks, the three cache element
types, partial blocks, and scores / probabilities at an offset of a wider table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from mrv2 import cpu_caps
from mrv2.attention.decode_vector_ir import (HEADS, block_scores, block_values, takes_head_dim,
                                            vector_width)
from mrv2.attention.kv_numba import numpy_view


@njit
def _scores(qs, kb, kv, count, scores, t):
    block_scores(qs, kb, kv, count, scores, t)


@njit
def _values(probs, t, vb, kv, count, acc):
    block_values(probs, t, vb, kv, count, acc)


def _block(dtype: torch.dtype, head_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A [16, 3 kv heads, head_dim] cache block as the kernels see it, and its float64 values."""
    block = torch.randn(16, 3, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return numpy_view(block), block.double().numpy()


HEAD_DIMS = [vector_width(), 4 * vector_width(), 5 * vector_width(), 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_scores_of_every_head_count(dtype, head_dim):
    kb, exact = _block(dtype, head_dim, seed=head_dim)
    rng = np.random.default_rng(head_dim)
    for heads in range(1, 2 * HEADS + 2):
        for kv, count, t in ((0, 16, 0), (2, 7, 5), (1, 1, 30)):
            qs = rng.standard_normal((heads, head_dim)).astype(np.float32)
            scores = np.full((heads, 48), np.nan, np.float32)
            _scores(qs, kb, kv, count, scores, t)
            want = qs.astype(np.float64) @ exact[:count, kv].T
            np.testing.assert_allclose(scores[:, t:t + count], want, rtol=1e-5, atol=1e-5)
            # Nothing outside [t, t + count) is written.
            assert np.isnan(np.delete(scores, np.s_[t:t + count], axis=1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_values_accumulate_for_every_head_count(dtype, head_dim):
    vb, exact = _block(dtype, head_dim, seed=head_dim + 1)
    rng = np.random.default_rng(head_dim + 1)
    for heads in range(1, 2 * HEADS + 2):
        for kv, count, t in ((1, 16, 0), (0, 9, 3), (2, 1, 40)):
            probs = rng.random((heads, 48)).astype(np.float32)
            acc = rng.standard_normal((heads, head_dim)).astype(np.float32)
            want = acc.astype(np.float64) + probs[:, t:t + count] @ exact[:count, kv]
            _values(probs, t, vb, kv, count, acc)
            np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)


def test_no_positions_leave_everything_as_it_was():
    kb, _ = _block(torch.bfloat16, 64, seed=0)
    scores = np.zeros((3, 8), np.float32)
    _scores(np.ones((3, 64), np.float32), kb, 0, 0, scores, 0)
    assert not scores.any()
    acc = np.ones((3, 64), np.float32)
    _values(np.ones((3, 8), np.float32), 0, kb, 0, 0, acc)
    assert (acc == 1).all()


def test_takes_head_dims_of_whole_vectors_only():
    width = vector_width()
    assert width in (8, 16)
    assert width == (16 if cpu_caps.caps().avx512f else 8)
    assert takes_head_dim(width) and takes_head_dim(8 * width)
    assert not takes_head_dim(width + 4) and not takes_head_dim(12)


# Each vector width's code on every x86 CPU (LLVM splits 16-float vectors for AVX2): the
# host's width alone left AVX2's one-position passes untested on AVX-512 machines, where they
# once scored nothing. numba caches an intrinsic's typing by its argument types, so each width
# is typed with a count of its own integer type.
@pytest.mark.parametrize("width, count_type", [(8, np.int32), (16, np.int16)])
def test_each_vector_width_scores_and_accumulates(monkeypatch, width, count_type):
    from mrv2.attention import decode_vector_ir
    monkeypatch.setattr(decode_vector_ir, "vector_width", lambda: width)
    scores_fn, values_fn = njit(_scores.py_func), njit(_values.py_func)
    rng = np.random.default_rng(width)
    for head_dim in (width, 5 * width):
        kb, exact = _block(torch.float16, head_dim, seed=head_dim)
        for heads, kv, count in ((1, 0, 16), (6, 2, 7), (3, 1, 1)):
            qs = rng.standard_normal((heads, head_dim)).astype(np.float32)
            scores = np.full((heads, 24), np.nan, np.float32)
            scores_fn(qs, kb, kv, count_type(count), scores, 2)
            np.testing.assert_allclose(scores[:, 2:2 + count], qs @ exact[:count, kv].T,
                                       rtol=1e-5, atol=1e-5)
            acc = np.zeros((heads, head_dim), np.float32)
            values_fn(scores, 2, kb, kv, count_type(count), acc)
            np.testing.assert_allclose(acc, scores[:, 2:2 + count] @ exact[:count, kv],
                                       rtol=1e-4, atol=1e-4)
