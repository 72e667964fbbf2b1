"""layers/dense_gemv_numba: both GEMVs on a 16-bit weight against the exact sum, and a row's bits
whatever rows share its call (each kernel sums an output in one order in every register block).
The float32 GEMV's step: tests/models/test_cpu_gemv.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.models.layers.dense_gemv_numba import gemv_half, gemv_half_pairs

DTYPES = [torch.float16, torch.bfloat16]
KERNELS = [gemv_half, gemv_half_pairs]


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(the kernel's int16 bit patterns, the same weights widened to float64)."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)
    return w.view(torch.int16).numpy(), w.double()


def _gemv(kernel, x: torch.Tensor, q: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((x.shape[0], q.shape[0]), float("nan"))
    kernel(x.contiguous().numpy(), q, dtype == torch.bfloat16, out.numpy())
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
# N: a weight row without a pair, a 16-row task and a partial last one; K: a tail alone, 8-wide
# units with and without a tail, and fewer and more than a group of 4; rows: every block shape
# and mixes of them.
@pytest.mark.parametrize("n, k", [(1, 5), (3, 8), (16, 64), (37, 77), (50, 300)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 33])
def test_sums_within_float32_order_error_of_the_exact_sum(kernel, dtype, n, k, rows):
    # The widening is exact, so the only error is float32 summation: at most about k
    # roundings of 2^-24 relative to sum |x| |w|.
    q, w = _weight(n, k, dtype, seed=n * k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = _gemv(kernel, x, q, dtype).double()
    exact = x.double() @ w.T
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.abs().T) + 1e-30
    assert bool(((got - exact).abs() <= bound).all()), ((got - exact).abs() / bound).max()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel, dtype):
    """Alone, in every block shape, first or last, among 1 to 12 others: the same bits
    (batch-invariant mode runs gemv_half at every row count)."""
    q, _ = _weight(37, 77, dtype, seed=0)
    x = torch.randn(13, 77, generator=torch.Generator().manual_seed(1))
    whole = _gemv(kernel, x, q, dtype)
    for start in range(13):
        for stop in range(start + 1, 14):
            torch.testing.assert_close(_gemv(kernel, x[start:stop], q, dtype), whole[start:stop],
                                       rtol=0, atol=0)
