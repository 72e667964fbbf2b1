"""The Triton twin of norm.py's RMSNorm (with the fused residual add), for CUDA tensors.

One program per row holds the whole row in registers (`BLOCK` = the hidden size rounded up to a
power of two: a model constant, so batches never recompile; the row count is the grid).

Numerics: the torch path's order. The residual add is rounded to the activation dtype (as
transformers' `residual + hidden_states`), the normalisation runs in float32, its result is
rounded to the activation dtype before the weight multiply, and the product is rounded to the
output dtype. Only the sum of squares runs in another order (a tree), and `rsqrt` may differ
from torch's by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel


def sum_combine(a, b):
    """The `tl.reduce` combine of a sum. Kernels take it jitted (`triton_kernel(sum_combine)`)
    as a constexpr argument, so it is made in the kernel's mode: `tl.sum` is jitted once at
    import, and the interpreter cannot call it once Triton was imported in compiled mode."""
    return a + b


def _add_rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, weight_ptr, out_ptr, out_stride,
                         res_out_ptr, res_out_stride, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SUM: tl.constexpr):
    # Without a residual, res_out_ptr is x_ptr (never written): its element type is then the
    # activation dtype the normalised row is rounded to, as with one.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    act_dtype = res_out_ptr.dtype.element_ty
    v = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (v + r).to(act_dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, summed, mask=mask)
        v = summed.to(tl.float32)
    inv = tl.rsqrt(tl.reduce(v * v, 0, SUM) / hidden + eps)
    normed = (v * inv).to(act_dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, hidden] with contiguous rows (copies only when there is none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> weight * norm(x); with `residual`: (norm(x + residual), x + residual)."""
    hidden = x.shape[-1]
    act_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, act_dtype),
                      device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=act_dtype,
                                                        device=x.device)
    x2 = _rows(x)
    res2 = x2 if residual is None else _rows(residual)
    out2, res_out2 = out.view(-1, hidden), x2 if res_out is None else res_out.view(-1, hidden)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        triton_kernel(_add_rms_norm_kernel)[(x2.shape[0],)](
            x2, x2.stride(0), res2, res2.stride(0), weight, out2, out2.stride(0), res_out2,
            res_out2.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            SUM=triton_kernel(sum_combine), num_warps=min(max(block // 256, 1), 8))
    return out if res_out is None else (out, res_out)
