"""vector_ir: the float16 table widening numba code reads through (`table_value`), against
numpy's float16, for float16-bit and float32 tables."""

from __future__ import annotations

import numba
import numpy as np

from mrv2.models.layers.vector_ir import row_max, row_max_abs, table_value


@numba.njit
def _read_all(table, out):
    for r in range(table.shape[0]):
        for g in range(table.shape[1]):
            out[r, g] = table_value(table, r, g)


def test_table_value_widens_float16_bits_exactly():
    values = np.array([[0.0, -0.0, 1.5e-7, -2.0], [65504.0, -3.1415, 1e-3, np.inf]], np.float16)
    out = np.empty(values.shape, np.float32)
    _read_all(values.view(np.int16), out)
    np.testing.assert_array_equal(out, values.astype(np.float32))
    assert np.signbit(out[0, 1])
    as_float = values.astype(np.float32)
    _read_all(as_float, out)
    np.testing.assert_array_equal(out, as_float)



@numba.njit
def _row_max(a, row, n):
    return row_max(a, row, n)


@numba.njit
def _row_max_abs(a, row, n):
    return row_max_abs(a, row, n)


def test_row_max_and_max_abs_over_lengths_around_their_vector_runs():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 300)) * 10 - 20).astype(np.float32)  # negatives mostly
    for n in (1, 2, 7, 8, 9, 31, 32, 33, 67, 300):
        for row in range(3):
            assert _row_max(a, row, n) == a[row, :n].max()
            assert _row_max_abs(a, row, n) == np.abs(a[row, :n]).max()
    a[1, 200] = -1e30  # the largest magnitude, negative: max_abs sees it, max does not
    assert _row_max_abs(a, 1, 300) == np.float32(1e30)
    assert _row_max(a, 1, 300) == a[1].max() < 1e29
    assert _row_max_abs(np.zeros((1, 40), np.float32), 0, 40) == 0.0
