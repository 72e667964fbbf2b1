"""Decode attention's inner loops over one cache block as LLVM vector IR (numba intrinsics):
the scores of a block's positions against a kv head's query heads (`block_scores`), and the
block's values weighted by their probabilities into the heads' accumulators (`block_values`).
decode_numba.py's kernel calls them for items of one kv head when `takes_head_dim`.

Why IR: in numba loops the heads' running sums and the query live in memory (numba arrays may
alias, so LLVM reloads and stores them around every position), and each 16-bit cache row was
widened into a scratch array and read back once per query head. Here a position's key or value
row is loaded and widened once into registers, and up to `HEADS` query heads' accumulators
(for the values, times up to `_vectors_per_block(heads)` vectors of the head dimension) stay in
registers for the whole block; four positions' scores are reduced together (`_sum_each`).
Vectors are 16 floats where the CPU has AVX-512, else 8; the code for each count of heads (and
of vectors) is generated once and chosen by a switch at run time, so one compiled kernel serves
every model shape.

Numerics: float32 products and sums, each score's dot product summed in another order than the
numba loops' (fastmath); the results agree with them to float32 rounding.
"""

from __future__ import annotations

from functools import lru_cache

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2 import cpu_caps
from mrv2.models.layers.vector_ir import (FAST, F32, I8, I16, I32, I64, byte_ptr, hsum, splat,
                                          switch, widen_half)

HEADS = 4  # query heads per register block (a GQA group is usually 1-8)


@lru_cache(maxsize=1)
def vector_width() -> int:
    """Floats per vector: 16 where the CPU has AVX-512 (32 vector registers), else 8."""
    return cpu_caps.caps().vector_floats


def _accumulators() -> int:
    """Accumulator registers a register block may hold: 16 of AVX-512's 32, 8 of AVX2's 16
    (the rest hold the block's keys or values, the query and the probabilities)."""
    return 16 if vector_width() == 16 else 8


def _positions_per_pass(heads: int) -> int:
    """Positions whose scores a pass sums for `heads` query heads: as many (4, 2 or 1) as keep
    every head's accumulators in registers. One accumulator per (head, position) is one FMA
    chain; a single chain per head waits on each FMA's latency (AVX2's one-position passes
    were a third of the FMA rate at a GQA group of 2; bench/README.md)."""
    return next(span for span in (4, 2, 1) if heads * span <= _accumulators())


def _vectors_per_block(heads: int) -> int:
    """Vectors of the head dimension per value register block of `heads` query heads: AVX-512
    4 (4 x HEADS accumulators); AVX2 as many as its 8 accumulators hold, at most 8, so that a
    small group keeps enough independent FMA chains."""
    if vector_width() == 16:
        return 4
    return min(8, _accumulators() // heads)


def takes_head_dim(head_dim: int) -> bool:
    """Whether the intrinsics take this head size (whole vectors)."""
    return head_dim % vector_width() == 0


def _array(context, builder, array_type, value):
    arr = context.make_array(array_type)(context, builder, value)
    return (arr, cgutils.unpack_tuple(builder, arr.shape, array_type.ndim),
            cgutils.unpack_tuple(builder, arr.strides, array_type.ndim))


def _load_widened(builder, ptr, dtype, width):
    """<width x float> from `width` cache elements at `ptr` (float32, or float16 / bfloat16
    bit patterns: int16 / uint16, as kv_numba's views)."""
    if dtype == types.float32:
        vf = ir.VectorType(F32, width)
        return builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(I16, width).as_pointer()), align=2)
    return widen_half(builder, bits, dtype == types.uint16)


def _clamp(builder, left, most):
    """min(left, most) of an i64 and a constant: the rows of the last register block."""
    return builder.select(builder.icmp_signed(">", left, I64(most)), I64(most), left)


def _typed(context, builder, sig, args, i):
    return context.cast(builder, args[i], sig.args[i], types.int64)


