"""The Triton twins of activation.py's gated activations, for CUDA tensors: gate_up [T, 2I] ->
act(gate) * up [T, I] in one pass, act SiLU (Llama family) or GeLU with the tanh
approximation (Gemma's gelu_pytorch_tanh), chosen at compile time (`ACT`).

Numerics: the torch path's order. The activation runs in float32 and is rounded to the
activation dtype (as torch's F.silu / F.gelu), then the product with `up` is rounded again.
tanh is 1 - 2 / (exp(2y) + 1) (Triton's portable ops; exact at both saturations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

# Columns per program: a [T, I] output runs on a (T, ceil(I / COLUMN_BLOCK)) grid.
COLUMN_BLOCK = 1024
# ACT values.
SILU, GELU_TANH = 0, 1
_SQRT_2_OVER_PI = 0.7978845608028654


def _gated_act_kernel(gate_up_ptr, gate_up_stride, out_ptr, out_stride, width,
                      ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    src = gate_up_ptr + row * gate_up_stride + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if ACT == SILU:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=mask)


def _gated_act(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    src = gate_up.reshape(-1, 2 * width)
    if src.stride(-1) != 1:
        src = src.contiguous()
    if src.shape[0] and width:
        block = min(triton.next_power_of_2(width), COLUMN_BLOCK)
        triton_kernel(_gated_act_kernel)[(src.shape[0], triton.cdiv(width, block))](
            src, src.stride(0), out, width, width, ACT=act, BLOCK=block)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    return _gated_act(gate_up, SILU)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> gelu_tanh(gate) * up [..., I]."""
    return _gated_act(gate_up, GELU_TANH)
