"""The numba kernels behind quantized.py: GEMV and row dequantization on the packed layouts.

Layouts (quantized.py builds them from GGUF blocks and owns the contract):
- "u4": `q` uint8 [N, K // 2]; group g of row r covers inputs [32 g, 32 g + 32) and is stored in
  bytes [16 g, 16 g + 16): byte j holds input 32 g + j in its low nibble and 32 g + 16 + j in its
  high nibble. w = scale * q + min.
- "i8": `q` int8 [N, K]; groups of `gs` (32, or 16 for Q6_K) consecutive inputs; w = scale * q
  (+ min).
`scales` and `mins` are [N, K // G] tables of float32, or of int16 holding float16 bit patterns
(widened as they are read: `_table_value` here, `_load_table` in the IR); `mins` may be an
[N, 0] array for "no min term" (so that one compiled kernel serves both).

GEMV (decode, a few rows of x): the inner loop is LLVM vector IR emitted by a numba intrinsic
(`_make_dots`), not numba loops. Why: LLVM does not vectorise the 16- and 32-wide group loops
numba lowers (they are fully unrolled first, and SLP then stops at possible aliasing between the
packed bytes and a scratch row, or at numba's negative-index wraparound selects), and numba
widens integer arithmetic to int64, which AVX2 cannot convert to float in vectors: the old
kernel decoded the 4-bit values through scalar cvtsi2ss / table loads at 2-6 GB/s. Here every
8 bytes are zero- (u4) or sign-extended (i8) straight to <8 x i32>, split into nibbles with a
vector and / shift, converted with one vcvtdq2ps per 8 weights and multiplied into <8 x float>
accumulators (vfmadd on ymm; generic LLVM vectors, so AVX-512 machines get the same code), two
accumulator sets per row of x to hide the FMA latency. The scale multiplies each group's partial
products (sum_g s_g sum_j q_j x_j), and the min term is sum_g min_g * sum_j x_j with the group
sums of x computed once per call. Each weight row is read once for up to 4 rows of x
(`_DOT_ROWS`), in chunks of GEMV_CHUNK_ROWS weight rows over numba's threads.

Dequantization (embedding lookups, prefill tiles) keeps the numba row decoder: it is exact
(bit-equal to gguf.quants.dequantize) and not on the decode-step critical path.
Invariants the callers (quantized.py) check: K % G == 0, x rows contiguous, ids within [0, N).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

GEMV_CHUNK_ROWS = 16  # weight rows per parallel task of the GEMV
# Nibble values of every byte as float32: numba widens integer ops to int64, and AVX2 has no
# vector int64 -> float conversion, so `float(b & 15)` runs scalar; two table loads are cheaper.
NIBBLE_LO = (np.arange(256) & 15).astype(np.float32)
NIBBLE_HI = (np.arange(256) >> 4).astype(np.float32)


@njit(inline="always", fastmath=True, cache=True)
def _decode_row(q, scales, mins, packed, gs, r, buf):
    # buf[:K] = float32 weight row r: w = scale * q + min, where scale * q is exact in float32
    # (an f16-derived scale times a < 8-bit integer), so one rounding, as in the reference.
    # Contiguous group loops with no reduction: the float conversion and FMA vectorise.
    has_min = mins.shape[1] > 0
    for g in range(scales.shape[1]):
        s = _table_value(scales, r, g)
        mn = _table_value(mins, r, g) if has_min else np.float32(0.0)
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


@njit(parallel=True, fastmath=True, cache=True)
def dequant_rows(q, scales, mins, packed, gs, ids, out):
    """out[i, :] = the float32 weight row ids[i] (bit-equal to gguf.quants.dequantize)."""
    for i in prange(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])


@njit(fastmath=True, cache=True)
def dequant_rows_serial(q, scales, mins, packed, gs, ids, out):
    """dequant_rows on the calling thread: the tiled linear alternates it with torch.mm, and
    handing each tile between numba's and torch's thread pools stalls for a scheduler quantum
    whenever another process holds a core."""
    for i in range(ids.shape[0]):
        _decode_row(q, scales, mins, packed, gs, ids[i], out[i])


_F32, _I8, _I16, _I32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V8F, _V8B, _V8I = ir.VectorType(_F32, 8), ir.VectorType(_I8, 8), ir.VectorType(_I32, 8)
_FAST = ("fast",)
_DOT_UNROLL = 2  # accumulator sets per row of x (FMA latency 4-5 cycles, 2 FMA pipes)


def _splat(builder, value):
    v = builder.insert_element(ir.Constant(_V8F, ir.Undefined), value, _I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(_V8I, [0] * 8))


def _hsum(builder, v):
    width = 8
    while width > 1:
        width //= 2
        mask = ir.VectorType(_I32, width)
        lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width, 2 * width))))
        v = builder.fadd(lo, hi, flags=_FAST)
    return builder.extract_element(v, _I32(0))


def _row_ptr(context, builder, array_type, array, row, elem):
    """Pointer (to `elem`) at row `row` of a C-contiguous-rows array, and the array struct."""
    arr = context.make_array(array_type)(context, builder, array)
    stride = cgutils.unpack_tuple(builder, arr.strides, array_type.ndim)[0]
    base = builder.gep(builder.bitcast(arr.data, _I8.as_pointer()), [builder.mul(row, stride)])
    return builder.bitcast(base, elem.as_pointer()), arr


def _vload(builder, ptr, index, vty, align):
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), vty.as_pointer()), align=align)


def _table_elem(array_type):
    """The IR element type of a scale / min table: float, or i16 for float16 bit patterns."""
    return _I16 if array_type.dtype == types.int16 else _F32


def _load_table(builder, row_ptr, index, array_type):
    """Element `index` of a table row as a float."""
    value = builder.load(builder.gep(row_ptr, [index]))
    return _widen_half(builder, value, False) if array_type.dtype == types.int16 else value


@intrinsic
def _f16_bits_to_float(typingctx, bits):
    def codegen(context, builder, signature, args):
        return _widen_half(builder, args[0], False)
    return types.float32(bits), codegen


def _table_value(table, r, g):
    """table[r, g] as float32 (numba only: see the overload)."""
    raise NotImplementedError("numba only")


@overload(_table_value, inline="always")
def _table_value_overload(table, r, g):
    if table.dtype == types.int16:
        return lambda table, r, g: _f16_bits_to_float(table[r, g])
    return lambda table, r, g: table[r, g]


def _x_rows_and_accumulators(context, builder, xt, x, m0, nb, unroll, elem=_F32):
    """Pointers (to `elem`) to rows m0..m0+nb-1 of x, K, and `unroll` zeroed <8 x float>
    accumulators per row."""
    ity = m0.type
    xrows = [_row_ptr(context, builder, xt, x, builder.add(m0, ity(i)), elem) for i in range(nb)]
    k = cgutils.unpack_tuple(builder, xrows[0][1].shape, 2)[1]
    zero = ir.Constant(_V8F, [0.0] * 8)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(unroll)] for _ in range(nb)]
    return xrows, k, accs


def _for_each_unit(builder, units, unroll, unit):
    """unit(index, slot) for index in [0, units): `unroll` units per loop iteration, each into
    its own accumulator slot (independent FMA chains), then the remainder into slot 0."""
    ity = units.type
    main = builder.sdiv(units, ity(unroll))
    with cgutils.for_range(builder, main) as loop:
        for u in range(unroll):
            unit(builder.add(builder.mul(loop.index, ity(unroll)), ity(u)), u)
    done = builder.mul(main, ity(unroll))
    with cgutils.for_range(builder, builder.sub(units, done)) as loop:
        unit(builder.add(done, loop.index), 0)


def _sum_accumulators(builder, row_accs):
    """One row's accumulators added, then horizontally: a float."""
    v = builder.load(row_accs[0])
    for a in row_accs[1:]:
        v = builder.fadd(v, builder.load(a), flags=_FAST)
    return _hsum(builder, v)


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
            qrow, _ = _row_ptr(context, builder, qt, args[1], r_, _I8)
            srow, _ = _row_ptr(context, builder, st, args[2], r_, _table_elem(st))
            xrows, k, accs = _x_rows_and_accumulators(context, builder, xt, args[0], m_, nb,
                                                      _DOT_UNROLL)
            step = 32 if packed else 16

            def unit(c, slot):
                halves = [builder.zext(b, _V8I) if packed else builder.sext(b, _V8I) for b in (
                    _vload(builder, qrow, builder.add(builder.mul(c, ity(16)), ity(8 * h)),
                           _V8B, 1) for h in range(2))]
                if packed:  # inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles)
                    s = _load_table(builder, srow, c, st)
                    ints = [builder.and_(v, ir.Constant(_V8I, [15] * 8)) for v in halves] + [
                        builder.lshr(v, ir.Constant(_V8I, [4] * 8)) for v in halves]
                else:
                    s = _load_table(builder, srow, builder.ashr(c, builder.sub(sh, ity(4))), st)
                    ints = halves
                ws = [builder.sitofp(v, _V8F) for v in ints]
                ss, base = _splat(builder, s), builder.mul(c, ity(step))
                for i in range(nb):
                    p = None
                    for j, w in enumerate(ws):
                        t = builder.fmul(w, _vload(builder, xrows[i][0],
                                                   builder.add(base, ity(8 * j)), _V8F, 4),
                                         flags=_FAST)
                        p = t if p is None else builder.fadd(p, t, flags=_FAST)
                    acc = builder.load(accs[i][slot])
                    builder.store(builder.fadd(acc, builder.fmul(ss, p, flags=_FAST),
                                               flags=_FAST), accs[i][slot])

            _for_each_unit(builder, builder.sdiv(k, ity(step)), _DOT_UNROLL, unit)
            sums = [_sum_accumulators(builder, row_accs) for row_accs in accs]
            return context.make_tuple(builder, ret, sums)

        return ret(x, q, scales, shift, r, m0), codegen

    return dots


