"""y = x W^T for a few rows of x on CPU (float32): a numba GEMV that streams W once.

Why: a decode step with 1-4 tokens is bound by reading the weights from DRAM, and the BLAS
behind `F.linear` reads them well below the memory bandwidth for these shapes when the weights
are not in cache (the whole model is larger than the caches). This kernel splits W's rows over
the threads in chunks of 64 and reads each row once for all of x's rows (bench/README.md has
the measured rates). Larger batches are compute-bound: cpu_linear.py sends them to oneDNN.

Numerics: fp32 dot products in a different summation order than BLAS (~1e-7 relative).
"""

from __future__ import annotations

import torch
from numba import njit, prange

from mrv2.models.layers.dense_gemv_numba import gemv_float32_rows
from mrv2.utils.kernel_flags import FASTMATH

# At most this many rows of x take the GEMV path (still faster than BLAS there: bench/README.md).
MAX_GEMV_ROWS = 4
_CHUNK = 64  # weight rows per parallel task


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemv_kernel(x, w, out):
    """out [M, N] = x [M, K] @ w [N, K]^T, each weight row read once for up to 4 rows of x
    (dense_gemv_numba.gemv_float32_rows: the sums in vector IR, in a fixed order)."""
    n_dim = w.shape[0]
    num_chunks = (n_dim + _CHUNK - 1) // _CHUNK
    for c in prange(num_chunks):
        for n in range(c * _CHUNK, min(n_dim, (c + 1) * _CHUNK)):
            m0 = 0
            while m0 < x.shape[0]:
                m0 += gemv_float32_rows(x, w, n, m0, out)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) for float32 CPU tensors, a contiguous weight and a
    few rows (the caller, cpu_linear.linear, checks)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    gemv_kernel(x.contiguous().numpy(), weight.detach().numpy(), out.numpy())
    if bias is not None:
        out += bias
    return out