def _sum_each(builder, vectors, width):
    """<n x float> of the horizontal sums of n (2 or 4) <width x float> vectors: halves of
    pairs added (each level a pair of two-source shuffles and one add) instead of n separate
    reductions."""
    def add_halves(a, b, lanes, part):
        """[a's and b's lanes, in `part`-wide runs, the first of each pair of runs] + [the
        second]: each run of a (and of b) summed with its neighbour."""
        first = [i for r in range(0, lanes, 2 * part) for i in range(r, r + part)]
        second = [i + part for i in first]
        picks = [first + [i + lanes for i in first], second + [i + lanes for i in second]]
        mask = ir.VectorType(I32, lanes)
        x, y = (builder.shuffle_vector(a, b, ir.Constant(mask, p)) for p in picks)
        return builder.fadd(x, y, flags=FAST)

    ab = add_halves(vectors[0], vectors[1], width, width // 2)
    if len(vectors) == 2:
        v, lanes, part = ab, width, width // 2
    else:
        cd = add_halves(vectors[2], vectors[3], width, width // 2)
        v, lanes, part = add_halves(ab, cd, width, width // 4), width, width // 4
    # v: n runs of `part` partial sums (one run per vector); halve the runs to one lane.
    while part > 1:
        half = ir.VectorType(I32, lanes // 2)
        first = [i for r in range(0, lanes, part) for i in range(r, r + part // 2)]
        second = [i + part // 2 for i in first]
        v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(half, first)),
                         builder.shuffle_vector(v, v, ir.Constant(half, second)), flags=FAST)
        lanes, part = lanes // 2, part // 2
    return v


def make_block_loops(positions_per_pass=_positions_per_pass,
                     vectors_per_block=_vectors_per_block):
    """(block_scores, block_values) with these register blocks: positions a scores pass and
    value vectors a block, each a function of the query heads in the block (the defaults, or
    another choice to measure against: bench/test_decode_vector_ir.py)."""

    @intrinsic
    def block_scores(typingctx, qs, kb, kv, count, scores, t):
        """scores[h, t + o] = qs[h] . kb[o, kv] for every query head h (qs [heads, head_dim]
        float32, C-contiguous) and position o < count of the cache block kb [block_size, kv heads,
        head_dim] (`takes_head_dim`). Positions go `_positions_per_pass` at a time: each head's
        sums of a pass reduced together (`_sum_each`) and stored as one vector."""
        if not (isinstance(qs, types.Array) and isinstance(kb, types.Array)
                and isinstance(scores, types.Array)):
            return None
        width = vector_width()

        def codegen(context, builder, sig, args):
            (q_arr, (heads, head_dim), _), (k_arr, _, k_strides), (s_arr, _, s_strides) = (
                _array(context, builder, sig.args[i], args[i]) for i in (0, 1, 4))
            kv_, count_, t_ = (_typed(context, builder, sig, args, i) for i in (2, 3, 5))
            vectors = builder.sdiv(head_dim, I64(width))
            vf = ir.VectorType(F32, width)
            accs = [[cgutils.alloca_once(builder, vf) for _ in range(4)] for _ in range(HEADS)]
            kv_bytes = builder.mul(kv_, k_strides[1])
            elem_bytes = I64(sig.args[1].dtype.bitwidth // 8)
            dtype = sig.args[1].dtype

            def positions(h0, n, first, span):
                """Scores of positions first..first+span-1 (span: 1, 2 or 4) for heads
                h0..h0+n-1."""
                rows = [builder.add(builder.mul(builder.add(first, I64(p)), k_strides[0]),
                                    kv_bytes) for p in range(span)]
                for h in range(n):
                    for p in range(span):
                        builder.store(ir.Constant(vf, [0.0] * width), accs[h][p])
                with cgutils.for_range(builder, vectors) as vec:
                    d = builder.mul(vec.index, I64(width))
                    keys = [_load_widened(builder, byte_ptr(builder, k_arr.data, builder.add(
                        row, builder.mul(d, elem_bytes)), I8), dtype, width) for row in rows]
                    for h in range(n):
                        q_ptr = builder.gep(q_arr.data, [builder.add(builder.mul(
                            builder.add(h0, I64(h)), head_dim), d)])
                        q = builder.load(builder.bitcast(q_ptr, vf.as_pointer()), align=4)
                        for p, k in enumerate(keys):
                            builder.store(builder.fadd(builder.load(accs[h][p]), builder.fmul(
                                q, k, flags=FAST), flags=FAST), accs[h][p])
                for h in range(n):
                    at = builder.add(builder.mul(builder.add(h0, I64(h)), s_strides[0]),
                                     builder.mul(builder.add(t_, first), I64(4)))
                    if span == 1:
                        builder.store(hsum(builder, builder.load(accs[h][0])),
                                      byte_ptr(builder, s_arr.data, at, F32))
                    else:
                        sums = _sum_each(builder, [builder.load(a) for a in accs[h][:span]],
                                         width)
                        builder.store(sums, byte_ptr(builder, s_arr.data, at,
                                                     ir.VectorType(F32, span)), align=4)

            with cgutils.for_range_slice(builder, I64(0), heads, I64(HEADS)) as (h0, _):
                block_heads = _clamp(builder, builder.sub(heads, h0), HEADS)

                def emit(n):
                    # Positions before `whole` go `passes` at a time, the rest one at a time
                    # (with one-position passes, every position).
                    passes = positions_per_pass(n)
                    whole = I64(0)
                    if passes > 1:
                        whole = builder.mul(builder.sdiv(count_, I64(passes)), I64(passes))
                        with cgutils.for_range_slice(builder, I64(0), whole,
                                                     I64(passes)) as (first, _):
                            positions(h0, n, first, passes)
                    with cgutils.for_range_slice(builder, whole, count_, I64(1)) as (first, _):
                        positions(h0, n, first, 1)

                switch(builder, block_heads, range(1, HEADS + 1), emit)
            return context.get_dummy_value()

        return types.void(qs, kb, kv, count, scores, t), codegen


    @intrinsic
    def block_values(typingctx, probs, t, vb, kv, count, acc):
        """acc[h] += sum over positions o < count of probs[h, t + o] * vb[o, kv] for every query
        head h (acc [heads, head_dim] float32, C-contiguous; vb a cache block as `block_scores`)."""
        if not (isinstance(probs, types.Array) and isinstance(vb, types.Array)
                and isinstance(acc, types.Array)):
            return None
        width = vector_width()

        def codegen(context, builder, sig, args):
            (p_arr, _, p_strides), (v_arr, _, v_strides), (a_arr, (heads, head_dim), _) = (
                _array(context, builder, sig.args[i], args[i]) for i in (0, 2, 5))
            t_, kv_, count_ = (_typed(context, builder, sig, args, i) for i in (1, 3, 4))
            vectors = builder.sdiv(head_dim, I64(width))
            vf = ir.VectorType(F32, width)
            most = max(vectors_per_block(n) for n in range(1, HEADS + 1))
            slots = [[cgutils.alloca_once(builder, vf) for _ in range(most)] for _ in range(HEADS)]
            kv_bytes = builder.mul(kv_, v_strides[1])
            elem_bytes = I64(sig.args[2].dtype.bitwidth // 8)

            def emit(h0, v0, n, m):
                """acc rows h0..h0+n-1, vectors v0..v0+m-1, over the block's positions."""
                def acc_ptr(h, j):
                    d = builder.mul(builder.add(v0, I64(j)), I64(width))
                    at = builder.add(builder.mul(builder.add(h0, I64(h)), head_dim), d)
                    return builder.bitcast(builder.gep(a_arr.data, [at]), vf.as_pointer())

                for h in range(n):
                    for j in range(m):
                        builder.store(builder.load(acc_ptr(h, j), align=4), slots[h][j])
                with cgutils.for_range(builder, count_) as pos:
                    row = builder.add(builder.mul(pos.index, v_strides[0]), kv_bytes)
                    values = [_load_widened(builder, byte_ptr(builder, v_arr.data, builder.add(
                        row, builder.mul(builder.mul(builder.add(v0, I64(j)), I64(width)),
                                         elem_bytes)), I8), sig.args[2].dtype, width)
                        for j in range(m)]
                    column = builder.mul(builder.add(t_, pos.index), I64(4))
                    for h in range(n):
                        p = builder.load(byte_ptr(builder, p_arr.data, builder.add(builder.mul(
                            builder.add(h0, I64(h)), p_strides[0]), column), F32))
                        p = splat(builder, p, width)
                        for j in range(m):
                            builder.store(builder.fadd(builder.load(slots[h][j]), builder.fmul(
                                p, values[j], flags=FAST), flags=FAST), slots[h][j])
                for h in range(n):
                    for j in range(m):
                        builder.store(builder.load(slots[h][j]), acc_ptr(h, j), align=4)

            with cgutils.for_range_slice(builder, I64(0), heads, I64(HEADS)) as (h0, _):
                def heads_block(n):
                    per_block = vectors_per_block(n)
                    with cgutils.for_range_slice(builder, I64(0), vectors,
                                                 I64(per_block)) as (v0, _):
                        switch(builder, _clamp(builder, builder.sub(vectors, v0), per_block),
                                range(1, per_block + 1), lambda m: emit(h0, v0, n, m))

                switch(builder, _clamp(builder, builder.sub(heads, h0), HEADS),
                        range(1, HEADS + 1), heads_block)
            return context.get_dummy_value()

        return types.void(probs, t, vb, kv, count, acc), codegen

    return block_scores, block_values


block_scores, block_values = make_block_loops()
