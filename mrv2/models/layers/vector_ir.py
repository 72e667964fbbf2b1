"""LLVM vector IR for the CPU kernels that numba intrinsics emit (quantized_numba.py,
quantized_int8_numba.py): typed pointers into numba arrays, vector loads, splats and
reductions, accumulator loops, and the widening of float16 / bfloat16 bit patterns (and, for
16-bit KV caches, the narrowing of float32 to them).

Why IR and not numba loops: see quantized_numba.py. Every helper takes the llvmlite builder of
the intrinsic being generated.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from mrv2.utils.kernel_flags import IR_FLAGS

F32, I8, I16, I32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
I64 = ir.IntType(64)
V8F, V8B, V8I = ir.VectorType(F32, 8), ir.VectorType(I8, 8), ir.VectorType(I32, 8)
V8H = ir.VectorType(I16, 8)
V16B, V16S, V16I = ir.VectorType(I8, 16), ir.VectorType(I16, 16), ir.VectorType(I32, 16)
V32B, V32S, V16F = ir.VectorType(I8, 32), ir.VectorType(I16, 32), ir.VectorType(F32, 16)
FAST = IR_FLAGS  # the kernels' flags (mrv2/utils/kernel_flags.py)
DOT_ROWS = (4, 2, 1)  # rows of x per pass over a weight row (accumulators fit 16 ymm at 4)
DOT_UNROLL = 2  # accumulator sets per row of x (FMA latency 4-5 cycles, 2 FMA pipes)


def half_bits(t: torch.Tensor) -> np.ndarray:
    """A float16 / bfloat16 CPU tensor as the numpy view of its bit patterns, sharing memory,
    as the kernels below take them (numpy has no bfloat16): int16 for float16, uint16 for
    bfloat16 (`f16_bits_to_float`, `bf16_bits_to_float`)."""
    bits = t.view(torch.int16).numpy()
    return bits.view(np.uint16) if t.dtype == torch.bfloat16 else bits


def splat(builder, value, width=8):
    """<width x float> of `value` in every lane."""
    vf, vi = ir.VectorType(F32, width), ir.VectorType(I32, width)
    v = builder.insert_element(ir.Constant(vf, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(vi, [0] * width))


def switch(builder, value, cases, emit):
    """emit(case) in a block of its own for each of `cases` (ints), chosen by `value`."""
    done = builder.append_basic_block("switch.done")
    choice = builder.switch(value, done)
    for case in cases:
        block = builder.append_basic_block(f"case.{case}")
        choice.add_case(value.type(case), block)
        builder.position_at_end(block)
        emit(case)
        builder.branch(done)
    builder.position_at_end(done)


def hsum(builder, v):
    """The sum of a float vector's lanes (any power-of-two count), halves added."""
    width = v.type.count
    while width > 1:
        width //= 2
        mask = ir.VectorType(I32, width)
        lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width, 2 * width))))
        v = builder.fadd(lo, hi, flags=FAST)
    return builder.extract_element(v, I32(0))


def row_ptr(context, builder, array_type, array, row, elem):
    """Pointer (to `elem`) at row `row` of a C-contiguous-rows array, and the array struct."""
    arr = context.make_array(array_type)(context, builder, array)
    stride = cgutils.unpack_tuple(builder, arr.strides, array_type.ndim)[0]
    base = builder.gep(builder.bitcast(arr.data, I8.as_pointer()), [builder.mul(row, stride)])
    return builder.bitcast(base, elem.as_pointer()), arr


def byte_ptr(builder, data, byte_offset, elem):
    """Pointer (to `elem`) `byte_offset` bytes past `data`."""
    return builder.bitcast(builder.gep(builder.bitcast(data, I8.as_pointer()), [byte_offset]),
                           elem.as_pointer())


def vload(builder, ptr, index, vty, align):
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), vty.as_pointer()), align=align)


def table_elem(array_type):
    """The IR element type of a scale / min table: float, or i16 for float16 bit patterns."""
    return I16 if array_type.dtype == types.int16 else F32


def load_table(builder, row_ptr, index, array_type):
    """Element `index` of a table row as a float."""
    value = builder.load(builder.gep(row_ptr, [index]))
    return widen_half(builder, value, False) if array_type.dtype == types.int16 else value


@intrinsic
def f16_bits_to_float(typingctx, bits):
    def codegen(context, builder, signature, args):
        return widen_half(builder, args[0], False)
    return types.float32(bits), codegen


@intrinsic
def bf16_bits_to_float(typingctx, bits):
    def codegen(context, builder, signature, args):
        return widen_half(builder, args[0], True)
    return types.float32(bits), codegen


