"""A batch-invariant matmul in Triton: out = x @ w^T (+ bias), the linears and the LM head of
batch-invariant mode on CUDA (mrv2/batch_invariant.py).

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from the matrix shapes, so a row's
sums follow the number of rows in its batch. Here every launch uses the same tiles whatever M
is: one program per BLOCK_M x BLOCK_N output tile, the K dimension walked in BLOCK_K steps from
0 upwards, each step's products added into a float32 accumulator. An output element's sum then
has one order for every row count and every place of its row in the batch: no split-K, and no
autotuning (a configuration chosen by M would change the order).

Numerics: float32 inputs use IEEE dots (no TF32); 16-bit inputs multiply natively and sum in
float32; the result is rounded once, to `out_dtype`. Kernels use only `tl` builtins (see
mrv2/platform.py), so the tests run them under the interpreter (float32 and float16 there:
the interpreter's bf16 `tl.dot` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

# One tile shape for every launch (the invariant above); a tensor-core friendly one.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                   stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] of `out_dtype` (x's dtype by
    default), each element summed in one order whatever the row count."""
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} and the weight {weight.dtype}: one dtype expected")
    shape = x.shape
    n, k = weight.shape
    if shape[-1] != k:
        raise ValueError(f"x {tuple(shape)} does not fit a weight of {k} inputs")
    x = x.reshape(-1, k)
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        triton_kernel(_matmul_kernel, do_not_specialize=("M",))[grid](
            x, weight, bias if bias is not None else x, out, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.reshape(*shape[:-1], n)
