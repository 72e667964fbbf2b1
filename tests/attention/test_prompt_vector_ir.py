"""prompt_vector_ir's tile against numpy: every row count and vector count of a tile, rows
picked through index arrays and scaled as they are stored, inner lengths of none to many, and
nothing outside the tile written."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from mrv2.attention.decode_vector_ir import vector_width
from mrv2.attention.prompt_vector_ir import TILE_ROWS, tile_product, tile_vectors


@njit
def _tile(a, a_rows, b, c, c_rows, c_scales, m0, rows, n0, vectors, inner):
    tile_product(a, a_rows, b, c, c_rows, c_scales, m0, rows, n0, vectors, inner)


@pytest.mark.parametrize("inner", [0, 1, 7, 64, 129])
def test_every_tile_shape_against_numpy(inner):
    rng = np.random.default_rng(inner)
    width = vector_width()
    columns = 2 * tile_vectors() * width + width  # room for a tile at an offset
    a = rng.standard_normal((11, max(inner, 1) + 3)).astype(np.float32)
    b = rng.standard_normal((max(inner, 1) + 2, columns)).astype(np.float32)
    for rows in range(1, TILE_ROWS + 1):
        for vectors in range(1, tile_vectors() + 1):
            m0, n0 = 2, width
            a_rows = np.array([9, 9, 4, 0, 7, 1, 10, 3], np.int64)  # tile rows from m0
            c_rows = np.array([5, 5, 1, 8, 2, 6, 0, 3], np.int64)
            scales = rng.random(8).astype(np.float32) + 0.5
            c = np.full((9, columns), np.nan, np.float32)
            _tile(a, a_rows, b, c, c_rows, scales, m0, rows, n0, vectors, inner)
            cols = slice(n0, n0 + vectors * width)
            for i in range(rows):
                want = scales[m0 + i] * (a[a_rows[m0 + i], :inner].astype(np.float64)
                                         @ b[:inner, cols].astype(np.float64))
                np.testing.assert_allclose(c[c_rows[m0 + i], cols], want, rtol=1e-5,
                                           atol=1e-5)
            written = np.zeros_like(c, dtype=bool)
            written[np.ix_(c_rows[m0:m0 + rows], np.arange(columns)[cols])] = True
            assert np.isnan(c[~written]).all()


def test_strided_rows_are_read_and_written_where_they_lie():
    """a, b and c as row views of wider arrays (the kernel's q, v and out views)."""
    rng = np.random.default_rng(5)
    width = vector_width()
    n = tile_vectors() * width
    wide_a = rng.standard_normal((6, 3, n)).astype(np.float32)
    wide_b = rng.standard_normal((n, 2, n)).astype(np.float32)
    wide_c = np.zeros((6, 3, n), np.float32)
    a, b, c = wide_a[:, 1, :], wide_b[:, 1, :], wide_c[:, 2, :]
    order = np.array([3, 0, 5, 2], np.int64)
    _tile(a, order, b, c, order, np.ones(4, np.float32), 0, 4, 0, tile_vectors(), n)
    np.testing.assert_allclose(c[order], a[order].astype(np.float64) @ b, rtol=1e-5,
                               atol=1e-4)
    assert not wide_c[:, :2].any()