_DOT_ROWS = (4, 2, 1)  # rows of x per pass over a weight row (accumulators fit 16 ymm at 4)
_u4_dots4, _u4_dots2, _u4_dots1 = (_make_dots(n, True) for n in _DOT_ROWS)
_i8_dots4, _i8_dots2, _i8_dots1 = (_make_dots(n, False) for n in _DOT_ROWS)


@njit(inline="always", fastmath=True, cache=True)
def _gemv_row(x, q, scales, packed, shift, r, out):
    m0, m_rows = 0, x.shape[0]
    while m0 < m_rows:
        left = m_rows - m0
        if left >= 4:
            t4 = (_u4_dots4(x, q, scales, shift, r, m0) if packed
                  else _i8_dots4(x, q, scales, shift, r, m0))
            for i in range(4):
                out[m0 + i, r] = t4[i]
            m0 += 4
        elif left >= 2:
            t2 = (_u4_dots2(x, q, scales, shift, r, m0) if packed
                  else _i8_dots2(x, q, scales, shift, r, m0))
            out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
            m0 += 2
        else:
            t1 = (_u4_dots1(x, q, scales, shift, r, m0) if packed
                  else _i8_dots1(x, q, scales, shift, r, m0))
            out[m0, r] = t1[0]
            m0 += 1


