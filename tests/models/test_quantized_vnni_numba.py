"""The int8-activation GEMV on AVX-512 VNNI (quantized_vnni_numba): the same integer sums as
the AVX2 int8 kernel (float order aside) for signed and unsigned blocks, with and without min
terms, at K with and without a tail past whole 8-group blocks, 1-7 rows of x (the one-row loop
equal to the rows kernel); the "i8" offset terms; and gemv_groups' routing of int8 x to it."""

from __future__ import annotations

import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from mrv2.models.layers import quantized_int8_numba, quantized_numba, quantized_vnni_numba
from mrv2.models.layers.quantized import PackedWeight

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402
from tests.models.quantized_helpers import dequantized  # noqa: E402

needs_vnni = pytest.mark.skipif(not quantized_vnni_numba.VNNI_DOTS,
                                reason="needs a host with AVX-512 VNNI")


def test_offset_terms_are_minus_128_d_times_each_groups_sum():
    rng = np.random.default_rng(0)
    xq = rng.integers(-127, 128, size=(2, 96), dtype=np.int8)
    dx = rng.random((2, 3), dtype=np.float32)
    out = np.empty((2, 3), np.float32)
    quantized_vnni_numba.offset_terms(xq, dx, out)
    sums = xq.astype(np.int64).reshape(2, 3, 32).sum(-1)
    np.testing.assert_allclose(out, -128.0 * dx * sums, rtol=1e-6)


@numba.njit
def _run_vnni(xq, dx, terms, q, scales, mins, xsum, packed, out):
    for r in range(q.shape[0]):
        m0 = 0
        while m0 < xq.shape[0]:
            m0 += quantized_vnni_numba.gemv_rows_vnni(xq, dx, terms, q, scales, mins, xsum,
                                                      packed, r, m0, out)


@numba.njit
def _run_vnni_one_row(xq, dx, terms, q, scales, mins, xsum, packed, out):
    for r in range(q.shape[0]):
        quantized_vnni_numba.gemv_row_vnni(xq, dx, terms, q, scales, mins, xsum, packed, r, 0,
                                           out)


@numba.njit
def _run_avx2(xq, dx, q, scales, mins, xsum, packed, out):
    for r in range(q.shape[0]):
        m0 = 0
        while m0 < xq.shape[0]:
            m0 += quantized_int8_numba.gemv_rows_int8(xq, dx, q, scales, mins, xsum, packed, 5,
                                                      r, m0, out)


def _int8_rows(gguf_type: str, k: int, rows: int, seed: int):
    """A [40, k] weight's kernel arrays and `rows` rows of x quantized to int8, with their
    group sums (for min terms) and offset terms."""
    w = PackedWeight.from_gguf(random_raw(gguf_type, 40, k, seed=seed), gguf_type, (40, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).numpy()
    if k > 32:
        x[0, 32:64] = 0.0  # an all-zero group
    xq, dx = np.empty((rows, k), np.int8), np.empty((rows, k // 32), np.float32)
    quantized_int8_numba.quantize_rows(x, xq, dx)
    mins = w.kernel_mins.numpy()
    xsum = quantized_int8_numba.group_sums(x, 32, mins.shape[1])  # gemv_groups' float sums
    terms = np.empty((rows, k // 32), np.float32)
    quantized_vnni_numba.offset_terms(xq, dx, terms)
    q = w.q.view(torch.uint8).numpy()
    return x, w, q, xq, dx, terms, mins, xsum


@needs_vnni
@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("k", [32, 96, 288, 576])  # 288, 576: a tail past 8-group blocks
@pytest.mark.parametrize("rows", [1, 3, 7])  # 7: a pass of 4, of 2, of 1
def test_vnni_rows_equal_the_avx2_int8_kernel(gguf_type, k, rows):
    x, w, q, xq, dx, terms, mins, xsum = _int8_rows(gguf_type, k, rows, seed=k + rows)
    packed = w.layout == "u4"
    scales = w.scales.numpy()
    got, expect = np.empty((rows, 40), np.float32), np.empty((rows, 40), np.float32)
    _run_vnni(xq, dx, terms, q, scales, mins, xsum, packed, got)
    _run_avx2(xq, dx, q.view(np.int8) if not packed else q, scales, mins, xsum, packed, expect)
    # the same integers; the float sums differ in order only
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(dequantized(w).double().numpy()).T
    assert (np.abs(got - expect) <= 1e-5 * magnitude.max(axis=1, keepdims=True)).all()
    assert (np.abs(expect).max(axis=1) > 1e-2 * magnitude.max(axis=1)).all()  # not empty sums
    if rows == 1:
        alone = np.empty((1, 40), np.float32)
        _run_vnni_one_row(xq, dx, terms, q, scales, mins, xsum, packed, alone)
        assert np.array_equal(alone, got)


@needs_vnni
@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_groups_takes_vnni_for_int8_x(gguf_type, rows):
    x, w, q, xq, dx, terms, mins, xsum = _int8_rows(gguf_type, 576, rows, seed=1)
    scales, packed = w.scales.numpy(), w.layout == "u4"
    direct, routed = np.empty((rows, 40), np.float32), np.empty((rows, 40), np.float32)
    _run_vnni(xq, dx, terms, q, scales, mins, xsum, packed, direct)
    quantized_numba.gemv_groups(x, q, scales, mins, packed, w.group_size,
                                quantized_numba.X_INT8, routed)
    assert np.array_equal(direct, routed)
