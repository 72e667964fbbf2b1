"""`F.linear` for float32 on CPU: the GEMV kernel for 1-4 rows, oneDNN with the weight packed
once for more.

Why oneDNN: torch's CPU `F.linear` calls MKL's sgemm, which on AMD CPUs runs its AVX2 code and
repacks the weight on every call. oneDNN picks the widest ISA the CPU has and, with the weight
reordered into its blocked layout ahead of time, is several times faster from 1 row to 4096
(bench/README.md has the figures). A decode step of 1-4 rows is bound by streaming the weights
from DRAM instead, where the numba GEMV (cpu_gemv.py) still does better end to end. Results agree
with `F.linear` to ~1e-6 relative (another summation order).

oneDNN (and torch's ideep layer over it) caches a compiled primitive per input shape, ~0.65 MB
each and ~1.3 ms to create, up to 1024 of each kind: with prefill batches of every row count a
server's memory grew by ~1 GB before the caches filled, and most prefill calls paid a creation.
So inputs are padded to `padded_rows(m)` rows (at most 1/8 more; 88 sizes up to 8192 rows per
weight shape): the caches stay small and hit.

The packed copy is cached on the weight tensor itself and keyed by the tensor's version
counter: a weight changed in place (loading, a test that rewrites it) is repacked at its next
use, never served stale. The dense weight stays (embeddings, tied heads and the loaders read
it), so packed layers hold their weights twice in host memory.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba.extending import overload

from mrv2 import batch_invariant, platform
from mrv2.models.layers import cpu_gemv, dot_linear, tile_linear
from mrv2.models.layers.vector_ir import half_bits
from mrv2.utils import huge_pages

_ATTR = "_mrv2_onednn_packed"  # (version, packed weight) on the weight tensor


def available() -> bool:
    return torch.backends.mkldnn.is_available()


def _float32_cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() == 2 and x.shape[0] > 0
            and not torch.is_grad_enabled())


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` [N, K], packed at first use and after any in-place
    change of `weight`."""
    cached = getattr(weight, _ATTR, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed = onednn_pack(weight.detach().contiguous())
    setattr(weight, _ATTR, (weight._version, packed))
    return packed


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a contiguous [N, K] weight, for `onednn_linear`, on huge pages
    (huge_pages.collapse: each decode step streams it)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    huge_pages.collapse_weights([packed])
    return packed


def padded_rows(rows: int) -> int:
    """The row count oneDNN computes for `rows` input rows: `rows` up to 16, beyond that rounded
    up to a multiple of 1/8 of its power of two (8 sizes an octave, at most 1/8 padding)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ a weight oneDNN packed (`packed_weight`, or `_reorder_linear_weight` of a
    16-bit weight, then x of its dtype) -> [M, N] of x's dtype, M padded to `padded_rows`."""
    rows = x.shape[0]
    padding = padded_rows(rows) - rows
    if padding:  # zero rows below x (F.pad copies x even when it adds none)
        x = F.pad(x, (0, 0, 0, padding))
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out[:rows] if padding else out


@lru_cache(maxsize=None)
def computes_natively(dtype: torch.dtype) -> bool:
    """Whether `native_16bit_linear` runs `dtype` on this CPU's matrix units:
    platform.cpu_computes_natively, read once, where oneDNN is built in."""
    return available() and platform.cpu_computes_natively(dtype)


# The most rows a few-row kernel takes (`half_linear`; onednn_decode's rows stay within it).
FEW_ROWS_MAX = tile_linear.MAX_ROWS


def few_rows_view(packed: torch.Tensor) -> np.ndarray | None:
    """The view of a bfloat16 weight oneDNN packed that this CPU's few-row kernel reads in
    place: AMX tiles (tile_linear, 4-d) where the CPU has them, else AVX-512 BF16 pairs
    (dot_linear, 3-d); None where neither reads it (CPU, dtype, shape)."""
    if tile_linear.usable():
        return tile_linear.weight_tiles(packed)
    return dot_linear.weight_pairs(packed)


def _kernel_of(view_ndim: int):
    """The kernel that reads a `few_rows_view` of this rank: 4-d tiles, 3-d pairs."""
    return tile_linear.tile_linear_kernel if view_ndim == 4 else dot_linear.dot_linear_kernel


def few_rows_kernel(x: np.ndarray, view: np.ndarray, out: np.ndarray, threads: int) -> None:
    """out [M, N] = x [M, K] @ the weight `view` (`few_rows_view`) shows, bfloat16 bits, on
    `threads` threads: the kernel that reads the view. Also callable from numba code."""
    _kernel_of(view.ndim)(x, view, out, threads)


@overload(few_rows_kernel)
def _few_rows_kernel_overload(x, view, out, threads):
    # Typed by the view's rank, so only the kernel this CPU runs is compiled (AMX's
    # instructions do not compile for a CPU without them).
    kernel = _kernel_of(view.ndim)
    return lambda x, view, out, threads: kernel(x, view, out, threads)


def few_rows_linear(x: torch.Tensor, view: np.ndarray, out: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x bfloat16 [M, K] @ the weight `view` shows (`few_rows_view`) -> [M, N] of `dtype`:
    bfloat16 (each output rounded once) or float32 (the sums themselves), into `out` where
    given (contiguous, its dtype the output's), on numba's threads."""
    if out is None:
        n = view.shape[0] * (tile_linear.BLOCK if view.ndim == 4 else dot_linear.BLOCK_OUTPUTS)
        out = torch.empty(x.shape[0], n, dtype=dtype)
    if x.shape[0]:
        out_np = out.numpy() if out.dtype == torch.float32 else half_bits(out)
        few_rows_kernel(half_bits(x.contiguous()), view, out_np, numba.get_num_threads())
    return out


def half_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] of a 16-bit dtype @ a weight of that dtype oneDNN packed -> [M, N] of x's
    dtype, products summed in float32 and each output rounded once: up to `FEW_ROWS_MAX` rows
    of a bfloat16 weight whose packing a few-row kernel reads (`few_rows_view`), that kernel;
    else oneDNN."""
    view = few_rows_view(packed) if x.shape[0] <= FEW_ROWS_MAX else None
    if view is not None:
        return few_rows_linear(x, view)
    return onednn_linear(x, packed)


def native_16bit_linear(x: torch.Tensor, packed: torch.Tensor, dtype: torch.dtype,
                        float32_sums: bool = False) -> torch.Tensor:
    """x float32 [M, K] @ a `dtype` (16-bit) weight oneDNN packed -> float32 [M, N], on the
    CPU's matrix units where `computes_natively(dtype)`: x rounded to `dtype`, the products
    summed in float32, each output rounded to `dtype` once (as a bfloat16 model's linear).
    `float32_sums` skips that last rounding (the LM head's logits, which a bfloat16 grid would
    tie: 0.125 apart between 16 and 32): the few-row kernel that reads `packed`, at any row
    count, writes its float32 sums; where none reads it, oneDNN's product of x rounded to
    `dtype` and the weight widened to float32 (a copy per call: only shapes and dtypes no
    few-row kernel takes come here)."""
    x = x.to(dtype)
    if not float32_sums:
        return half_linear(x, packed).float()
    view = few_rows_view(packed) if dtype == torch.bfloat16 else None
    if view is None:
        return x.float() @ packed.to_dense().float().T
    return few_rows_linear(x, view, dtype=torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; float32 CPU 2-D inputs outside autograd run the GEMV
    kernel (at most `cpu_gemv.MAX_GEMV_ROWS` rows, any count in batch-invariant mode: each
    row's sums in one order) or oneDNN. In batch-invariant mode on the Triton kernels' device:
    matmul_triton.py (cuBLAS picks its tiles by the row count)."""
    if batch_invariant.triton_matmuls(x.device):
        from mrv2.models.layers import matmul_triton

        return matmul_triton.invariant_linear(x, weight, bias)
    if not _float32_cpu_inference(x, weight):
        return F.linear(x, weight, bias)
    if ((x.shape[0] <= cpu_gemv.MAX_GEMV_ROWS or batch_invariant.active())
            and weight.is_contiguous()):
        return cpu_gemv.gemv(x, weight, bias)
    if not _AVAILABLE:
        return F.linear(x, weight, bias)
    return onednn_linear(x, packed_weight(weight), bias)


_AVAILABLE = available()