# Int8 activations, as llama.cpp multiplies its Q8_0 / Q8_1 activations: each row of x is
# quantized per 32 inputs (d = max |x| / 127, q = round(x / d)) and a unit of 32 weights costs,
# per row of x, one vpmaddubsw (u8 x s8, adjacent products summed in i16), one vpmaddwd against
# ones (-> 8 x i32), one conversion and one FMA, where float activations take four conversions
# and four FMAs. The integer part is exact: a weight is at most 128 in magnitude (a signed one
# enters as |w| with x's sign flipped, vpsignb), |q| <= 127, so a pair sums to <= 32,512 and
# vpmaddubsw never saturates. The one new error is x's rounding, at most d / 2 per input, so an
# output moves by at most sum_g d_g / 2 * sum_{k in g} |w_k| (tests/models/test_quantized.py
# checks this bound). The min term keeps x's exact float group sums: after the units, in
# the same call, 8 groups a vector.
# Where the compile target has no AVX2 the same integers come from generic vector IR
# (sign-extend, multiply, add pairs), which LLVM lowers to what the target has.
_V16B, _V32B = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_V16S, _V32I = ir.VectorType(_I16, 16), ir.VectorType(_I32, 32)
INT8_BLOCK = 32  # inputs per quantization block of x, and per kernel unit


