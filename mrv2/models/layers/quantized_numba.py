"""The numba kernels behind quantized.py: GEMV and row dequantization on the packed layouts.

Layouts (quantized.py builds them from GGUF blocks and owns the contract):
- "u4": `q` uint8 [N, K // 2]; group g of row r covers inputs [32 g, 32 g + 32) and is stored in
  bytes [16 g, 16 g + 16): byte j holds input 32 g + j in its low nibble and 32 g + 16 + j in its
  high nibble. w = scale * q + min.
- "i8": `q` int8 [N, K]; groups of `gs` consecutive inputs; w = scale * q (+ min).
`mins` is [N, K // G] float32, or an [N, 0] array for "no min term" (so that one compiled kernel
serves both; the branch is per group and always taken the same way).

Both kernels take one source for both layouts: the `packed` flag picks how a group's values are
decoded into a 32/16-float scratch vector; everything after that is shared. Invariants the
callers (quantized.py) check: K % G == 0, x rows contiguous, ids within [0, N).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

GEMV_CHUNK_ROWS = 16  # weight rows per parallel task of the GEMV


@njit(inline="always", fastmath=True, cache=True)
def _decode_group(q, r, g, gs, packed, wq):
    # Writes the gs integer values of group g of row r into wq[:gs] as float32 (exact: |q| < 2^8).
    if packed:
        base = g * 16
        for j in range(16):
            b = q[r, base + j]
            wq[j] = np.float32(b & 15)
            wq[16 + j] = np.float32(b >> 4)
    else:
        base = g * gs
        for j in range(gs):
            wq[j] = np.float32(q[r, base + j])


@njit(parallel=True, fastmath=True, cache=True)
def gemv_groups(x, q, scales, mins, packed, gs, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for the packed weight (x [M, K] contiguous rows).

    Each weight group is read and decoded once for all M rows of x. Per row of x the scaled
    products go into a gs-wide float32 accumulator vector (vectorised, summed across lanes once
    per weight row); the min term is sum_g min[r, g] * xsum[m, g] with xsum precomputed.
    """
    m_rows, k_dim = x.shape
    n_dim = q.shape[0]
    groups = k_dim // gs
    has_min = mins.shape[1] > 0
    xsum = np.zeros((m_rows, groups), np.float32)
    if has_min:
        for m in range(m_rows):
            for g in range(groups):
                s = np.float32(0.0)
                for j in range(gs):
                    s += x[m, g * gs + j]
                xsum[m, g] = s
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        wq = np.empty(32, np.float32)
        accv = np.empty((m_rows, 32), np.float32)
        accm = np.empty(m_rows, np.float32)
        for r in range(c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)):
            accv[:, :] = 0.0
            accm[:] = 0.0
            for g in range(groups):
                _decode_group(q, r, g, gs, packed, wq)
                s = scales[r, g]
                x0 = g * gs
                for m in range(m_rows):
                    for j in range(gs):
                        accv[m, j] += s * (wq[j] * x[m, x0 + j])
                if has_min:
                    mn = mins[r, g]
                    for m in range(m_rows):
                        accm[m] += mn * xsum[m, g]
            for m in range(m_rows):
                tot = accm[m]
                for j in range(gs):
                    tot += accv[m, j]
                out[m, r] = tot


@njit(parallel=True, fastmath=True, cache=True)
def dequant_rows(q, scales, mins, packed, gs, ids, out):
    """out[i, :] = the float32 weight row ids[i] (w = scale * q + min, one rounding: the
    product of an f16-derived scale and a < 8-bit integer is exact in float32)."""
    k_dim = out.shape[1]
    groups = k_dim // gs
    has_min = mins.shape[1] > 0
    for i in prange(ids.shape[0]):
        wq = np.empty(32, np.float32)
        r = ids[i]
        for g in range(groups):
            _decode_group(q, r, g, gs, packed, wq)
            s = scales[r, g]
            mn = mins[r, g] if has_min else np.float32(0.0)
            x0 = g * gs
            for j in range(gs):
                out[i, x0 + j] = s * wq[j] + mn