@intrinsic
def float_to_f16_bits(typingctx, value):
    """float32 -> the int16 bit pattern of the nearest float16 (ties to even; vcvtps2ph)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), I16)
    return types.int16(types.float32), codegen


@intrinsic
def float_to_bf16_bits(typingctx, value):
    """float32 -> the uint16 bit pattern of the nearest bfloat16 (ties to even, as torch
    rounds); NaN stays a (quiet) NaN, where rounding its bits could make it an infinity."""
    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], I32)
        lsb = builder.and_(builder.lshr(bits, I32(16)), I32(1))
        rounded = builder.add(builder.add(bits, I32(0x7FFF)), lsb)
        narrowed = builder.trunc(builder.lshr(rounded, I32(16)), I16)
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(is_nan, I16(0x7FC0), narrowed)
    return types.uint16(types.float32), codegen


def table_value(table, r, g):
    """table[r, g] as float32 (numba only: see the overload)."""
    raise NotImplementedError("numba only")


@overload(table_value, inline="always")
def __table_value_overload(table, r, g):
    if table.dtype == types.int16:
        return lambda table, r, g: f16_bits_to_float(table[r, g])
    return lambda table, r, g: table[r, g]


def x_rows_and_accumulators(context, builder, xt, x, m0, nb, unroll, elem=F32):
    """Pointers (to `elem`) to rows m0..m0+nb-1 of x, K, and `unroll` zeroed <8 x float>
    accumulators per row."""
    ity = m0.type
    xrows = [row_ptr(context, builder, xt, x, builder.add(m0, ity(i)), elem) for i in range(nb)]
    k = cgutils.unpack_tuple(builder, xrows[0][1].shape, 2)[1]
    zero = ir.Constant(V8F, [0.0] * 8)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(unroll)] for _ in range(nb)]
    return xrows, k, accs


def for_each_unit(builder, units, unroll, unit):
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


def sum_accumulators(builder, row_accs):
    """One row's accumulators added, then horizontally: a float."""
    v = builder.load(row_accs[0])
    for a in row_accs[1:]:
        v = builder.fadd(v, builder.load(a), flags=FAST)
    return hsum(builder, v)


def widen_half(builder, bits, bf16):
    """<n x i16> (or i16) bit patterns -> <n x float> (or float): bfloat16 shifted into a
    float's high half, float16 converted."""
    if isinstance(bits.type, ir.VectorType):
        n = bits.type.count
        ints, floats, halves = (ir.VectorType(t, n) for t in (I32, F32, ir.HalfType()))
        sixteen = ir.Constant(ints, [16] * n)
    else:
        ints, floats, halves, sixteen = I32, F32, ir.HalfType(), I32(16)
    if bf16:
        return builder.bitcast(builder.shl(builder.zext(bits, ints), sixteen), floats)
    return builder.fpext(builder.bitcast(bits, halves), floats)


def call_intrinsic(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def add_group_terms(context, builder, table_type, table, table_row, value_rows, accs):
    """Adds sum_g table[r, g] * values[m, g] to each row m's accumulators (`table_row` points
    at row r of the [N, groups] table, `value_rows` at the rows of a float32 [M, groups] array;
    a table of no columns adds nothing), 8 groups a vector into the accumulator slots; returns
    each row's scalar remainder (an alloca'd float) for the groups past the last whole 8."""
    groups = cgutils.unpack_tuple(builder, context.make_array(table_type)(
        context, builder, table).shape, 2)[1]
    ity = groups.type

    def term_unit(u, slot):
        base = builder.mul(u, ity(8))
        if table_type.dtype == types.int16:
            tv = widen_half(builder, vload(builder, table_row, base, V8H, 2), False)
        else:
            tv = vload(builder, table_row, base, V8F, 4)
        for row_accs, v_row in zip(accs, value_rows):
            v = vload(builder, v_row, base, V8F, 4)
            builder.store(builder.fadd(builder.load(row_accs[slot]),
                                       builder.fmul(tv, v, flags=FAST), flags=FAST),
                          row_accs[slot])

    for_each_unit(builder, builder.sdiv(groups, ity(8)), DOT_UNROLL, term_unit)
    tails = [cgutils.alloca_once_value(builder, F32(0.0)) for _ in accs]
    tail_start = builder.mul(builder.sdiv(groups, ity(8)), ity(8))
    with cgutils.for_range(builder, builder.sub(groups, tail_start)) as loop:
        g = builder.add(tail_start, loop.index)
        t = load_table(builder, table_row, g, table_type)
        for tail, v_row in zip(tails, value_rows):
            term = builder.fmul(t, builder.load(builder.gep(v_row, [g])), flags=FAST)
            builder.store(builder.fadd(builder.load(tail), term, flags=FAST), tail)
    return tails


def sums_with_min_terms(context, builder, mins_type, mins, mins_row, xsum_rows, accs):
    """Each row's accumulators summed to a float, plus its min term sum_g mins[r, g] *
    xsum[m, g] (`xsum_rows`: the rows of x's exact float group sums; `add_group_terms`)."""
    tails = add_group_terms(context, builder, mins_type, mins, mins_row, xsum_rows, accs)
    return [builder.fadd(sum_accumulators(builder, row_accs), builder.load(tail), flags=FAST)
            for row_accs, tail in zip(accs, tails)]


def _row_intrinsic(body):
    """An intrinsic (a, row, n) -> float32 over a[row, :n] of a float32 array with contiguous
    rows: body(builder, pointer to a[row, 0], n as intp) emits it."""

    @intrinsic
    def over_row(typingctx, a, row, n):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2):
            return None

        def codegen(context, builder, signature, args):
            at, rt, nt = signature.args
            r_, n_ = (context.cast(builder, v, t, types.intp)
                      for v, t in ((args[1], rt), (args[2], nt)))
            ptr, _ = row_ptr(context, builder, at, args[0], r_, F32)
            return body(builder, ptr, n_)

        return types.float32(a, row, n), codegen

    return over_row


