"""The Triton twin of norm.py's RMSNorm (with the fused residual add), for CUDA tensors.

One program per row holds the whole row in registers (`BLOCK` = the hidden size rounded up to a
power of two: a model constant, so batches never recompile; the row count is the grid).

Numerics: the torch path's order. The residual add is rounded to the activation dtype (as
transformers' `residual + hidden_states`), the normalisation runs in float32, its result is
rounded to the activation dtype before the weight multiply, and the product is rounded to the
output dtype. Only the sum of squares runs in another order (a tree), and `rsqrt` may differ
from torch's by an ulp.

Sums are trees of public builtins (`tl.reshape`, `tl.split`, `+`), as in
attention/split_kv_triton.py: `tl.sum` is a jitted helper the interpreter cannot call once
Triton was imported in compiled mode, and a combine function of our own makes the interpreter
reduce element by element in Python.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel


def _add_rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, weight_ptr, out_ptr, out_stride,
                         res_out_ptr, res_out_stride, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr,
                         ROUND_BEFORE_WEIGHT: tl.constexpr = True):
    # Without a residual, res_out_ptr is x_ptr (never written): its element type is then the
    # activation dtype the normalised row is rounded to, as with one.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]: the sum below keeps a [1, 1] result
    mask = cols < hidden
    act_dtype = res_out_ptr.dtype.element_ty
    v = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (v + r).to(act_dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, summed, mask=mask)
        v = summed.to(tl.float32)
    total = v * v
    for _ in tl.static_range(LOG2_BLOCK):
        lo, hi = tl.split(tl.reshape(total, [1, total.shape[1] // 2, 2]))
        total = lo + hi
    inv = tl.rsqrt(total / hidden + eps)
    normed = v * inv
    if ROUND_BEFORE_WEIGHT:  # Llama's order; Gemma's multiplies in float32 and rounds once
        normed = normed.to(act_dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, hidden] with contiguous rows (copies only when there is none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, unit_offset: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> weight * norm(x); with `residual`: (norm(x + residual), x + residual).
    `unit_offset` (Gemma: `weight` holds 1 + w, float32): the product in float32, rounded
    once to the activation dtype."""
    hidden = x.shape[-1]
    act_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = act_dtype if unit_offset else torch.promote_types(weight.dtype, act_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
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
            LOG2_BLOCK=block.bit_length() - 1, ROUND_BEFORE_WEIGHT=not unit_offset,
            num_warps=min(max(block // 256, 1), 8))
    return out if res_out is None else (out, res_out)
