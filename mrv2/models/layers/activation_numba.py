"""The numba twin of activation.py's SiLU-and-mul, float32 on CPU (numba_rows.py says when it
runs). `silu_and_mul_kernel` is the serial kernel itself, for callers that are numba code
(models/cpu/decode.py).

Numerics: float32; SiLU's exp is `numba_exp.exp32` (vectorised, 2.5 ulp).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.numba_rows import CHUNK_ROWS, NUMBA_OPTIONS, SERIAL_MAX_ROWS, rows_view


@njit(**NUMBA_OPTIONS)
def silu_and_mul_kernel(gate_up, width, out):
    rows = gate_up.shape[0]
    for r in range(rows):
        for i in range(width):
            g = gate_up[r, i]
            out[r, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[r, width + i]


@njit(parallel=True, **NUMBA_OPTIONS)
def _silu_and_mul_rows(gate_up, width, out):
    rows = gate_up.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        lo, hi = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        silu_and_mul_kernel(gate_up[lo:hi], width, out[lo:hi])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=torch.float32)
    kernel = silu_and_mul_kernel if gate_up.shape[0] <= SERIAL_MAX_ROWS else _silu_and_mul_rows
    kernel(rows_view(gate_up), width, out.numpy())
    return out
