"""vector_ir: the float16 table widening numba code reads through (`table_value`), against
numpy's float16, for float16-bit and float32 tables."""

from __future__ import annotations

import numba
import numpy as np

from mrv2.models.layers.vector_ir import table_value


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

