"""Linears on 16-bit GGUF weights (F16, BF16) in float32 arithmetic, the weight repacked into
panels of outputs: each output's products exact in float32 and summed in float32, as the
GEMV on the rows (dense_gemv_numba.gemv_half) sums them, with no rounding of x.

Why: where the CPU has no matrix unit for the weight's dtype (float16 without AVX-512 FP16 or
AMX-FP16), a batched step multiplied such a weight row by row (`gemv_half`: per row of x and 8
inputs a load, a widening, an FMA, and a horizontal sum per output) or dequantized it to
float32 tiles for torch.mm (every element written and read again each step). Here a weight of
[N, K] is held as [ceil(N / 64), K, 64]: for each input k, the 64 outputs of a panel are one
contiguous run of 128 bytes, widened once into four 16-float vectors and multiplied by x[m, k]
of up to PANEL_ROWS rows at a time (a broadcast FMA per vector and row, the 4 x 6 accumulators
in registers): one widening serves six rows, and no output needs a horizontal sum.

Numerics: out[m, n] = sum over k in order of float32(x[m, k] * w[n, k]) (FMA-contracted),
float32 accumulation; the widening of a 16-bit value to float32 is exact, so outputs differ
from `gemv_half`'s only by summation order (tests bound both against the exact sum).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2.attention.decode_vector_ir import vector_width
from mrv2.models.layers.vector_ir import F32, FAST, I16, row_ptr, splat, widen_half
from mrv2.utils.kernel_flags import FASTMATH

PANEL_OUTPUTS = 64  # outputs of a panel
PANEL_VECTORS = 4  # 16-float vectors of a panel's outputs
PANEL_ROWS = 6  # rows of x per pass over a panel: 4 x 6 accumulators, in 32 vector registers

_FLOATS = ir.VectorType(F32, PANEL_OUTPUTS // PANEL_VECTORS)
_BITS = ir.VectorType(I16, PANEL_OUTPUTS // PANEL_VECTORS)


def panels_run_here() -> bool:
    """Whether the kernel runs here: its 4 x 6 accumulators need AVX-512's 32 vector registers
    (with AVX2's 16 they would spill: not measured, so those CPUs keep the other paths)."""
    return vector_width() == 16


def panels_of(q: torch.Tensor) -> np.ndarray:
    """A 16-bit weight's bit patterns `q` (int16 [N, K]) as the kernel's panels, int16
    [ceil(N / 64), K, 64]: panel b, input k holds outputs 64b .. 64b + 63 (zeros past N)."""
    n, k = q.shape
    blocks = -(-n // PANEL_OUTPUTS)
    padded = torch.zeros(blocks * PANEL_OUTPUTS, k, dtype=torch.int16)
    padded[:n] = q
    return padded.reshape(blocks, PANEL_OUTPUTS, k).transpose(1, 2).contiguous().numpy()


@intrinsic(prefer_literal=True)
def _panel_sums(typingctx, w, block, x, m0, rows, bf16, sums):
    """sums[r, :64] = x[m0 + r] . the 64 outputs of panel `block` of w, over all of K, float32,
    for r < rows (a literal, 1 to PANEL_ROWS): one accumulator per output, K in order; `bf16`
    (a literal) says how w's bits widen."""
    if not (isinstance(rows, types.IntegerLiteral) and 1 <= rows.literal_value <= PANEL_ROWS
            and isinstance(bf16, types.BooleanLiteral)):
        return None
    count, is_bf16 = rows.literal_value, bf16.literal_value

    def codegen(context, builder, signature, args):
        wt, _, xt, _, _, _, st = signature.args
        block, m0 = (context.cast(builder, args[i], signature.args[i], types.intp)
                     for i in (1, 3))
        ity = block.type
        panel, warr = row_ptr(context, builder, wt, args[0], block, _BITS)
        k = cgutils.unpack_tuple(builder, warr.shape, 3)[1]
        xrows = [row_ptr(context, builder, xt, args[2], builder.add(m0, ity(r)), F32)[0]
                 for r in range(count)]
        zero = ir.Constant(_FLOATS, [0.0] * _FLOATS.count)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(PANEL_VECTORS)]
                for _ in range(count)]
        with cgutils.for_range(builder, k) as loop:
            first = builder.mul(loop.index, ity(PANEL_VECTORS))
            wv = [widen_half(builder, builder.load(builder.gep(panel, [builder.add(
                first, ity(j))]), align=32), is_bf16) for j in range(PANEL_VECTORS)]
            for r in range(count):
                xv = splat(builder, builder.load(builder.gep(xrows[r], [loop.index])),
                           _FLOATS.count)
                for j in range(PANEL_VECTORS):
                    product = builder.fmul(wv[j], xv, flags=FAST)
                    builder.store(builder.fadd(builder.load(accs[r][j]), product, flags=FAST),
                                  accs[r][j])
        for r in range(count):
            out = row_ptr(context, builder, st, args[6], ity(r), _FLOATS)[0]
            for j in range(PANEL_VECTORS):
                builder.store(builder.load(accs[r][j]), builder.gep(out, [ity(j)]), align=4)
        return context.get_dummy_value()

    return types.void(w, block, x, m0, rows, bf16, sums), codegen


@njit(inline="always", cache=True)
def _rows_pass(w, b, x, m0, rows, bf16, sums):
    """`_panel_sums` for `rows` (1 to PANEL_ROWS) rows of x, `bf16` a literal: each count is a
    literal the intrinsic is generated for."""
    if rows == 6:
        _panel_sums(w, b, x, m0, 6, bf16, sums)
    elif rows == 5:
        _panel_sums(w, b, x, m0, 5, bf16, sums)
    elif rows == 4:
        _panel_sums(w, b, x, m0, 4, bf16, sums)
    elif rows == 3:
        _panel_sums(w, b, x, m0, 3, bf16, sums)
    elif rows == 2:
        _panel_sums(w, b, x, m0, 2, bf16, sums)
    else:
        _panel_sums(w, b, x, m0, 1, bf16, sums)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def half_panel_kernel(x, w, bf16, out):
    """out [M, N] float32 = x float32 [M, K] (rows contiguous) @ the 16-bit weight whose panels
    (`panels_of`) are w; `bf16`: the bits are bfloat16's, else float16's. The panels are
    shared among numba's threads (prange's static schedule: a contiguous run each), and each
    panel takes all of x's rows, PANEL_ROWS at a time (the panel stays in L2). No thread count
    is read inside: numba's get_num_threads would keep its callers (the decode stack) from
    being cached."""
    rows, n = out.shape
    for b in prange(w.shape[0]):
        sums = np.empty((PANEL_ROWS, PANEL_OUTPUTS), np.float32)
        n0 = b * PANEL_OUTPUTS
        width = min(PANEL_OUTPUTS, n - n0)
        for m0 in range(0, rows, PANEL_ROWS):
            count = min(PANEL_ROWS, rows - m0)
            if bf16:
                _rows_pass(w, b, x, m0, count, True, sums)
            else:
                _rows_pass(w, b, x, m0, count, False, sums)
            for r in range(count):
                out[m0 + r, n0:n0 + width] = sums[r, :width]


def half_panel_linear(x: torch.Tensor, panels: np.ndarray, bf16: bool,
                      out_features: int) -> torch.Tensor:
    """x float32 [M, K] @ the 16-bit weight of `out_features` outputs whose panels
    (`panels_of`) are `panels` -> float32 [M, out_features]."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        half_panel_kernel(x.contiguous().numpy(), panels, bf16, out.numpy())
    return out
