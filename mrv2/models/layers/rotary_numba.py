"""The numba twin of rotary.py's `apply_rotary`, float32 on CPU (numba_rows.py says when it
runs). `rotary_kernel` is the serial kernel itself, for callers that are numba code
(models/cpu/decode.py).

Numerics: float32, the rotate-half layout as x*cos + rotate_half(x)*sin, like transformers.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from mrv2.models.layers.numba_rows import CHUNK_ROWS, NUMBA_OPTIONS, SERIAL_MAX_ROWS, rows_view


@njit(**NUMBA_OPTIONS)
def rotary_kernel(x, cos, sin, head_dim, out):
    """Each head_dim head of x's rows: its first cos.shape[1] dims rotated (rotate-half among
    them), the rest copied (partial rotary)."""
    rows, width = x.shape
    half = cos.shape[1] // 2
    for r in range(rows):
        for h0 in range(0, width, head_dim):
            for i in range(half):
                a = x[r, h0 + i]
                b = x[r, h0 + half + i]
                out[r, h0 + i] = a * cos[r, i] - b * sin[r, i]
                out[r, h0 + half + i] = b * cos[r, half + i] + a * sin[r, half + i]
            for i in range(2 * half, head_dim):
                out[r, h0 + i] = x[r, h0 + i]


@njit(parallel=True, **NUMBA_OPTIONS)
def _rotary_rows(x, cos, sin, head_dim, out):
    rows = x.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        lo, hi = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        rotary_kernel(x[lo:hi], cos[lo:hi], sin[lo:hi], head_dim, out[lo:hi])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_dim: int) -> torch.Tensor:
    """x [T, N*D], cos/sin [T, R] (rotate-half layout over each head's first R dims) ->
    rotated [T, N*D]."""
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel = rotary_kernel if x.shape[0] <= SERIAL_MAX_ROWS else _rotary_rows
    kernel(rows_view(x), rows_view(cos), rows_view(sin), head_dim, out.numpy())
    return out
