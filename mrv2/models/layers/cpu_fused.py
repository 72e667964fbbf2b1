"""Fused float32 CPU kernels for the small per-layer ops: RMSNorm (with the residual add),
rotary embedding and SiLU-and-mul.

Why: at decode sizes (1-32 rows of a few hundred floats) each torch op costs a few
microseconds of dispatch and allocation, and RMSNorm is ~6 ops, rotary ~8 per tensor. At
prefill sizes (thousands of rows, tensors far larger than the caches) the same torch ops are
memory-bound passes: RMSNorm reads and writes its tensor ~5 times, rotary ~8 times
(bench/README.md has the measurements). One numba call per op does the same arithmetic in one
pass: single-threaded up to `MAX_ROWS` rows (starting the thread pool would cost more than the
work), over row chunks in parallel beyond. `add_rms_norm_kernel`, `rotary_kernel` and
`silu_and_mul_kernel` are the serial numba kernels themselves, for callers that are numba code
(models/cpu/decode.py).

Numerics: float32 throughout like the torch path (transformers' order: normalise, then the
weight multiply; rotary as x*cos + rotate_half(x)*sin); sums run in another order (~1e-7
relative); SiLU's exp is `numba_exp.exp32` (vectorised, 2.5 ulp).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from mrv2.numba_exp import exp32

# Batches of at most this many rows run single-threaded; larger ones in parallel row chunks.
MAX_ROWS = 64
_CHUNK_ROWS = 16  # rows per parallel task


def _add_rms_norm_body(x, residual, weight, eps, out, residual_out):
    rows, hidden = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(hidden):
            v = x[r, i]
            if residual.shape[0] > 0:
                v += residual[r, i]
                residual_out[r, i] = v
            total += v * v
        inv = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + eps)
        for i in range(hidden):
            v = residual_out[r, i] if residual.shape[0] > 0 else x[r, i]
            out[r, i] = weight[i] * (v * inv)


def _rotary_body(x, cos, sin, head_dim, out):
    rows, width = x.shape
    half = head_dim // 2
    for r in range(rows):
        for h0 in range(0, width, head_dim):
            for i in range(half):
                a = x[r, h0 + i]
                b = x[r, h0 + half + i]
                out[r, h0 + i] = a * cos[r, i] - b * sin[r, i]
                out[r, h0 + half + i] = b * cos[r, half + i] + a * sin[r, half + i]


def _silu_and_mul_body(gate_up, width, out):
    rows = gate_up.shape[0]
    for r in range(rows):
        for i in range(width):
            g = gate_up[r, i]
            out[r, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[r, width + i]


_OPTS = dict(fastmath=True, error_model="numpy", cache=True)
add_rms_norm_kernel = njit(**_OPTS)(_add_rms_norm_body)
rotary_kernel = njit(**_OPTS)(_rotary_body)
silu_and_mul_kernel = njit(**_OPTS)(_silu_and_mul_body)
_NO_RESIDUAL = np.empty((0, 0), dtype=np.float32)


# The parallel forms: each task runs the serial kernel on a chunk of rows (a [0, 0] residual
# sliced stays [0, 0], so "no residual" passes through).
@njit(parallel=True, **_OPTS)
def _add_rms_norm_rows(x, residual, weight, eps, out, residual_out):
    rows = x.shape[0]
    for c in prange((rows + _CHUNK_ROWS - 1) // _CHUNK_ROWS):
        lo, hi = c * _CHUNK_ROWS, min(rows, (c + 1) * _CHUNK_ROWS)
        add_rms_norm_kernel(x[lo:hi], residual[lo:hi], weight, eps, out[lo:hi],
                            residual_out[lo:hi])


@njit(parallel=True, **_OPTS)
def _rotary_rows(x, cos, sin, head_dim, out):
    rows = x.shape[0]
    for c in prange((rows + _CHUNK_ROWS - 1) // _CHUNK_ROWS):
        lo, hi = c * _CHUNK_ROWS, min(rows, (c + 1) * _CHUNK_ROWS)
        rotary_kernel(x[lo:hi], cos[lo:hi], sin[lo:hi], head_dim, out[lo:hi])


@njit(parallel=True, **_OPTS)
def _silu_and_mul_rows(gate_up, width, out):
    rows = gate_up.shape[0]
    for c in prange((rows + _CHUNK_ROWS - 1) // _CHUNK_ROWS):
        lo, hi = c * _CHUNK_ROWS, min(rows, (c + 1) * _CHUNK_ROWS)
        silu_and_mul_kernel(gate_up[lo:hi], width, out[lo:hi])


def supported(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """The kernels take a 2-D `x` and float32 CPU tensors, outside autograd."""
    return (x.dim() == 2 and not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, *others)))


def _np2d(t: torch.Tensor) -> np.ndarray:
    """A 2-D numpy view whose rows are contiguous (copies only when they are not)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.detach().numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> weight * norm(x); with `residual`: (norm(x + residual), x + residual)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out = torch.empty(x.shape, dtype=torch.float32) if residual is not None else None
    kernel = add_rms_norm_kernel if x.shape[0] <= MAX_ROWS else _add_rms_norm_rows
    kernel(
        _np2d(x), _NO_RESIDUAL if residual is None else _np2d(residual),
        weight.detach().numpy(), np.float32(eps), out.numpy(),
        _NO_RESIDUAL if res_out is None else res_out.numpy())
    return out if res_out is None else (out, res_out)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           head_dim: int) -> torch.Tensor:
    """x [T, N*D], cos/sin [T, D] (rotate-half layout) -> rotated [T, N*D]."""
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel = rotary_kernel if x.shape[0] <= MAX_ROWS else _rotary_rows
    kernel(_np2d(x), _np2d(cos), _np2d(sin), head_dim, out.numpy())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=torch.float32)
    kernel = silu_and_mul_kernel if gate_up.shape[0] <= MAX_ROWS else _silu_and_mul_rows
    kernel(_np2d(gate_up), width, out.numpy())
    return out
