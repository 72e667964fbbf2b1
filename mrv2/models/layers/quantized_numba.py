"""The numba kernels behind quantized.py: GEMV and row dequantization on the packed layouts.

Layouts (quantized.py builds them from GGUF blocks and owns the contract):
- "u4": `q` uint8 [N, K // 2]; group g of row r covers inputs [32 g, 32 g + 32) and is stored in
  bytes [16 g, 16 g + 16): byte j holds input 32 g + j in its low nibble and 32 g + 16 + j in its
  high nibble. w = scale * q + min.
- "i8": `q` int8 [N, K]; groups of `gs` consecutive inputs; w = scale * q (+ min).
`mins` is [N, K // G] float32, or an [N, 0] array for "no min term" (so that one compiled kernel
serves both; the branch is per group and always taken the same way).

Both kernels share one row decoder for both layouts (`packed` picks the branch, the same for
every group of a call). Invariants the
callers (quantized.py) check: K % G == 0, x rows contiguous, ids within [0, N).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

GEMV_CHUNK_ROWS = 16  # weight rows per parallel task of the GEMV
# Nibble values of every byte as float32: numba widens integer ops to int64, and AVX2 has no
# vector int64 -> float conversion, so `float(b & 15)` runs scalar; two table loads are cheaper.
NIBBLE_LO = (np.arange(256) & 15).astype(np.float32)
NIBBLE_HI = (np.arange(256) >> 4).astype(np.float32)


@njit(inline="always", fastmath=True, cache=True)
def _decode_row(q, scales, mins, packed, gs, r, buf):
    # buf[:K] = float32 weight row r: w = scale * q + min, where scale * q is exact in float32
    # (an f16-derived scale times a < 8-bit integer), so one rounding, as in the reference.
    # Contiguous group loops with no reduction: the float conversion and FMA vectorise.
    has_min = mins.shape[1] > 0
    for g in range(scales.shape[1]):
        s = scales[r, g]
        mn = mins[r, g] if has_min else np.float32(0.0)
        if packed:
            base = g * 16
            for j in range(16):
                b = q[r, base + j]
                buf[2 * base + j] = s * NIBBLE_LO[b] + mn
                buf[2 * base + 16 + j] = s * NIBBLE_HI[b] + mn
        else:
            base = g * gs
            for j in range(gs):
                buf[base + j] = s * np.float32(q[r, base + j]) + mn


@njit(parallel=True, fastmath=True, cache=True)
def gemv_groups(x, q, scales, mins, packed, gs, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for the packed weight (x [M, K] contiguous rows).

    Each weight row is read from memory once and decoded once into a K-float scratch row that
    stays in L1; every row of x then takes one contiguous float32 dot product with it (a long
    vectorised reduction). The min term needs no separate pass: it is folded into the row.
    """
    m_rows, k_dim = x.shape
    n_dim = q.shape[0]
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        buf = np.empty(k_dim, np.float32)
        for r in range(c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)):
            _decode_row(q, scales, mins, packed, gs, r, buf)
            for m in range(m_rows):
                acc = np.float32(0.0)
                for k in range(k_dim):
                    acc += buf[k] * x[m, k]
                out[m, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def dequant_rows(q, scales, mins, packed, gs, ids, out):
    """out[i, :] = the float32 weight row ids[i] (bit-equal to gguf.quants.dequantize)."""
    for i in prange(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])


@njit(fastmath=True, cache=True)
def dequant_rows_serial(q, scales, mins, packed, gs, ids, out):
    """dequant_rows on the calling thread: the tiled linear alternates it with torch.mm, and
    handing each tile between numba's and torch's thread pools stalls for a scheduler quantum
    whenever another process holds a core."""
    for i in range(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])
