"""The numba twin of norm.py's RMSNorm (with the residual add), float32 on CPU
(numba_rows.py says when it runs). `add_rms_norm_kernel` is the serial kernel itself, for
callers that are numba code (models/cpu/decode.py).

Numerics: float32 like the torch path, in transformers' order (normalise, then the weight
multiply); the sum of squares runs in vector_ir.row_sum_squares' fixed order (~1e-7 relative
to torch's).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from mrv2.models.layers.numba_rows import CHUNK_ROWS, NUMBA_OPTIONS, SERIAL_MAX_ROWS, rows_view
from mrv2.models.layers.vector_ir import row_sum_squares


@njit(**NUMBA_OPTIONS)
def add_rms_norm_kernel(x, residual, weight, eps, out, residual_out):
    """out = weight * norm(x + residual), residual_out = x + residual; a [0, 0] `residual`
    means none (then residual_out is not written)."""
    rows, hidden = x.shape
    for r in range(rows):
        if residual.shape[0] > 0:
            for i in range(hidden):
                residual_out[r, i] = x[r, i] + residual[r, i]
            total = row_sum_squares(residual_out, r, hidden)
        else:
            total = row_sum_squares(x, r, hidden)
        inv = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + eps)
        for i in range(hidden):
            v = residual_out[r, i] if residual.shape[0] > 0 else x[r, i]
            out[r, i] = weight[i] * (v * inv)


# The parallel form: each task runs the serial kernel on a chunk of rows (a [0, 0] residual
# sliced stays [0, 0], so "no residual" passes through).
@njit(parallel=True, **NUMBA_OPTIONS)
def _add_rms_norm_rows(x, residual, weight, eps, out, residual_out):
    rows = x.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        lo, hi = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        add_rms_norm_kernel(x[lo:hi], residual[lo:hi], weight, eps, out[lo:hi],
                            residual_out[lo:hi])


NO_RESIDUAL = np.empty((0, 0), dtype=np.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> weight * norm(x); with `residual`: (norm(x + residual), x + residual)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out = torch.empty(x.shape, dtype=torch.float32) if residual is not None else None
    kernel = add_rms_norm_kernel if x.shape[0] <= SERIAL_MAX_ROWS else _add_rms_norm_rows
    kernel(
        rows_view(x), NO_RESIDUAL if residual is None else rows_view(residual),
        weight.detach().numpy(), np.float32(eps), out.numpy(),
        NO_RESIDUAL if res_out is None else res_out.numpy())
    return out if res_out is None else (out, res_out)
