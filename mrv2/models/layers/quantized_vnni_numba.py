"""AVX-512 VNNI for the int8-activation GEMV on GGUF blocks (quantized_int8_numba's format):
64 weights an instruction.

Why: the AVX2 int8 kernel spends per 32 weights a vpmaddubsw, a vpmaddwd against ones and
(for signed weights) a vpsignb and a vpabsb on 256-bit vectors; `vpdpbusd` on 512 bits sums
u8 x s8 products four to a 32-bit lane, accumulating, in one instruction for 64 weights (two
groups of 32: lanes 0-7 hold the first group, 8-15 the second). The group scales (times x's d)
are formed 8 groups a vector and spread to the two halves by one permute; one conversion and
one FMA per 64 weights follow.

vpdpbusd multiplies an unsigned byte by a signed one:
- "u4" weights (0..15) are the unsigned operand as they are; x's int8 the signed one.
- "i8" weights are signed: they enter as w + 128 (bits flipped at the top: w ^ 0x80, an
  unsigned 0..255), so each group's integer sum is sum w q + 128 sum q; the extra term is
  removed in float after the units, per group: scale * d * (-128 * sum_g q), the per-call
  `offset_terms` of x, 8 groups a vector like the min term (which follows the same loop).
The integer part is exact: a lane sums four products of at most 255 * 127 (no saturation in
vpdpbusd). Numerics: those of the int8 format (quantized_int8_numba's bound: x's rounding);
the float sums differ from the AVX2 kernel's only in order (the module's test holds the two to
each other; the int8 format's bound test runs through this kernel where the host has VNNI).

Rows of x 4, 2 or 1 at a time against a weight row (a unit's weights loaded once for them),
32-input groups (not Q6_K's 16), where numba compiles for a host with AVX-512 VNNI and BW
(`VNNI_DOTS`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2 import cpu_caps
from mrv2.models.layers.vector_ir import (DOT_UNROLL, FAST, F32, I8, I32, V8F, V8H, V16F,
                                          V16I, V32B, V32S, add_group_terms, call_intrinsic,
                                          load_table, row_ptr, splat, sum_accumulators,
                                          table_elem, vload, widen_half)
from mrv2.utils.kernel_flags import FASTMATH

_V64B = ir.VectorType(I8, 64)
_V8I = ir.VectorType(I32, 8)
_GROUPS = 8  # groups whose scale * d is formed as one vector (4 units of 64 weights)


# numba compiles for this host and it has AVX-512 VNNI (with BW, for the byte shuffles).
VNNI_DOTS = cpu_caps.caps().vnni_dots


def _weights64(builder, qrow, unit, packed, ity):
    """Unit `unit`'s 64 weights (groups 2u, 2u + 1) as the unsigned operand: u4 nibbles
    (inputs 0-15 low, 16-31 high, per 16 bytes) spread to one byte each; i8 values + 128."""
    if packed:
        raw = vload(builder, qrow, builder.mul(unit, ity(32)), V32B, 1)
        spread = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(I32, 64), [
            j for half in (range(16), range(16, 32)) for _ in range(2) for j in half]))
        shifts = ir.Constant(V32S, ([0] * 8 + [4] * 8) * 2)
        shifted = builder.bitcast(builder.lshr(builder.bitcast(spread, V32S), shifts), _V64B)
        return builder.and_(shifted, ir.Constant(_V64B, [15] * 64))
    w = vload(builder, qrow, builder.mul(unit, ity(64)), _V64B, 1)
    return builder.xor(w, ir.Constant(_V64B, [-128] * 64))


def _weights32(builder, qrow, group, packed, ity):
    """One group's 32 weights as the unsigned operand (the tail past whole units)."""
    if packed:
        raw = vload(builder, qrow, builder.mul(group, ity(16)), ir.VectorType(I8, 16), 1)
        lo = builder.and_(raw, ir.Constant(ir.VectorType(I8, 16), [15] * 16))
        hi = builder.lshr(raw, ir.Constant(ir.VectorType(I8, 16), [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32),
                                                    list(range(32))))
    w = vload(builder, qrow, builder.mul(group, ity(32)), V32B, 1)
    return builder.xor(w, ir.Constant(V32B, [-128] * 32))