def _compiles_for_avx2() -> bool:
    """Whether numba compiles for this host (no NUMBA_CPU_NAME) and the host has AVX2."""
    import platform as host

    from llvmlite import binding
    from numba.core import config
    if config.CPU_NAME is not None or host.machine().lower() not in ("x86_64", "amd64"):
        return False
    return bool(binding.get_host_cpu_features().get("avx2", False))


X86_INT8_DOTS = _compiles_for_avx2()


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _pair_sums(builder, v, lanes):
    """<2n x i32> -> <n x i32>, lane j = v[2j] + v[2j + 1]."""
    n = lanes // 2
    even, odd = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n),
                                                          list(range(o, lanes, 2))))
                 for o in (0, 1))
    return builder.add(even, odd)


def _int8_dot32(builder, w, x, signed, x86):
    """<32 x i8> weights (unsigned when not `signed`) and <32 x i8> activations -> <8 x i32>,
    lane j = the sum of products 4j .. 4j + 3."""
    if x86:
        if signed:
            x = _call(builder, "llvm.x86.avx2.psign.b", _V32B, [x, w])
            w = _call(builder, "llvm.abs.v32i8", _V32B, [w, ir.Constant(ir.IntType(1), 0)])
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16S, [w, x])
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I,
                     [pairs, ir.Constant(_V16S, [1] * 16)])
    wide = builder.sext(w, _V32I) if signed else builder.zext(w, _V32I)
    products = builder.mul(wide, builder.sext(x, _V32I))
    return _pair_sums(builder, _pair_sums(builder, products, 32), 16)


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
            qrow, _ = _row_ptr(context, builder, qt, args[2], r_, _I8)
            srow, _ = _row_ptr(context, builder, st, args[3], r_, _table_elem(st))
            mrow, marr = _row_ptr(context, builder, mnt, args[4], r_, _table_elem(mnt))
            xrows, k, accs = _x_rows_and_accumulators(context, builder, xqt, args[0], m_, nb,
                                                      _DOT_UNROLL, _I8)
            drows, srows = ([_row_ptr(context, builder, t, arr, builder.add(m_, ity(i)), _F32)[0]
                             for i in range(nb)] for t, arr in ((dxt, args[1]), (xst, args[5])))
            groups_log2 = builder.sub(ity(5), sh)  # i8: groups per unit, log2 (0 or 1)

            def unit(c, slot):
                if packed:  # low nibbles are inputs 0-15, high nibbles 16-31
                    b = _vload(builder, qrow, builder.mul(c, ity(16)), _V16B, 1)
                    w = builder.shuffle_vector(
                        builder.and_(b, ir.Constant(_V16B, [15] * 16)),
                        builder.lshr(b, ir.Constant(_V16B, [4] * 16)),
                        ir.Constant(_V32I, list(range(32))))
                    scale = _splat(builder, _load_table(builder, srow, c, st))
                else:
                    w = _vload(builder, qrow, builder.mul(c, ity(32)), _V32B, 1)
                    first = builder.shl(c, groups_log2)
                    last = builder.add(first, builder.sub(builder.shl(ity(1), groups_log2),
                                                          ity(1)))
                    halves = [_splat(builder, _load_table(builder, srow, g, st))
                              for g in (first, last)]
                    scale = builder.shuffle_vector(*halves, ir.Constant(
                        _V8I, [0, 1, 2, 3, 8, 9, 10, 11]))
                base = builder.mul(c, ity(32))
                for i in range(nb):
                    xv = _vload(builder, xrows[i][0], base, _V32B, 1)
                    sums = builder.sitofp(_int8_dot32(builder, w, xv, not packed, x86), _V8F)
                    d = _splat(builder, builder.load(builder.gep(drows[i], [c])))
                    acc = builder.load(accs[i][slot])
                    step = builder.fmul(sums, builder.fmul(scale, d, flags=_FAST), flags=_FAST)
                    builder.store(builder.fadd(acc, step, flags=_FAST), accs[i][slot])

            _for_each_unit(builder, builder.sdiv(k, ity(32)), _DOT_UNROLL, unit)
            # The min term, 8 groups a vector: sum_g mins[r, g] * xsum[m, g] (no groups, no
            # iterations). The first accumulator slot takes it before the reduction.
            groups = cgutils.unpack_tuple(builder, marr.shape, 2)[1]

            def min_unit(u, slot):
                base = builder.mul(u, ity(8))
                if mnt.dtype == types.int16:
                    mv = _widen_half(builder, _vload(builder, mrow, base, _V8H, 2), False)
                else:
                    mv = _vload(builder, mrow, base, _V8F, 4)
                for i in range(nb):
                    xs = _vload(builder, srows[i], base, _V8F, 4)
                    builder.store(builder.fadd(builder.load(accs[i][slot]),
                                               builder.fmul(mv, xs, flags=_FAST), flags=_FAST),
                                  accs[i][slot])

            _for_each_unit(builder, builder.sdiv(groups, ity(8)), _DOT_UNROLL, min_unit)
            tails = [cgutils.alloca_once_value(builder, _F32(0.0)) for _ in range(nb)]
            tail_start = builder.mul(builder.sdiv(groups, ity(8)), ity(8))
            with cgutils.for_range(builder, builder.sub(groups, tail_start)) as loop:
                g = builder.add(tail_start, loop.index)
                mn = _load_table(builder, mrow, g, mnt)
                for i in range(nb):
                    term = builder.fmul(mn, builder.load(builder.gep(srows[i], [g])),
                                        flags=_FAST)
                    builder.store(builder.fadd(builder.load(tails[i]), term, flags=_FAST),
                                  tails[i])
            sums = [builder.fadd(_sum_accumulators(builder, row_accs), builder.load(tail),
                                 flags=_FAST) for row_accs, tail in zip(accs, tails)]
            return context.make_tuple(builder, ret, sums)

        return ret(xq, dx, q, scales, mins, xsum, shift, r, m0), codegen

    return dots


