"""The GEMV on unquantized weights, for the few rows of a decode step: out[m, r] = sum_k x[m, k]
* w[r, k] in float32, from a float32 weight (cpu_gemv.py) or a 16-bit one (layouts "f16" /
"bf16": `q` int16 [N, K], each value the bit pattern of one weight; quantized.py). A 16-bit
weight is widened as it is read (f16: vcvtph2ps with F16C; bf16: the bits shifted into a
float32's high half, exact), so a step reads 2 bytes a weight and rounds nothing beyond the
stored weight. The sums are LLVM vector IR (`_make_block`), in an order fixed by the kernel.

Two kernels on a 16-bit weight, two summation orders (linear_plan chooses by row count):
- `gemv_half` (LinearKernel.HALF_GEMV): one weight row at a time, in memory order, against up
  to 4 rows of x, each output in 4 chains (unit c of 8 inputs into chain c % 4). One weight
  stream in memory order is what DRAM serves fastest: 1 to 4 rows, bound by reading the
  weights. Its order is the same at every row count (batch-invariant mode runs it at all).
- `gemv_half_pairs` (LinearKernel.HALF_PAIRS): weight rows in pairs against blocks of 4 rows of
  x, each output one chain (8 chains a pass, as many as the FMA latency needs), rows of x outer
  in a task so a block stays in L1. A pass loads 6 vectors for 8 FMAs where gemv_half's loads
  5 for 4 and keeps 16 accumulators, more than AVX2's 16 registers hold beside its operands:
  from 8 rows on, bound by arithmetic, it is the faster (bench/README.md); reading two weight
  rows at once is the slower at 1 to 4 rows.
Each kernel sums an output the same way whatever block its row of x falls in, so a row's bits
do not depend on the rows beside it within one kernel.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2.models.layers.quantized_numba import GEMV_CHUNK_ROWS
from mrv2.models.layers.vector_ir import (F32, FAST, I16, V8F, V8H, for_each_unit, row_ptr,
                                          sum_accumulators, vload, widen_half)
from mrv2.utils.kernel_flags import FASTMATH

_UNROLL = 4  # units of 8 inputs per loop iteration (one 64-byte line of a float32 row)


def _make_block(weight_rows: int, x_rows: int, layout: str, chains: int):
    """An intrinsic (x, w, r0, m0) -> UniTuple(float32, weight_rows * x_rows): output
    [j * x_rows + i] = sum_k x[m0 + i, k] * w(r0 + j, k), w of `layout` ("f32", "f16",
    "bf16"). Unit c (inputs 8c..8c+7) goes into chain c % chains of its output (the units
    past the last whole group of `_UNROLL` into chain 0); the chains are added in order, then
    the lanes (vector_ir.hsum), then the K % 8 tail summed in k order."""
    dense = layout == "f32"
    wty, wvec, walign = (F32, V8F, 4) if dense else (I16, V8H, 2)

    def widen(builder, loaded):
        return loaded if dense else widen_half(builder, loaded, layout == "bf16")

    @intrinsic
    def block(typingctx, x, w, r0, m0):
        ret = types.UniTuple(types.float32, weight_rows * x_rows)

        def codegen(context, builder, signature, args):
            xt, wt, rt, mt = signature.args
            r_, m_ = (context.cast(builder, v, t, types.intp)
                      for v, t in ((args[2], rt), (args[3], mt)))
            ity = r_.type
            wrows = [row_ptr(context, builder, wt, args[1], builder.add(r_, ity(j)), wty)[0]
                     for j in range(weight_rows)]
            xrows = [row_ptr(context, builder, xt, args[0], builder.add(m_, ity(i)), F32)
                     for i in range(x_rows)]
            k = cgutils.unpack_tuple(builder, xrows[0][1].shape, 2)[1]
            zero = ir.Constant(V8F, [0.0] * 8)
            accs = [[[cgutils.alloca_once_value(builder, zero) for _ in range(chains)]
                     for _ in range(x_rows)] for _ in range(weight_rows)]

            def unit(c, slot):
                base = builder.mul(c, ity(8))
                ws = [widen(builder, vload(builder, p, base, wvec, walign)) for p in wrows]
                for i in range(x_rows):
                    xv = vload(builder, xrows[i][0], base, V8F, 4)
                    for j in range(weight_rows):
                        acc = accs[j][i][slot % chains]
                        builder.store(builder.fadd(builder.load(acc),
                                                   builder.fmul(ws[j], xv, flags=FAST),
                                                   flags=FAST), acc)

            units = builder.sdiv(k, ity(8))
            for_each_unit(builder, units, _UNROLL, unit)
            tails = [[cgutils.alloca_once_value(builder, F32(0.0)) for _ in range(x_rows)]
                     for _ in range(weight_rows)]
            tail_start = builder.mul(units, ity(8))
            with cgutils.for_range(builder, builder.sub(k, tail_start)) as loop:
                idx = builder.add(tail_start, loop.index)
                ws = [widen(builder, builder.load(builder.gep(p, [idx]))) for p in wrows]
                for i in range(x_rows):
                    xv = builder.load(builder.gep(xrows[i][0], [idx]))
                    for j in range(weight_rows):
                        tail = tails[j][i]
                        builder.store(builder.fadd(builder.load(tail),
                                                   builder.fmul(ws[j], xv, flags=FAST),
                                                   flags=FAST), tail)
            sums = [builder.fadd(sum_accumulators(builder, accs[j][i]),
                                 builder.load(tails[j][i]), flags=FAST)
                    for j in range(weight_rows) for i in range(x_rows)]
            return context.make_tuple(builder, ret, sums)

        return ret(x, w, r0, m0), codegen

    return block


# One weight row, 4 chains an output (cpu_gemv's float32 GEMV and gemv_half), by rows of x.
_F32_1X4, _F32_1X2, _F32_1X1 = (_make_block(1, m, "f32", 4) for m in (4, 2, 1))
_F16_1X4, _F16_1X2, _F16_1X1 = (_make_block(1, m, "f16", 4) for m in (4, 2, 1))
_BF16_1X4, _BF16_1X2, _BF16_1X1 = (_make_block(1, m, "bf16", 4) for m in (4, 2, 1))
# gemv_half_pairs: one chain an output; 2 x 4 passes, single weight rows where none pair.
_F16_P2X4, _F16_P1X4, _F16_P1X2, _F16_P1X1 = (_make_block(w, m, "f16", 1)
                                              for w, m in ((2, 4), (1, 4), (1, 2), (1, 1)))
_BF16_P2X4, _BF16_P1X4, _BF16_P1X2, _BF16_P1X1 = (_make_block(w, m, "bf16", 1)
                                                  for w, m in ((2, 4), (1, 4), (1, 2), (1, 1)))


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_float32_rows(x, w, r, m0, out):
    """Rows m0.. of x (4, 2 or 1, as many as are left) against float32 weight row r (the
    float32 GEMV's step, cpu_gemv.py); returns how many."""
    left = x.shape[0] - m0
    if left >= 4:
        out[m0, r], out[m0 + 1, r], out[m0 + 2, r], out[m0 + 3, r] = _F32_1X4(x, w, r, m0)
        return 4
    if left >= 2:
        t2 = _F32_1X2(x, w, r, m0)
        out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
        return 2
    out[m0, r] = _F32_1X1(x, w, r, m0)[0]
    return 1


def _make_half_step(f16_blocks: tuple, bf16_blocks: tuple):
    """A 16-bit GEMV's step from its 1 x 4, 1 x 2 and 1 x 1 blocks (float16's, bfloat16's):
    (x, q, bf16, r, m0, out) -> rows m0.. of x (4, 2 or 1, as many as are left) against
    weight row r, written to out; returns how many. Inlined into its kernel, which is cached."""
    f4, f2, f1 = f16_blocks
    b4, b2, b1 = bf16_blocks

    @njit(inline="always", fastmath=FASTMATH)
    def step(x, q, bf16, r, m0, out):
        left = x.shape[0] - m0
        if left >= 4:
            t4 = b4(x, q, r, m0) if bf16 else f4(x, q, r, m0)
            for i in range(4):
                out[m0 + i, r] = t4[i]
            return 4
        if left >= 2:
            t2 = b2(x, q, r, m0) if bf16 else f2(x, q, r, m0)
            out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
            return 2
        out[m0, r] = (b1(x, q, r, m0) if bf16 else f1(x, q, r, m0))[0]
        return 1

    return step


# gemv_half's step, and gemv_half_pairs' for a weight row without a pair or the last rows of x.
_half_row = _make_half_step((_F16_1X4, _F16_1X2, _F16_1X1), (_BF16_1X4, _BF16_1X2, _BF16_1X1))
_pairs_row = _make_half_step((_F16_P1X4, _F16_P1X2, _F16_P1X1),
                             (_BF16_P1X4, _BF16_P1X2, _BF16_P1X1))


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemv_half(x, q, bf16, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for a 16-bit weight (`q` int16 [N, K] bit patterns,
    bfloat16 when `bf16` else IEEE half; x [M, K] contiguous rows), accumulated in float32."""
    n_dim = q.shape[0]
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        for r in range(c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)):
            m0 = 0
            while m0 < x.shape[0]:
                m0 += _half_row(x, q, bf16, r, m0, out)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def gemv_half_pairs(x, q, bf16, out):
    """gemv_half's product (its arguments), in register blocks of 2 weight rows x 4 rows of x
    with one chain an output: the kernel for 8 rows of x and more."""
    n_dim, m_dim = q.shape[0], x.shape[0]
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        start = c * GEMV_CHUNK_ROWS
        end = min(n_dim, start + GEMV_CHUNK_ROWS)
        pairs_end = start + (end - start) // 2 * 2
        m0 = 0
        while m0 < m_dim:
            if m_dim - m0 < 4:
                step = 1
                for r in range(start, end):
                    step = _pairs_row(x, q, bf16, r, m0, out)
                m0 += step
                continue
            for r in range(start, pairs_end, 2):
                t = _BF16_P2X4(x, q, r, m0) if bf16 else _F16_P2X4(x, q, r, m0)
                for j in range(2):
                    for i in range(4):
                        out[m0 + i, r + j] = t[j * 4 + i]
            for r in range(pairs_end, end):
                _pairs_row(x, q, bf16, r, m0, out)
            m0 += 4