def _make_row_sum(squared: bool):
    """An intrinsic (a, row, n) -> float32: sum_{i < n} a[row, i] (of a[row, i]^2 where
    `squared`) for a float32 array with contiguous rows, in one fixed order: four <8 x float>
    accumulators over 8-element units, the rest one by one, then the accumulators added and
    halved (`sum_accumulators`), then the rest. numba's loops may not reorder a sum
    (utils/kernel_flags.py), so a row's sum that must run on vectors is this."""

    def body(builder, ptr, n_):
        ity = n_.type
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8))
                for _ in range(4)]

        def add(acc, value):
            term = builder.fmul(value, value, flags=FAST) if squared else value
            builder.store(builder.fadd(builder.load(acc), term, flags=FAST), acc)

        units = builder.sdiv(n_, ity(8))
        for_each_unit(builder, units, 4, lambda c, slot: add(
            accs[slot], vload(builder, ptr, builder.mul(c, ity(8)), V8F, 4)))
        rest = cgutils.alloca_once_value(builder, F32(0.0))
        start = builder.mul(units, ity(8))
        with cgutils.for_range(builder, builder.sub(n_, start)) as loop:
            add(rest, builder.load(builder.gep(ptr, [builder.add(start, loop.index)])))
        return builder.fadd(sum_accumulators(builder, accs), builder.load(rest), flags=FAST)

    return _row_intrinsic(body)


row_sum, row_sum_squares = _make_row_sum(False), _make_row_sum(True)


def _make_row_max(absolute: bool):
    """An intrinsic (a, row, n) -> float32: max over i < n (n >= 1) of a[row, i] (of
    |a[row, i]| where `absolute`) for a float32 array with contiguous rows: four <8 x float>
    running maxima over 32-element runs, then the rest one by one. A maximum is exact in any
    order, but numba's loops may not reorder its comparisons into vectors."""

    def value(builder, x):
        """x, or |x|: its sign bit cleared."""
        if not absolute:
            return x
        bits = I32 if x.type == F32 else ir.VectorType(I32, x.type.count)
        mask = ir.Constant(bits, 0x7FFFFFFF if x.type == F32 else [0x7FFFFFFF] * x.type.count)
        return builder.bitcast(builder.and_(builder.bitcast(x, bits), mask), x.type)

    def body(builder, ptr, n_):
        ity = n_.type

        def bigger(x, y):
            return builder.select(builder.fcmp_ordered(">", x, y), x, y)

        first = value(builder, builder.load(ptr))
        maxima = [cgutils.alloca_once_value(builder, splat(builder, first)) for _ in range(4)]
        units = builder.sdiv(n_, ity(8))
        for_each_unit(builder, units, 4, lambda c, slot: builder.store(bigger(
            builder.load(maxima[slot]), value(builder, vload(
                builder, ptr, builder.mul(c, ity(8)), V8F, 4))), maxima[slot]))
        v = builder.load(maxima[0])
        for slot in maxima[1:]:
            v = bigger(v, builder.load(slot))
        result = cgutils.alloca_once_value(builder, builder.extract_element(v, I32(0)))
        for lane in range(1, 8):
            builder.store(bigger(builder.load(result), builder.extract_element(v, I32(lane))),
                          result)
        start = builder.mul(units, ity(8))
        with cgutils.for_range(builder, builder.sub(n_, start)) as loop:
            x = value(builder, builder.load(builder.gep(ptr, [builder.add(start, loop.index)])))
            builder.store(bigger(builder.load(result), x), result)
        return builder.load(result)

    return _row_intrinsic(body)


row_max, row_max_abs = _make_row_max(False), _make_row_max(True)