_u4_int8_dots4, _u4_int8_dots2, _u4_int8_dots1 = (
    _make_int8_dots(n, True, X86_INT8_DOTS) for n in _DOT_ROWS)
_i8_int8_dots4, _i8_int8_dots2, _i8_int8_dots1 = (
    _make_int8_dots(n, False, X86_INT8_DOTS) for n in _DOT_ROWS)


@njit(inline="always", fastmath=True, cache=True)
def _gemv_row_int8(xq, dx, q, scales, mins, xsum, packed, shift, r, out):
    m0, m_rows = 0, xq.shape[0]
    while m0 < m_rows:
        left = m_rows - m0
        if left >= 4:
            t4 = (_u4_int8_dots4(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
                  else _i8_int8_dots4(xq, dx, q, scales, mins, xsum, shift, r, m0))
            for i in range(4):
                out[m0 + i, r] = t4[i]
            m0 += 4
        elif left >= 2:
            t2 = (_u4_int8_dots2(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
                  else _i8_int8_dots2(xq, dx, q, scales, mins, xsum, shift, r, m0))
            out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
            m0 += 2
        else:
            t1 = (_u4_int8_dots1(xq, dx, q, scales, mins, xsum, shift, r, m0) if packed
                  else _i8_int8_dots1(xq, dx, q, scales, mins, xsum, shift, r, m0))
            out[m0, r] = t1[0]
            m0 += 1


@njit(fastmath=True, cache=True)
def quantize_rows_int8(x, xq, dx):
    """x [M, K] float32 -> xq int8 [M, K], dx float32 [M, K // 32]: per block g of 32 inputs,
    dx = max |x| / 127 and xq = round(x * 127 / max |x|) (0 for an all-zero block), so that
    |x - dx * xq| <= dx / 2 (up to float32 rounding of dx)."""
    for m in range(xq.shape[0]):
        for g in range(dx.shape[1]):
            base = g * INT8_BLOCK
            amax = np.float32(0.0)
            for j in range(INT8_BLOCK):
                amax = max(amax, abs(x[m, base + j]))
            dx[m, g] = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for j in range(INT8_BLOCK):
                xq[m, base + j] = np.int8(round(x[m, base + j] * inv))


@njit(fastmath=True, cache=True)
def _group_sums(x, gs, groups):
    """[M, groups] sums of x over each group of `gs` inputs (groups 0: an [M, 0] array)."""
    xsum = np.zeros((x.shape[0], groups), np.float32)
    for m in range(x.shape[0]):
        for g in range(groups):
            acc = np.float32(0.0)
            for j in range(g * gs, (g + 1) * gs):
                acc += x[m, j]
            xsum[m, g] = acc
    return xsum


@njit(parallel=True, fastmath=True, cache=True)
def gemv_groups(x, q, scales, mins, packed, gs, int8_x, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for the packed weight (x [M, K] contiguous rows;
    gs 32, or 16 for an i8 weight). Float x: fp32 sums in another order than x @ w.T (~1e-7
    relative); `int8_x`: x quantized per 32 inputs first (the bound above)."""
    # The set-up runs in serial helpers: in this parallel function numba would turn each array
    # expression (np.zeros, a slice's .sum()) into a parallel region of its own, a fork and
    # join per group (this once cost more than the GEMV itself).
    m_rows, k_dim = x.shape
    n_dim, groups = q.shape[0], scales.shape[1]
    has_min = mins.shape[1] > 0
    shift = 5 if gs == 32 else 4
    xsum = _group_sums(x, gs, groups if has_min else 0)
    xq = np.empty((m_rows if int8_x else 0, k_dim), np.int8)
    dx = np.empty((xq.shape[0], k_dim // INT8_BLOCK), np.float32)
    quantize_rows_int8(x, xq, dx)
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        for r in range(c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)):
            if int8_x:  # the min term inside the kernel
                _gemv_row_int8(xq, dx, q, scales, mins, xsum, packed, shift, r, out)
                continue
            _gemv_row(x, q, scales, packed, shift, r, out)
            if has_min:
                for m in range(m_rows):
                    acc = np.float32(0.0)
                    for g in range(groups):
                        acc += _table_value(mins, r, g) * xsum[m, g]
                    out[m, r] += acc


# 16-bit float layouts ("f16", "bf16"): `q` int16 [N, K], each value the bit pattern of one
# weight. The GEMV widens 8 weights at a time to <8 x float> (f16: fpext, vcvtph2ps with F16C;
# bf16: the bits shifted into a float32's high half, exact) and accumulates in float32, so a
# decode step reads 2 bytes per weight instead of 4 with no rounding beyond the stored weight's.
_V8H = ir.VectorType(_I16, 8)
_HALF_UNROLL = 4  # independent 8-wide accumulators per row of x (no scale multiply to hide)


def _widen_half(builder, bits, bf16):
    """<8 x i16> (or i16) bit patterns -> <8 x float> (or float)."""
    vector = isinstance(bits.type, ir.VectorType)
    if bf16:
        wide = builder.zext(bits, _V8I if vector else _I32)
        shifted = builder.shl(wide, ir.Constant(_V8I, [16] * 8) if vector else _I32(16))
        return builder.bitcast(shifted, _V8F if vector else _F32)
    half = ir.HalfType()
    return builder.fpext(builder.bitcast(bits, ir.VectorType(half, 8) if vector else half),
                         _V8F if vector else _F32)


def _make_half_dots(nb, bf16):
    """An intrinsic (x, q, r, m0) -> UniTuple(float32, nb): sum_k x[m, k] * w(r, k) for rows
    m0..m0+nb-1 of x, w the 16-bit weight row r (K not necessarily a multiple of 8)."""

    @intrinsic
    def dots(typingctx, x, q, r, m0):
        ret = types.UniTuple(types.float32, nb)

        def codegen(context, builder, signature, args):
            xt, qt, rt, mt = signature.args
            r_, m_ = (context.cast(builder, v, t, types.intp)
                      for v, t in ((args[2], rt), (args[3], mt)))
            ity = r_.type
            qrow, _ = _row_ptr(context, builder, qt, args[1], r_, _I16)
            xrows, k, accs = _x_rows_and_accumulators(context, builder, xt, args[0], m_, nb,
                                                      _HALF_UNROLL)

            def unit(c, slot):
                base = builder.mul(c, ity(8))
                w = _widen_half(builder, _vload(builder, qrow, base, _V8H, 2), bf16)
                for i in range(nb):
                    xv = _vload(builder, xrows[i][0], base, _V8F, 4)
                    acc = builder.load(accs[i][slot])
                    builder.store(builder.fadd(acc, builder.fmul(w, xv, flags=_FAST),
                                               flags=_FAST), accs[i][slot])

            units = builder.sdiv(k, ity(8))
            _for_each_unit(builder, units, _HALF_UNROLL, unit)
            tails = [cgutils.alloca_once_value(builder, _F32(0.0)) for _ in range(nb)]
            tail_start = builder.mul(units, ity(8))
            with cgutils.for_range(builder, builder.sub(k, tail_start)) as loop:
                idx = builder.add(tail_start, loop.index)
                w = _widen_half(builder, builder.load(builder.gep(qrow, [idx])), bf16)
                for i in range(nb):
                    xv = builder.load(builder.gep(xrows[i][0], [idx]))
                    builder.store(builder.fadd(builder.load(tails[i]),
                                               builder.fmul(w, xv, flags=_FAST), flags=_FAST),
                                  tails[i])
            sums = [builder.fadd(_sum_accumulators(builder, row_accs), builder.load(tail),
                                 flags=_FAST) for row_accs, tail in zip(accs, tails)]
            return context.make_tuple(builder, ret, sums)

        return ret(x, q, r, m0), codegen

    return dots


_f16_dots4, _f16_dots2, _f16_dots1 = (_make_half_dots(n, False) for n in _DOT_ROWS)
_bf16_dots4, _bf16_dots2, _bf16_dots1 = (_make_half_dots(n, True) for n in _DOT_ROWS)


@njit(inline="always", fastmath=True, cache=True)
def _gemv_half_row(x, q, bf16, r, out):
    m0, m_rows = 0, x.shape[0]
    while m0 < m_rows:
        left = m_rows - m0
        if left >= 4:
            t4 = _bf16_dots4(x, q, r, m0) if bf16 else _f16_dots4(x, q, r, m0)
            for i in range(4):
                out[m0 + i, r] = t4[i]
            m0 += 4
        elif left >= 2:
            t2 = _bf16_dots2(x, q, r, m0) if bf16 else _f16_dots2(x, q, r, m0)
            out[m0, r], out[m0 + 1, r] = t2[0], t2[1]
            m0 += 2
        else:
            t1 = _bf16_dots1(x, q, r, m0) if bf16 else _f16_dots1(x, q, r, m0)
            out[m0, r] = t1[0]
            m0 += 1


@njit(parallel=True, fastmath=True, cache=True)
def gemv_half(x, q, bf16, out):
    """out[m, r] = sum_k x[m, k] * w[r, k] for a 16-bit weight (`q` int16 [N, K] bit patterns,
    bfloat16 when `bf16` else IEEE half; x [M, K] contiguous rows), accumulated in float32."""
    n_dim = q.shape[0]
    num_chunks = (n_dim + GEMV_CHUNK_ROWS - 1) // GEMV_CHUNK_ROWS
    for c in prange(num_chunks):
        for r in range(c * GEMV_CHUNK_ROWS, min(n_dim, (c + 1) * GEMV_CHUNK_ROWS)):
            _gemv_half_row(x, q, bf16, r, out)
