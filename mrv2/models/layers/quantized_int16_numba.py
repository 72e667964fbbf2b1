"""Int16 activations for the GEMV on GGUF blocks (quantized_numba.gemv_groups): the default for
a decode step of a few rows, where float32 activations make the GEMV compute-bound.

Why: with float32 x a 32-weight group of a row costs two byte widenings, two nibble splits,
four int -> float conversions and four FMAs (plus the scale) per row of x, about 18 vector
operations for 20 bytes of Q4_1: at one row of x the GEMV is bound by them, not by memory
(bench/README.md). Here each row of x is quantized per 32 inputs to int16 (d = max |x| / 32767,
q = round(x / d)) and a group costs one widening of its bytes to 16 lanes of i16, one nibble
split, two vpmaddwd (i16 x i16, adjacent products summed in i32), one add, one conversion and
one FMA. The integer part is exact: |w| <= 128 (i8 layouts) or 15 (u4), |q| <= 32767, so a lane
sums four products below 2^24. The new error is x's rounding, at most d / 2 per input: 1/256 of
int8 activations' (quantized_int8_numba), within 2^-16 of each block's largest input, and below
bfloat16 weights' rounding (tests/testing/test_logprob_bound.py states and checks the bound).

The scale of a group times x's d is formed 8 groups at a time as one vector product (the f16
table widened in one conversion), then read back a lane per group; groups past the last whole
8 (K = 576 has 18) take the scalar product. The min term keeps x's exact float group sums, as
in the int8 kernel (vector_ir.sums_with_min_terms).
Where the compile target has no AVX2 the products come from generic vector IR (sign-extend,
multiply, add pairs), which LLVM lowers to what the target has.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS, pair_sums
from mrv2.models.layers.vector_ir import (DOT_ROWS, DOT_UNROLL, FAST, F32, I8, I16, I32, V8F, V8H,
                                          V8I, V16B, V16I, V16S, call_intrinsic, load_table,
                                          row_ptr, splat, sums_with_min_terms, table_elem, vload,
                                          widen_half, x_rows_and_accumulators)
from mrv2.utils.kernel_flags import FASTMATH

_SCALE_BLOCK = 8  # groups whose scale * d is formed as one vector


def _int16_dot16(builder, w, x, x86):
    """<16 x i16> weights and activations -> <8 x i32>, lane j = products 2j and 2j + 1."""
    if x86:
        return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", V8I, [w, x])
    return pair_sums(builder, builder.mul(builder.sext(w, V16I), builder.sext(x, V16I)), 16)


def _make_int16_dots(nb, layout, x86):
    """An intrinsic (xq, dx, q, scales, mins, xsum, r, m0) -> UniTuple(float32, nb): for rows
    m0..m0+nb-1 of x quantized (xq int16 [M, K], dx float32 [M, K // 32]),
    sum_k dx * xq * scale(r, k) * q(r, k), plus sum_g mins[r, g] * xsum[m, g] when `mins` has
    columns. `layout`: "u4" (a group of 32 in 16 bytes), "i8" (groups of 32), "i8/16" (int8
    weights in groups of 16, Q6_K's): a unit is 32 inputs, one block of x."""
    packed, gs16 = layout == "u4", layout == "i8/16"

    @intrinsic
    def dots(typingctx, xq, dx, q, scales, mins, xsum, r, m0):
        ret = types.UniTuple(types.float32, nb)

        def codegen(context, builder, signature, args):
            xqt, dxt, qt, st, mnt, xst, rt, mt = signature.args
            r_, m_ = (context.cast(builder, v, t, types.intp)
                      for v, t in ((args[6], rt), (args[7], mt)))
            ity = r_.type
            qrow, _ = row_ptr(context, builder, qt, args[2], r_, I8)
            srow, _ = row_ptr(context, builder, st, args[3], r_, table_elem(st))
            mrow, _ = row_ptr(context, builder, mnt, args[4], r_, table_elem(mnt))
            xrows, k, accs = x_rows_and_accumulators(context, builder, xqt, args[0], m_, nb,
                                                     DOT_UNROLL, I16)
            drows, srows = ([row_ptr(context, builder, t, arr, builder.add(m_, ity(i)), F32)[0]
                             for i in range(nb)] for t, arr in ((dxt, args[1]), (xst, args[5])))
            # per row of x, scale * d of the current 8 groups (the vector path's lanes)
            blocks = [cgutils.alloca_once(builder, V8F) for _ in range(nb)]

            def weights(c):
                """The unit's 32 weights as two <16 x i16> (inputs 0-15, 16-31)."""
                if packed:  # low nibbles are inputs 0-15, high nibbles 16-31
                    # Widened by interleaving with zero bytes: a zext would be narrowed back
                    # (LLVM moves the split before it: two byte splits, two widenings).
                    raw = vload(builder, qrow, builder.mul(c, ity(16)), V16B, 1)
                    b = builder.bitcast(builder.shuffle_vector(
                        raw, ir.Constant(V16B, [0] * 16),
                        ir.Constant(ir.VectorType(I32, 32), [v for j in range(16)
                                                              for v in (j, 16)])), V16S)
                    return (builder.and_(b, ir.Constant(V16S, [15] * 16)),
                            builder.lshr(b, ir.Constant(V16S, [4] * 16)))
                return tuple(builder.sext(vload(builder, qrow, builder.add(
                    builder.mul(c, ity(32)), ity(16 * h)), V16B, 1), V16S) for h in range(2))

            def unit(c, slot, scale_of):
                w = weights(c)
                base = builder.mul(c, ity(32))
                for i in range(nb):
                    halves = [_int16_dot16(builder, w[h], vload(builder, xrows[i][0], builder.add(
                        base, ity(16 * h)), V16S, 2), x86) for h in range(2)]
                    if gs16:  # one scale per half
                        step = None
                        for h in range(2):
                            t = builder.fmul(builder.sitofp(halves[h], V8F),
                                             scale_of(i, c, h), flags=FAST)
                            step = t if step is None else builder.fadd(step, t, flags=FAST)
                    else:
                        step = builder.fmul(builder.sitofp(builder.add(*halves), V8F),
                                            scale_of(i, c, 0), flags=FAST)
                    acc = builder.load(accs[i][slot])
                    builder.store(builder.fadd(acc, step, flags=FAST), accs[i][slot])

            def scalar_scale(i, c, h):
                g = builder.add(builder.mul(c, ity(2)), ity(h)) if gs16 else c
                s = load_table(builder, srow, g, st)
                d = builder.load(builder.gep(drows[i], [c]))
                return splat(builder, builder.fmul(s, d, flags=FAST))

            def lane_scale(i, c, h):
                lane = builder.trunc(builder.srem(c, ity(_SCALE_BLOCK)), I32)
                return splat(builder, builder.extract_element(builder.load(blocks[i]), lane))

            units = builder.sdiv(k, ity(32))
            # the vector path for whole blocks of 8 groups (gs16 units have two groups: scalar)
            whole = ity(0) if gs16 else builder.sdiv(units, ity(_SCALE_BLOCK))
            with cgutils.for_range(builder, whole) as loop:
                g0 = builder.mul(loop.index, ity(_SCALE_BLOCK))
                if st.dtype == types.int16:
                    sv = widen_half(builder, vload(builder, srow, g0, V8H, 2), False)
                else:
                    sv = vload(builder, srow, g0, V8F, 4)
                for i in range(nb):
                    builder.store(builder.fmul(sv, vload(builder, drows[i], g0, V8F, 4),
                                               flags=FAST), blocks[i])
                for j in range(_SCALE_BLOCK):
                    unit(builder.add(g0, ity(j)), j % DOT_UNROLL, lane_scale)
            done = builder.mul(whole, ity(_SCALE_BLOCK))
            with cgutils.for_range(builder, builder.sub(units, done)) as loop:
                unit(builder.add(done, loop.index), 0, scalar_scale)
            sums = sums_with_min_terms(context, builder, mnt, args[4], mrow, srows, accs)
            return context.make_tuple(builder, ret, sums)

        return ret(xq, dx, q, scales, mins, xsum, r, m0), codegen

    return dots


_DOTS = {layout: tuple(_make_int16_dots(n, layout, X86_INT8_DOTS) for n in DOT_ROWS)
         for layout in ("u4", "i8", "i8/16")}
_u4_dots4, _u4_dots2, _u4_dots1 = _DOTS["u4"]
_i8_dots4, _i8_dots2, _i8_dots1 = _DOTS["i8"]
_i8g16_dots4, _i8g16_dots2, _i8g16_dots1 = _DOTS["i8/16"]


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _dots4(xq, dx, q, scales, mins, xsum, packed, shift, r, m0):
    if packed:
        return _u4_dots4(xq, dx, q, scales, mins, xsum, r, m0)
    if shift == 4:
        return _i8g16_dots4(xq, dx, q, scales, mins, xsum, r, m0)
    return _i8_dots4(xq, dx, q, scales, mins, xsum, r, m0)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _dots2(xq, dx, q, scales, mins, xsum, packed, shift, r, m0):
    if packed:
        return _u4_dots2(xq, dx, q, scales, mins, xsum, r, m0)
    if shift == 4:
        return _i8g16_dots2(xq, dx, q, scales, mins, xsum, r, m0)
    return _i8_dots2(xq, dx, q, scales, mins, xsum, r, m0)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _dots1(xq, dx, q, scales, mins, xsum, packed, shift, r, m0):
    if packed:
        return _u4_dots1(xq, dx, q, scales, mins, xsum, r, m0)
    if shift == 4:
        return _i8g16_dots1(xq, dx, q, scales, mins, xsum, r, m0)
    return _i8_dots1(xq, dx, q, scales, mins, xsum, r, m0)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_rows_int16(xq, dx, q, scales, mins, xsum, packed, shift, r, m0, out):
    """Rows m0.. of the int16 x (4, 2 or 1, as many as are left) against weight row r;
    returns how many."""
    left = xq.shape[0] - m0
    if left >= 4:
        t4 = _dots4(xq, dx, q, scales, mins, xsum, packed, shift, r, m0)
        for i in range(4):
            out[m0 + i, r] = t4[i]
        return 4
    if left >= 2:
        t2 = _dots2(xq, dx, q, scales, mins, xsum, packed, shift, r, m0)
        out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
        return 2
    out[m0, r] = _dots1(xq, dx, q, scales, mins, xsum, packed, shift, r, m0)[0]
    return 1


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_row_int16(xq, dx, q, scales, mins, xsum, packed, shift, r, m, out):
    """out[m, r]: row m of the int16 x against weight row r alone (a one-row GEMV's loop)."""
    out[m, r] = _dots1(xq, dx, q, scales, mins, xsum, packed, shift, r, m)[0]
