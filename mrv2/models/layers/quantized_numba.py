"""The numba kernels behind quantized.py: GEMV and row dequantization on the packed layouts.

Layouts (quantized.py builds them from GGUF blocks and owns the contract):
- "u4": `q` uint8 [N, K // 2]; group g of row r covers inputs [32 g, 32 g + 32) and is stored in
  bytes [16 g, 16 g + 16): byte j holds input 32 g + j in its low nibble and 32 g + 16 + j in its
  high nibble. w = scale * q + min.
- "i8": `q` int8 [N, K]; groups of `gs` (32, or 16 for Q6_K) consecutive inputs; w = scale * q
  (+ min).
`scales` and `mins` are [N, K // G] tables of float32, or of int16 holding float16 bit patterns
(widened as they are read: vector_ir's `table_value` in numba code, `load_table` in the IR);
`mins` may be an [N, 0] array for "no min term" (so that one compiled kernel serves both).

GEMV (decode, a few rows of x): the inner loop is LLVM vector IR emitted by a numba intrinsic
(`_make_dots`), not numba loops. Why: LLVM does not vectorise the 16- and 32-wide group loops
numba lowers (they are fully unrolled first, and SLP then stops at possible aliasing between the
packed bytes and a scratch row, or at numba's negative-index wraparound selects), and numba
widens integer arithmetic to int64, which AVX2 cannot convert to float in vectors: the old
kernel decoded the 4-bit values through scalar cvtsi2ss / table loads (bench/README.md). Every
8 bytes are zero- (u4) or sign-extended (i8) straight to <8 x i32>, split into nibbles with a
vector and / shift, converted with one vcvtdq2ps per 8 weights and multiplied into <8 x float>
accumulators (vfmadd on ymm; generic LLVM vectors, so AVX-512 machines get the same code), two
accumulator sets per row of x to hide the FMA latency. The scale multiplies each group's partial
products (sum_g s_g sum_j q_j x_j), and the min term is sum_g min_g * sum_j x_j with the group
sums of x computed once per call. Each weight row is read once for up to 4 rows of x
(`DOT_ROWS`), in chunks of GEMV_CHUNK_ROWS weight rows over numba's threads.

Dequantization (embedding lookups, prefill tiles) keeps the numba row decoder: it is exact
(bit-equal to gguf.quants.dequantize) and not on the decode-step critical path.
Invariants the callers (quantized.py) check: K % G == 0, x rows contiguous, ids within [0, N).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from mrv2.models.layers.quantized_int8_numba import (INT8_BLOCK, gemv_rows_int8, group_sums,
                                                     quantize_rows)
from mrv2.models.layers.quantized_int16_numba import gemv_row_int16, gemv_rows_int16
from mrv2.models.layers.quantized_vnni_numba import (VNNI_DOTS, gemv_row_vnni, gemv_rows_vnni,
                                                    offset_terms)
from mrv2.models.layers.vector_ir import (DOT_ROWS, DOT_UNROLL, FAST, I8, V8B, V8F,
                                          V8I, for_each_unit, load_table, row_ptr, splat,
                                          sum_accumulators, table_elem, table_value, vload,
                                          x_rows_and_accumulators)
from mrv2.utils.kernel_flags import FASTMATH

GEMV_CHUNK_ROWS = 16  # weight rows per parallel task of the GEMV
# How gemv_groups takes x (`x_format`): as float32, or quantized per 32 inputs to int16
# (quantized_int16_numba) or int8 (quantized_int8_numba) and multiplied in integer SIMD.
X_FLOAT32, X_INT16, X_INT8 = 0, 1, 2
# x up to this many bytes is read whole by every weight row (from L1: 32 KiB on x86 cores, room
# left for the weight rows); a larger x in blocks of 4 rows (gemv_groups).
X_IN_L1_BYTES = 24 * 1024
# Nibble values of every byte as float32: numba widens integer ops to int64, and AVX2 has no
# vector int64 -> float conversion, so `float(b & 15)` runs scalar; two table loads are cheaper.
NIBBLE_LO = (np.arange(256) & 15).astype(np.float32)
NIBBLE_HI = (np.arange(256) >> 4).astype(np.float32)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _decode_row(q, scales, mins, packed, gs, r, buf):
    # buf[:K] = float32 weight row r: w = scale * q + min, where scale * q is exact in float32
    # (an f16-derived scale times a < 8-bit integer), so one rounding, as in the reference.
    # Contiguous group loops with no reduction: the float conversion and FMA vectorise.
    has_min = mins.shape[1] > 0
    for g in range(scales.shape[1]):
        s = table_value(scales, r, g)
        mn = table_value(mins, r, g) if has_min else np.float32(0.0)
        if packed:
            base = g * 16
            for j in range(16):
                b = q[r, base + j]
                buf[2 * base + j] = s * NIBBLE_LO[b] + mn
                buf[2 * base + 16 + j] = s * NIBBLE_HI[b] + mn
        else:
            base = g * gs
            for j in range(gs):
                buf[base + j] = s * np.float32(q[r, base + j]) + mn


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def dequant_rows(q, scales, mins, packed, gs, ids, out):
    """out[i, :] = the float32 weight row ids[i] (bit-equal to gguf.quants.dequantize)."""
    for i in prange(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])


@njit(fastmath=FASTMATH, cache=True)
def dequant_rows_serial(q, scales, mins, packed, gs, ids, out):
    """dequant_rows on the calling thread: the tiled linear alternates it with torch.mm, and
    handing each tile between numba's and torch's thread pools stalls for a scheduler quantum
    whenever another process holds a core."""
    for i in range(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])


def _make_dots(nb, packed):
    """An intrinsic (x, q, scales, shift, r, m0) -> UniTuple(float32, nb): for rows m0..m0+nb-1
    of x, sum_k x[m, k] * scale(r, k) * q(r, k) (no min term). u4: a unit is one 32-input group;
    i8: 16 inputs, whose scale is scales[r, unit >> (shift - 4)] (gs = 1 << shift)."""

    @intrinsic
    def dots(typingctx, x, q, scales, shift, r, m0):
        ret = types.UniTuple(types.float32, nb)

        def codegen(context, builder, signature, args):
            xt, qt, st, sht, rt, mt = signature.args
            r_, m_, sh = (context.cast(builder, v, t, types.intp)
                          for v, t in ((args[4], rt), (args[5], mt), (args[3], sht)))
            ity = r_.type
            qrow, _ = row_ptr(context, builder, qt, args[1], r_, I8)
            srow, _ = row_ptr(context, builder, st, args[2], r_, table_elem(st))
            xrows, k, accs = x_rows_and_accumulators(context, builder, xt, args[0], m_, nb,
                                                     DOT_UNROLL)
            step = 32 if packed else 16

            def unit(c, slot):
                halves = [builder.zext(b, V8I) if packed else builder.sext(b, V8I) for b in (
                    vload(builder, qrow, builder.add(builder.mul(c, ity(16)), ity(8 * h)),
                          V8B, 1) for h in range(2))]
                if packed:  # inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles)
                    s = load_table(builder, srow, c, st)
                    ints = [builder.and_(v, ir.Constant(V8I, [15] * 8)) for v in halves] + [
                        builder.lshr(v, ir.Constant(V8I, [4] * 8)) for v in halves]
                else:
                    s = load_table(builder, srow, builder.ashr(c, builder.sub(sh, ity(4))), st)
                    ints = halves
                ws = [builder.sitofp(v, V8F) for v in ints]
                ss, base = splat(builder, s), builder.mul(c, ity(step))
                for i in range(nb):
                    p = None
                    for j, w in enumerate(ws):
                        t = builder.fmul(w, vload(builder, xrows[i][0],
                                                   builder.add(base, ity(8 * j)), V8F, 4),
                                         flags=FAST)
                        p = t if p is None else builder.fadd(p, t, flags=FAST)
                    acc = builder.load(accs[i][slot])
                    builder.store(builder.fadd(acc, builder.fmul(ss, p, flags=FAST),
                                               flags=FAST), accs[i][slot])

            for_each_unit(builder, builder.sdiv(k, ity(step)), DOT_UNROLL, unit)
            sums = [sum_accumulators(builder, row_accs) for row_accs in accs]
            return context.make_tuple(builder, ret, sums)

        return ret(x, q, scales, shift, r, m0), codegen

    return dots


_u4_dots4, _u4_dots2, _u4_dots1 = (_make_dots(n, True) for n in DOT_ROWS)
_i8_dots4, _i8_dots2, _i8_dots1 = (_make_dots(n, False) for n in DOT_ROWS)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _gemv_rows(x, q, scales, packed, shift, r, m0, out):
    """Rows m0.. of x (4, 2 or 1 of them, as many as are left) against weight row r; returns
    how many."""
    left = x.shape[0] - m0
    if left >= 4:
        t4 = (_u4_dots4(x, q, scales, shift, r, m0) if packed
              else _i8_dots4(x, q, scales, shift, r, m0))
        for i in range(4):
            out[m0 + i, r] = t4[i]
        return 4
    if left >= 2:
        t2 = (_u4_dots2(x, q, scales, shift, r, m0) if packed
              else _i8_dots2(x, q, scales, shift, r, m0))
        out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
        return 2
    t1 = (_u4_dots1(x, q, scales, shift, r, m0) if packed
          else _i8_dots1(x, q, scales, shift, r, m0))
    out[m0, r] = t1[0]
    return 1


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _rows_against(x, xq, xq16, dx, terms, q, scales, mins, xsum, packed, shift, x_format, r,
                  m0, out):
    """Rows m0.. of x (float32; or int16 / int8 with the min term inside) against weight row
    r. Int8 x in 32-input groups takes VNNI's kernel where the host has it."""
    if x_format == X_INT8:
        if VNNI_DOTS and shift == 5:
            return gemv_rows_vnni(xq, dx, terms, q, scales, mins, xsum, packed, r, m0, out)
        return gemv_rows_int8(xq, dx, q, scales, mins, xsum, packed, shift, r, m0, out)
    if x_format == X_INT16:
        return gemv_rows_int16(xq16, dx, q, scales, mins, xsum, packed, shift, r, m0, out)
    return _gemv_rows(x, q, scales, packed, shift, r, m0, out)


