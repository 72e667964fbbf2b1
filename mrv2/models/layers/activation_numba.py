"""The numba twins of activation.py's SiLU-and-mul and gpt-oss's clamped SwiGLU
(`swigluoai_and_mul`), float32 on CPU (numba_rows.py says when they run).
`silu_and_mul_kernel` is the serial kernel itself, for callers that are numba code
(models/cpu/decode.py). `silu_and_mul_bf16` takes and gives bfloat16, for the MLP of a 16-bit
model whose linears run on the CPU's matrix units (models/layers/mlp.py).

Numerics: float32; SiLU's exp is `numba_exp.exp32` (vectorised, 2.5 ulp). The bfloat16 form
widens its input exactly and rounds each output once (to nearest, ties to even, as torch's
`.to(torch.bfloat16)`): the float32 kernel's result, rounded.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.numba_rows import CHUNK_ROWS, NUMBA_OPTIONS, SERIAL_MAX_ROWS, rows_view
from mrv2.models.layers.vector_ir import bf16_bits_to_float, float_to_bf16_bits, half_bits


@njit(**NUMBA_OPTIONS)
def silu_and_mul_kernel(gate_up, width, out):
    rows = gate_up.shape[0]
    for r in range(rows):
        for i in range(width):
            g = gate_up[r, i]
            out[r, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[r, width + i]


@njit(**NUMBA_OPTIONS)
def gelu_tanh_and_mul_kernel(gate_up, width, out):
    """out = gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh), float32, serial: the fused
    decode stack's; torch's F.gelu(approximate="tanh") to an ulp or two."""
    rows = gate_up.shape[0]
    c = np.float32(0.7978845608028654)  # sqrt(2 / pi)
    for r in range(rows):
        for i in range(width):
            g = gate_up[r, i]
            inner = c * (g + np.float32(0.044715) * g * g * g)
            out[r, i] = (np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner))
                         * gate_up[r, width + i])


@njit(**NUMBA_OPTIONS)
def swigluoai_and_mul_kernel(gate_up, width, alpha, limit, out):
    """gpt-oss's clamped SwiGLU, float32, serial: gate clamped to <= limit, up to [-limit,
    limit], out = (up + 1) * gate * sigmoid(alpha * gate). The comparisons keep a NaN (as
    torch's clamp does)."""
    rows = gate_up.shape[0]
    for r in range(rows):
        for i in range(width):
            g = gate_up[r, i]
            u = gate_up[r, width + i]
            if g > limit:
                g = limit
            if u > limit:
                u = limit
            elif u < -limit:
                u = -limit
            out[r, i] = (u + np.float32(1.0)) * (g / (np.float32(1.0) + exp32(-alpha * g)))


@njit(parallel=True, **NUMBA_OPTIONS)
def _swigluoai_and_mul_rows(gate_up, width, alpha, limit, out):
    rows = gate_up.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        lo, hi = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        swigluoai_and_mul_kernel(gate_up[lo:hi], width, alpha, limit, out[lo:hi])


def swigluoai_and_mul(gate_up: torch.Tensor, alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> gpt-oss's clamped SwiGLU [T, I]."""
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=torch.float32)
    kernel = (swigluoai_and_mul_kernel if gate_up.shape[0] <= SERIAL_MAX_ROWS
              else _swigluoai_and_mul_rows)
    kernel(rows_view(gate_up), width, np.float32(alpha), np.float32(limit), out.numpy())
    return out


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


@njit(parallel=True, **NUMBA_OPTIONS)
def silu_and_mul_bf16_kernel(gate_up, width, out):
    """gate_up, out: bfloat16 bit patterns (uint16)."""
    rows = gate_up.shape[0]
    for c in prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        for r in range(c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)):
            for i in range(width):
                g = bf16_bits_to_float(gate_up[r, i])
                up = bf16_bits_to_float(gate_up[r, width + i])
                out[r, i] = float_to_bf16_bits(g / (np.float32(1.0) + exp32(-g)) * up)


def silu_and_mul_bf16(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] bfloat16 (contiguous rows) -> silu(gate) * up [T, I] bfloat16, into
    `out` where given (contiguous)."""
    width = gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(gate_up.shape[0], width, dtype=torch.bfloat16)
    silu_and_mul_bf16_kernel(half_bits(gate_up.contiguous()), width, half_bits(out))
    return out