def _scale_vector(builder, srow, st, drow, g0):
    """<8 x float> scale * d of groups g0..g0+7."""
    if st.dtype == types.int16:
        sv = widen_half(builder, vload(builder, srow, g0, V8H, 2), False)
    else:
        sv = vload(builder, srow, g0, V8F, 4)
    return builder.fmul(sv, vload(builder, drow, g0, V8F, 4), flags=FAST)


def _make_vnni_dots(nb: int):
    """An intrinsic (xq, dx, terms, q, scales, mins, xsum, packed, r, m0) -> UniTuple(float32,
    nb): for rows m0..m0+nb-1 of x (int8 [M, K], dx [M, K // 32]) sum_k d * xq * scale(r, k) *
    q(r, k), the "i8" offset removed with `terms` ([M, K // 32]: -128 * d * sum_g xq; no rows
    for "u4"), plus sum_g mins[r, g] * xsum[m, g] when `mins` has columns. A unit's weights are
    loaded (and made unsigned) once for the nb rows. `packed` must be a literal."""

    @intrinsic
    def dots(typingctx, xq, dx, terms, q, scales, mins, xsum, packed, r, m0):
        if not isinstance(packed, types.BooleanLiteral):
            return None
        ret = types.UniTuple(types.float32, nb)

        def codegen(context, builder, signature, args):
            xqt, dxt, tt, qt, st, mnt, xst, _, rt, mt = signature.args
            is_u4 = packed.literal_value
            r_, m_ = (context.cast(builder, v, t, types.intp)
                      for v, t in ((args[8], rt), (args[9], mt)))
            ity = r_.type
            ms = [builder.add(m_, ity(i)) for i in range(nb)]
            qrow, _ = row_ptr(context, builder, qt, args[3], r_, I8)
            srow, _ = row_ptr(context, builder, st, args[4], r_, table_elem(st))
            xrows = [row_ptr(context, builder, xqt, args[0], m, I8) for m in ms]
            drows = [row_ptr(context, builder, dxt, args[1], m, F32)[0] for m in ms]
            k = cgutils.unpack_tuple(builder, xrows[0][1].shape, 2)[1]
            groups = builder.sdiv(k, ity(32))
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16))
                     for _ in range(2)] for _ in range(nb)]

            def dpbusd(w, x, lanes):
                vty = V16I if lanes == 16 else _V8I
                return call_intrinsic(builder, f"llvm.x86.avx512.vpdpbusd.{lanes * 32}", vty,
                                      [ir.Constant(vty, [0] * lanes), w, x])

            whole = builder.sdiv(groups, ity(_GROUPS))
            with cgutils.for_range(builder, whole) as loop:
                g0 = builder.mul(loop.index, ity(_GROUPS))
                svs = [_scale_vector(builder, srow, st, d, g0) for d in drows]
                for u in range(_GROUPS // 2):
                    unit = builder.add(builder.sdiv(g0, ity(2)), ity(u))
                    w = _weights64(builder, qrow, unit, is_u4, ity)
                    for i in range(nb):
                        x = vload(builder, xrows[i][0], builder.mul(unit, ity(64)), _V64B, 1)
                        sums = builder.sitofp(dpbusd(w, x, 16), V16F)
                        spread = builder.shuffle_vector(svs[i], svs[i], ir.Constant(
                            ir.VectorType(I32, 16), [2 * u] * 8 + [2 * u + 1] * 8))
                        acc = accs[i][u % 2]
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(
                            sums, spread, flags=FAST), flags=FAST), acc)
            # Each row's two 16-lane accumulators folded to 8 lanes, plus a second zeroed
            # slot: the per-group terms below add 8 groups a vector into DOT_UNROLL slots.
            row_accs = []
            for i in range(nb):
                total = builder.fadd(builder.load(accs[i][0]), builder.load(accs[i][1]),
                                     flags=FAST)
                halves = [builder.shuffle_vector(total, total, ir.Constant(
                    _V8I, list(range(h, h + 8)))) for h in (0, 8)]
                row_accs.append([cgutils.alloca_once_value(builder, builder.fadd(
                    *halves, flags=FAST))] + [cgutils.alloca_once_value(builder, ir.Constant(
                        V8F, [0.0] * 8)) for _ in range(DOT_UNROLL - 1)])
            done = builder.mul(whole, ity(_GROUPS))
            with cgutils.for_range(builder, builder.sub(groups, done)) as loop:
                g = builder.add(done, loop.index)
                w = _weights32(builder, qrow, g, is_u4, ity)
                scale = load_table(builder, srow, g, st)
                for i in range(nb):
                    x = vload(builder, xrows[i][0], builder.mul(g, ity(32)), V32B, 1)
                    d = builder.fmul(scale, builder.load(builder.gep(drows[i], [g])), flags=FAST)
                    step = builder.fmul(builder.sitofp(dpbusd(w, x, 8), V8F), splat(builder, d),
                                        flags=FAST)
                    builder.store(builder.fadd(builder.load(row_accs[i][0]), step, flags=FAST),
                                  row_accs[i][0])
            # Per-group float terms: the min term, then (i8) the offset, scale * terms.
            mrow, _ = row_ptr(context, builder, mnt, args[5], r_, table_elem(mnt))
            term_tables = [(mnt, args[5], mrow, xst, args[6])]
            if not is_u4:
                term_tables.append((st, args[4], srow, tt, args[2]))
            scalars = []
            for table_t, table, trow, vt, values in term_tables:
                value_rows = [row_ptr(context, builder, vt, values, m, F32)[0] for m in ms]
                scalars.append(add_group_terms(context, builder, table_t, table, trow,
                                               value_rows, row_accs))
            results = []
            for i in range(nb):
                result = sum_accumulators(builder, row_accs[i])
                for tails in scalars:
                    result = builder.fadd(result, builder.load(tails[i]), flags=FAST)
                results.append(result)
            return context.make_tuple(builder, ret, results)

        return ret(xq, dx, terms, q, scales, mins, xsum, packed, r, m0), codegen

    return dots