@njit(fastmath=FASTMATH, cache=True)
def gemv_groups(x, q, scales, mins, packed, gs, x_format, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for the packed weight (x [M, K] contiguous rows;
    gs 32, or 16 for an i8 weight). X_FLOAT32: fp32 sums in another order than x @ w.T (~1e-7
    relative); X_INT16 / X_INT8: x quantized per 32 inputs first (their modules' bounds).

    One parallel function per x format, each the same body with the format a constant: with
    the format a run-time value every format's kernels sat in one loop nest and each ran
    slower there than alone (bench/README.md has the figures)."""
    if x_format == X_INT16:
        _gemv_int16(x, q, scales, mins, packed, gs, out)
    elif x_format == X_INT8:
        _gemv_int8(x, q, scales, mins, packed, gs, out)
    else:
        _gemv_float32(x, q, scales, mins, packed, gs, out)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _gemv_int16(x, q, scales, mins, packed, gs, out):
    _gemv_body(x, q, scales, mins, packed, gs, X_INT16, out)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _gemv_int8(x, q, scales, mins, packed, gs, out):
    _gemv_body(x, q, scales, mins, packed, gs, X_INT8, out)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _gemv_float32(x, q, scales, mins, packed, gs, out):
    _gemv_body(x, q, scales, mins, packed, gs, X_FLOAT32, out)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _gemv_body(x, q, scales, mins, packed, gs, x_format, out):
    """gemv_groups for one x format, inlined into that format's parallel function."""
    # The set-up runs in serial helpers: in this parallel function numba would turn each array
    # expression (np.zeros, a slice's .sum()) into a parallel region of its own, a fork and
    # join per group (this once cost more than the GEMV itself).
    m_rows, k_dim = x.shape
    n_dim, groups = q.shape[0], scales.shape[1]
    has_min = mins.shape[1] > 0
    shift = 5 if gs == 32 else 4
    xsum = group_sums(x, gs, groups if has_min else 0)
    xq = np.empty((m_rows if x_format == X_INT8 else 0, k_dim), np.int8)
    xq16 = np.empty((m_rows if x_format == X_INT16 else 0, k_dim), np.int16)
    dx = np.empty((m_rows if x_format != X_FLOAT32 else 0, k_dim // INT8_BLOCK), np.float32)
    quantize_rows(x, xq, dx)
    quantize_rows(x, xq16, dx)
    # Int8 x in 32-input groups takes VNNI's kernel where the host has it; one row of it in a
    # loop of its own (beside the other kernels it ran slower). vpdpbusd's unsigned
    # operand is an "i8" weight + 128: its groups' extra terms, per call.
    vnni = VNNI_DOTS and x_format == X_INT8 and shift == 5
    vnni_row = vnni and m_rows == 1
    terms = np.empty((m_rows if vnni and not packed else 0, k_dim // INT8_BLOCK), np.float32)
    offset_terms(xq[:terms.shape[0]], dx, terms)
    x_bytes = m_rows * k_dim * (4 if x_format == X_FLOAT32 else 2 if x_format == X_INT16 else 1)
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    # Weight rows outer, each against all of x, while x fits L1; past that x's rows outer, 4 at
    # a time against each of the task's weight rows: those rows' blocks and the 4 rows of x stay
    # in L1 while every pair is summed (weight rows outer would read all of x from L2 once per
    # weight row). One loop nest serves both orders: _rows_against is inlined at one site per
    # format's function (a second site doubled the compile time); one-row steps of the int16
    # and VNNI kernels run a loop of their own before it.
    block = max(m_rows, 1) if x_bytes <= X_IN_L1_BYTES else 4
    for c in prange(num_chunks):
        r0, r1 = c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)
        if vnni_row:
            for r in range(r0, r1):
                gemv_row_vnni(xq, dx, terms, q, scales, mins, xsum, packed, r, 0, out)
            continue
        if x_format == X_INT16 and m_rows == 1:
            for r in range(r0, r1):
                gemv_row_int16(xq16, dx, q, scales, mins, xsum, packed, shift, r, 0, out)
            continue
        for b0 in range(0, m_rows, block):
            b1 = min(m_rows, b0 + block)
            for r in range(r0, r1):
                m0 = b0
                while m0 < b1:
                    m0 += _rows_against(x, xq, xq16, dx, terms, q, scales, mins, xsum, packed,
                                        shift, x_format, r, m0, out)
        if has_min and x_format == X_FLOAT32:
            for r in range(r0, r1):
                for m in range(m_rows):
                    acc = np.float32(0.0)
                    for g in range(groups):
                        acc += table_value(mins, r, g) * xsum[m, g]
                    out[m, r] += acc
