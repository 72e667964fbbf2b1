"""Prompt attention's register tile as LLVM vector IR (a numba intrinsic): `tile_product`
writes a block of rows of one of its two matrix products.

Why IR: numba loops keep a product's running sums in memory (numba arrays may alias, so LLVM
loads and stores them around every multiply-add). A prompt's scores (queries x keys) and its
output (probabilities x value rows) are small matrix products: with the sums in registers
each step of the inner loop is one row of B loaded as vectors, a tile's rows of A broadcast,
and rows x vectors multiply-adds, a GEMM micro-kernel's rate (bench/README.md, "prompt
attention").

Rows of A and of C are picked through index arrays, so a tile reads query rows and writes
output rows where they lie in the step's [tokens * heads, head_dim] tensors, and each output
row is multiplied by its own factor as it is stored (the softmax's 1 / sum).

Numerics: float32 products, each sum in order of the inner dimension (one FMA chain per output
element).
"""

from __future__ import annotations

from functools import lru_cache

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2.attention.decode_vector_ir import vector_width
from mrv2.models.layers.vector_ir import F32, FAST, I64, byte_ptr, splat, switch

TILE_ROWS = 4  # most rows of A (and C) per tile


@lru_cache(maxsize=1)
def tile_vectors() -> int:
    """Most vectors of C's row per tile: 4 of AVX-512's 32 registers (16 sums), 2 of AVX2's 16
    (8 sums): the sums, B's row and a broadcast fit the registers."""
    return 4 if vector_width() == 16 else 2


def _arrays(context, builder, sig, args, indices):
    """(data pointer, first stride in bytes) of each 2-D array argument, and the data pointer
    of each 1-D one."""
    out = []
    for i in indices:
        arr = context.make_array(sig.args[i])(context, builder, args[i])
        if sig.args[i].ndim == 2:
            out.append((arr.data, cgutils.unpack_tuple(builder, arr.strides, 2)[0]))
        else:
            out.append(arr.data)
    return out


@intrinsic
def tile_product(typingctx, a, a_rows, b, c, c_rows, c_scales, m0, rows, n0, vectors,
                 inner):
    """For i < rows (1..TILE_ROWS) and the `vectors` (1..tile_vectors()) vectors of columns
    from n0: c[c_rows[m0 + i], cols] = c_scales[m0 + i] * sum over t < inner of
    a[a_rows[m0 + i], t] * b[t, cols]. a, b, c: 2-D float32 arrays whose rows are contiguous
    (any row stride); a_rows, c_rows int64, c_scales float32; the caller keeps every index in
    bounds."""
    if not (all(isinstance(x, types.Array) and x.ndim == 2 and x.dtype == types.float32
                for x in (a, b, c))
            and all(isinstance(x, types.Array) and x.ndim == 1 for x in (a_rows, c_rows))
            and a_rows.dtype == c_rows.dtype == types.int64
            and isinstance(c_scales, types.Array) and c_scales.dtype == types.float32):
        return None
    width = vector_width()

    def codegen(context, builder, sig, args):
        (a_data, a_row), a_rows_data, (b_data, b_row), (c_data, c_row), c_rows_data, \
            c_scales_data = _arrays(context, builder, sig, args, range(6))
        m0_, rows_, n0_, vectors_, inner_ = (
            context.cast(builder, args[i], sig.args[i], types.int64) for i in range(6, 11))
        vf = ir.VectorType(F32, width)
        most = tile_vectors()
        sums = [[cgutils.alloca_once(builder, vf) for _ in range(most)]
                for _ in range(TILE_ROWS)]
        column_bytes = builder.mul(n0_, I64(4))

        def tile(n, m):
            """rows n, vectors m."""
            picks = [builder.add(m0_, I64(i)) for i in range(n)]
            a_at = [builder.mul(builder.load(builder.gep(a_rows_data, [p])), a_row)
                    for p in picks]
            for i in range(n):
                for j in range(m):
                    builder.store(ir.Constant(vf, [0.0] * width), sums[i][j])
            with cgutils.for_range(builder, inner_) as loop:
                t = loop.index
                b_at = builder.add(builder.mul(t, b_row), column_bytes)
                b_vectors = [builder.load(byte_ptr(builder, b_data, builder.add(
                    b_at, I64(4 * width * j)), vf), align=4) for j in range(m)]
                t_bytes = builder.mul(t, I64(4))
                for i in range(n):
                    x = builder.load(byte_ptr(builder, a_data, builder.add(a_at[i], t_bytes),
                                               F32))
                    x = splat(builder, x, width)
                    for j in range(m):
                        builder.store(builder.fadd(builder.load(sums[i][j]), builder.fmul(
                            x, b_vectors[j], flags=FAST), flags=FAST), sums[i][j])
            for i, p in enumerate(picks):
                row_at = builder.add(builder.mul(
                    builder.load(builder.gep(c_rows_data, [p])), c_row), column_bytes)
                scale = splat(builder, builder.load(builder.gep(c_scales_data, [p])), width)
                for j in range(m):
                    builder.store(builder.fmul(builder.load(sums[i][j]), scale, flags=FAST),
                                  byte_ptr(builder, c_data, builder.add(
                                      row_at, I64(4 * width * j)), vf), align=4)

        switch(builder, rows_, range(1, TILE_ROWS + 1),
                lambda n: switch(builder, vectors_, range(1, most + 1),
                                  lambda m: tile(n, m)))
        return context.get_dummy_value()

    return types.void(a, a_rows, b, c, c_rows, c_scales, m0, rows, n0, vectors, inner), codegen