_vnni_dots4, _vnni_dots2, _vnni_dots1 = (_make_vnni_dots(n) for n in (4, 2, 1))


@njit(cache=True)
def offset_terms(xq, dx, out):
    """out[m, g] = -128 * dx[m, g] * sum of xq[m] over group g: what an "i8" weight's + 128
    adds to each group's sum, in x's units (the VNNI dots)."""
    for m in range(xq.shape[0]):
        for g in range(dx.shape[1]):
            s = 0
            for j in range(32 * g, 32 * g + 32):
                s += np.int32(xq[m, j])
            out[m, g] = np.float32(-128.0) * dx[m, g] * np.float32(s)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_row_vnni(xq, dx, terms, q, scales, mins, xsum, packed, r, m, out):
    """out[m, r]: row m of the int8 x against weight row r alone (a one-row GEMV's loop)."""
    if packed:
        out[m, r] = _vnni_dots1(xq, dx, terms, q, scales, mins, xsum, True, r, m)[0]
    else:
        out[m, r] = _vnni_dots1(xq, dx, terms, q, scales, mins, xsum, False, r, m)[0]


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _vnni_rows(xq, dx, terms, q, scales, mins, xsum, packed, r, m0, out):
    """`gemv_rows_vnni` for a literal `packed`."""
    left = xq.shape[0] - m0
    if left >= 4:
        t4 = _vnni_dots4(xq, dx, terms, q, scales, mins, xsum, packed, r, m0)
        for i in range(4):
            out[m0 + i, r] = t4[i]
        return 4
    if left >= 2:
        t2 = _vnni_dots2(xq, dx, terms, q, scales, mins, xsum, packed, r, m0)
        out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
        return 2
    out[m0, r] = _vnni_dots1(xq, dx, terms, q, scales, mins, xsum, packed, r, m0)[0]
    return 1


@njit(inline="always", fastmath=FASTMATH, cache=True)
def gemv_rows_vnni(xq, dx, terms, q, scales, mins, xsum, packed, r, m0, out):
    """Rows m0.. of the int8 x (4, 2 or 1, as many as are left) against weight row r; returns
    how many."""
    if packed:
        return _vnni_rows(xq, dx, terms, q, scales, mins, xsum, True, r, m0, out)
    return _vnni_rows(xq, dx, terms, q, scales, mins, xsum, False, r, m0, out)
