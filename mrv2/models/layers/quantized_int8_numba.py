"""Int8 activations for the GEMV on GGUF blocks (quantized_numba.gemv_groups): x quantized per
32 inputs and the blocks multiplied in byte SIMD.

Int8 activations, as llama.cpp multiplies its Q8_0 / Q8_1 activations: each row of x is
quantized per 32 inputs (d = max |x| / 127, q = round(x / d)) and a unit of 32 weights costs,
per row of x, one vpmaddubsw (u8 x s8, adjacent products summed in i16), one vpmaddwd against
ones (-> 8 x i32), one conversion and one FMA, where float activations take four conversions
and four FMAs. The integer part is exact: a weight is at most 128 in magnitude (a signed one
enters as |w| with x's sign flipped, vpsignb), |q| <= 127, so a pair sums to <= 32,512 and
vpmaddubsw never saturates. The one new error is x's rounding, at most d / 2 per input, so an
output moves by at most sum_g d_g / 2 * sum_{k in g} |w_k| (tests/models/test_quantized.py
checks this bound). The min term keeps x's exact float group sums: after the units, in
the same call, 8 groups a vector.
Where the compile target has no AVX2 the same integers come from generic vector IR
(sign-extend, multiply, add pairs), which LLVM lowers to what the target has.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from mrv2 import cpu_caps
from mrv2.models.layers.vector_ir import (DOT_ROWS, DOT_UNROLL, FAST, F32, I8, I32, V8F,
                                          V8I, V16B, V16S, V32B, call_intrinsic, for_each_unit,
                                          load_table, row_ptr, splat, sums_with_min_terms,
                                          table_elem, vload, x_rows_and_accumulators)
from mrv2.utils.kernel_flags import FASTMATH

_V32I = ir.VectorType(I32, 32)
INT8_BLOCK = 32  # inputs per quantization block of x (int8 or int16), and per kernel unit


# Whether numba compiles for this host (no NUMBA_CPU_NAME) and the host has AVX2.
X86_INT8_DOTS = cpu_caps.caps().int8_dots


def pair_sums(builder, v, lanes):
    """<2n x i32> -> <n x i32>, lane j = v[2j] + v[2j + 1]."""
    n = lanes // 2
    even, odd = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n),
                                                          list(range(o, lanes, 2))))
                 for o in (0, 1))
    return builder.add(even, odd)


def _int8_dot32(builder, w, x, signed, x86):
    """<32 x i8> weights (unsigned when not `signed`) and <32 x i8> activations -> <8 x i32>,
    lane j = the sum of products 4j .. 4j + 3."""
    if x86:
        if signed:
            x = call_intrinsic(builder, "llvm.x86.avx2.psign.b", V32B, [x, w])
            w = call_intrinsic(builder, "llvm.abs.v32i8", V32B, [w, ir.Constant(ir.IntType(1), 0)])
        pairs = call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [w, x])
        return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", V8I,
                              [pairs, ir.Constant(V16S, [1] * 16)])
    wide = builder.sext(w, _V32I) if signed else builder.zext(w, _V32I)
    products = builder.mul(wide, builder.sext(x, _V32I))
    return pair_sums(builder, pair_sums(builder, products, 32), 16)


def _make_int8_dots(nb, packed, x86):
    """An intrinsic (xq, dx, q, scales, mins, xsum, shift, r, m0) -> UniTuple(float32, nb): for
    rows m0..m0+nb-1 of x quantized (xq int8 [M, K], dx float32 [M, K // 32]),
    sum_k dx * xq * scale(r, k) * q(r, k), plus sum_g mins[r, g] * xsum[m, g] when `mins` has
    columns (mins come with 32-input groups only: one per unit). A unit is 32 inputs: u4, one
    group; i8, one group (gs 32) or two (gs 16: lanes 0-3 of the i32 sums hold inputs 0-15)."""

    @intrinsic
    def dots(typingctx, xq, dx, q, scales, mins, xsum, shift, r, m0):
        ret = types.UniTuple(types.float32, nb)

        def codegen(context, builder, signature, args):
            xqt, dxt, qt, st, mnt, xst, sht, rt, mt = signature.args
            r_, m_, sh = (context.cast(builder, v, t, types.intp)
                          for v, t in ((args[7], rt), (args[8], mt), (args[6], sht)))
            ity = r_.type
            qrow, _ = row_ptr(context, builder, qt, args[2], r_, I8)
            srow, _ = row_ptr(context, builder, st, args[3], r_, table_elem(st))
            mrow, _ = row_ptr(context, builder, mnt, args[4], r_, table_elem(mnt))
            xrows, k, accs = x_rows_and_accumulators(context, builder, xqt, args[0], m_, nb,
                                                     DOT_UNROLL, I8)
            drows, srows = ([row_ptr(context, builder, t, arr, builder.add(m_, ity(i)), F32)[0]
                             for i in range(nb)] for t, arr in ((dxt, args[1]), (xst, args[5])))
            groups_log2 = builder.sub(ity(5), sh)  # i8: groups per unit, log2 (0 or 1)

            def unit(c, slot):
                if packed:  # low nibbles are inputs 0-15, high nibbles 16-31
                    b = vload(builder, qrow, builder.mul(c, ity(16)), V16B, 1)
                    w = builder.shuffle_vector(
                        builder.and_(b, ir.Constant(V16B, [15] * 16)),
                        builder.lshr(b, ir.Constant(V16B, [4] * 16)),
                        ir.Constant(_V32I, list(range(32))))
                    scale = splat(builder, load_table(builder, srow, c, st))
                else:
                    w = vload(builder, qrow, builder.mul(c, ity(32)), V32B, 1)
                    first = builder.shl(c, groups_log2)
                    last = builder.add(first, builder.sub(builder.shl(ity(1), groups_log2),
                                                          ity(1)))
                    halves = [splat(builder, load_table(builder, srow, g, st))
                              for g in (first, last)]
                    scale = builder.shuffle_vector(*halves, ir.Constant(
                        V8I, [0, 1, 2, 3, 8, 9, 10, 11]))
                base = builder.mul(c, ity(32))
                for i in range(nb):
                    xv = vload(builder, xrows[i][0], base, V32B, 1)
                    sums = builder.sitofp(_int8_dot32(builder, w, xv, not packed, x86), V8F)
                    d = splat(builder, builder.load(builder.gep(drows[i], [c])))
                    acc = builder.load(accs[i][slot])
                    step = builder.fmul(sums, builder.fmul(scale, d, flags=FAST), flags=FAST)
                    builder.store(builder.fadd(acc, step, flags=FAST), accs[i][slot])

            for_each_unit(builder, builder.sdiv(k, ity(32)), DOT_UNROLL, unit)
            sums = sums_with_min_terms(context, builder, mnt, args[4], mrow, srows, accs)
            return context.make_tuple(builder, ret, sums)

        return ret(xq, dx, q, scales, mins, xsum, shift, r, m0), codegen

    return dots


_u4_int8_dots4, _u4_int8_dots2, _u4_int8_dots1 = (
    _make_int8_dots(n, True, X86_INT8_DOTS) for n in DOT_ROWS)
_i8_int8_dots4, _i8_int8_dots2, _i8_int8_dots1 = (
    _make_int8_dots(n, False, X86_INT8_DOTS) for n in DOT_ROWS)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_rows_int8(xq, dx, q, scales, mins, xsum, packed, shift, r, m0, out):
    """Rows m0.. of the int8 x (4, 2 or 1, as many as are left) against weight row r; returns
    how many."""
    left = xq.shape[0] - m0
    if left >= 4:
        t4 = (_u4_int8_dots4(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
              else _i8_int8_dots4(xq, dx, q, scales, mins, xsum, shift, r, m0))
        for i in range(4):
            out[m0 + i, r] = t4[i]
        return 4
    if left >= 2:
        t2 = (_u4_int8_dots2(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
              else _i8_int8_dots2(xq, dx, q, scales, mins, xsum, shift, r, m0))
        out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
        return 2
    t1 = (_u4_int8_dots1(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
          else _i8_int8_dots1(xq, dx, q, scales, mins, xsum, shift, r, m0))
    out[m0, r] = t1[0]
    return 1


@njit(fastmath=FASTMATH, cache=True)
def quantize_rows(x, xq, dx):
    """x [M, K] float32 -> xq [M, K] int8 or int16, dx float32 [M, K // 32]: per block g of 32
    inputs, with Q = 127 (int8) or 32767 (int16), dx = max |x| / Q and xq = round(x * Q /
    max |x|) (0 for an all-zero block), so that |x - dx * xq| <= dx / 2 (up to float32 rounding
    of dx)."""
    levels = np.float32(127.0) if xq.itemsize == 1 else np.float32(32767.0)
    for m in range(xq.shape[0]):
        for g in range(dx.shape[1]):
            base = g * INT8_BLOCK
            amax = np.float32(0.0)
            for j in range(INT8_BLOCK):
                amax = max(amax, abs(x[m, base + j]))
            dx[m, g] = amax / levels
            inv = levels / amax if amax > 0 else np.float32(0.0)
            for j in range(INT8_BLOCK):
                xq[m, base + j] = round(x[m, base + j] * inv)


@njit(fastmath=FASTMATH, cache=True)
def group_sums(x, gs, groups):
    """[M, groups] sums of x over each group of `gs` inputs (groups 0: an [M, 0] array)."""
    xsum = np.zeros((x.shape[0], groups), np.float32)
    for m in range(x.shape[0]):
        for g in range(groups):
            acc = np.float32(0.0)
            for j in range(g * gs, (g + 1) * gs):
                acc += x[m, j]
            xsum[m, g] = acc
    return xsum
