"""The Triton twin of activation.py's SiLU-and-mul, for CUDA tensors: gate_up [T, 2I] ->
silu(gate) * up [T, I] in one pass.

Numerics: the torch path's order. silu runs in float32 and is rounded to the activation dtype
(as torch's F.silu), then the product with `up` is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

# Columns per program: a [T, I] output runs on a (T, ceil(I / COLUMN_BLOCK)) grid.
COLUMN_BLOCK = 1024


def _silu_and_mul_kernel(gate_up_ptr, gate_up_stride, out_ptr, out_stride, width,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    src = gate_up_ptr + row * gate_up_stride + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    src = gate_up.reshape(-1, 2 * width)
    if src.stride(-1) != 1:
        src = src.contiguous()
    if src.shape[0] and width:
        block = min(triton.next_power_of_2(width), COLUMN_BLOCK)
        triton_kernel(_silu_and_mul_kernel)[(src.shape[0], triton.cdiv(width, block))](
            src, src.stride(0), out, width, width, BLOCK=block)
    return out
