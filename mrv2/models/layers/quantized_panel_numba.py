"""The int16-activation product with GGUF blocks (groups of 32 or 16 inputs), the weight
repacked into panels of 64 outputs: AVX-512 integer dot products against a broadcast pair of x,
no horizontal sums.

Why: the GEMV on the rows (quantized_int16_numba) multiplies one weight row by up to 4 rows of x
at a time; per group and row of x it pays, besides its two multiply-adds, an add, a conversion,
an FMA and a lane read of the group's scale, and each output ends in a horizontal sum. Here a
weight [N, K] is held as [ceil(N / 64), K / 2, 128] int8: for each pair of inputs (2p, 2p + 1)
the 64 outputs' two weights, 128 contiguous bytes. Four loads sign-extended to <32 x i16> give
four vectors of 16 outputs x 2 inputs; x's int16 pair (x[2p], x[2p + 1]), broadcast to every
32-bit lane, multiplies each with one vpmaddwd (LLVM fuses the add: vpdpwssd), 32 products an
instruction summed pairwise into the outputs' lanes. A group's pairs (16, or 8 for 16-input
groups) accumulate in int32; at its end one conversion and one FMA per 16 outputs apply scale x
d (the scales a panel [ceil(N / 64), groups, 64], the mins likewise). Up to 4 rows of x share
each weight load.

Numerics: x is the int16 format's (quantized_int16_numba: d = max |x| / 32767 per 32 inputs), the
integer sums are exact (|w| <= 128, |xq| <= 32767: a group's 32 products stay below 2^27) and
equal the GEMV's; out[m, n] = sum over groups in order of float(isum) * (scale * d) (+ min *
sum_g x), in float32: the GEMV's sums in another order (the tests hold the two together).

Weights: the panel forms of quantized_panel_layout: "i8" bytes (groups of 32 inputs, or of 16:
each 16-input group's sum scaled alone, with x's d of its 32-input block); "u4" nibbles in
octets, a shift and a mask (none for the top nibble) making the <32 x i16> lanes of a pair of
16 outputs: one load and 7 integer instructions for 128 weights; "u6" (Q6_K) 6-bit fields of
48-bit strings, each pair's lanes a shift (a funnel shift, vpshldw, where a field spans two
rows) and an arithmetic shift that brings the field down with its sign: 15 instructions for a
16-input group's 8 pairs of 16 outputs, whose scale is its int8 sub-scale (from the panel)
times the 256 inputs' super-scale (the table): the "i8" form's integer sums and scales at 6.5
bits a weight; "u4" without a min table (Q4_0) subtracts 8 x x's block sums from each group's
integer sums; "u4k" (Q4_K) reads "u4" octets and takes each group's scale and min as "u6"
takes its scale, sub x super. The scale and min panels keep the weight's table dtype, so a
panel weight holds about the file's bytes. A weight served as a linear is stored as its panels
alone (PackedWeight.store_as_panels), read back as float32 rows and tiles by
quantized_panel_layout. Runs where numba compiles for a host with AVX-512 BW
(`GROUP_PANELS_RUN`): 512-bit vpmaddwd, and 32 vector registers for up to 4 x 4 x 2
accumulators.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2 import cpu_caps
from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, emit_prefetch
from mrv2.models.layers.quantized_int8_numba import INT8_BLOCK, group_sums, quantize_rows
from mrv2.models.layers.quantized_panel_layout import GROUP_PANEL_OUTPUTS, U6_PAIR_BYTES
from mrv2.models.layers.quantized_panel_layout import GROUP_PANEL_VECTORS as _VECTORS
from mrv2.models.layers.quantized_panel_layout import (U4K_PAIR_BYTES, U4K_SUPER_GROUPS,
                                                       U6_SUPER_GROUPS)
from mrv2.models.layers.vector_ir import (F32, FAST, I8, I16, I32, V16B, V16F, V16I, V16S,
                                          V32B, V32S, call_intrinsic, row_ptr, splat,
                                          table_elem, vload, widen_half)
from mrv2.utils.kernel_flags import FASTMATH

GROUP_PANEL_ROWS = 4  # rows of x per pass over a panel
# A pass of 2 or more rows of x is bound by its multiply-adds, not by the weight stream, and the
# hardware prefetcher then falls behind: such a pass over "u4" or "i8" panels prefetches the
# panel bytes this far ahead of the ones it reads (into L2, every cache line), so the stream
# from DRAM overlaps the arithmetic. A one-row pass reads at the stream's speed, which the
# hardware prefetcher keeps up with; there the extra instructions slowed "i8" panels. On "u4k"
# panels the same prefetches slowed passes of 2 and 4 rows, and "u6" gained too little to
# tell (bench/test_panel_prefetch.py; bench/README.md, 2026-12-07).
PREFETCH_AHEAD_BYTES = 8192
PREFETCH_MIN_ROWS = 2
_FORM_I8, _FORM_U4, _FORM_U6, _FORM_U4K = 0, 1, 2, 3  # the panel forms, as the kernels' literals

GROUP_PANELS_RUN = cpu_caps.caps().group_panels


def panels_prefetch(pair_bytes: int) -> bool:
    """Whether passes of several rows over panels of `pair_bytes` bytes an input pair (the
    panels' last dimension) prefetch their stream: "i8" and "u4" panels, not "u6" nor "u4k"."""
    return pair_bytes not in (U6_PAIR_BYTES, U4K_PAIR_BYTES)


def _prefetch_ahead(builder, panel, start, lines):
    """Prefetch into L2 the `lines` cache lines PREFETCH_AHEAD_BYTES past byte `start` of a
    panel (into the panels after it near a panel's end: the array is contiguous, and a
    prefetch past its end is harmless)."""
    for line in range(lines):
        emit_prefetch(builder, panel, builder.add(start, start.type(
            PREFETCH_AHEAD_BYTES + CACHE_LINE_BYTES * line)), 2)


def _pair_weights(builder, panel, pair, j):
    """"i8" outputs 16 j .. 16 j + 15 of input pair `pair` as <32 x i16> (lane 2 o + t: output
    o, input 2 pair + t), the bytes sign-extended."""
    first = builder.add(builder.mul(pair, pair.type(2 * GROUP_PANEL_OUTPUTS)), pair.type(32 * j))
    return builder.sext(vload(builder, panel, first, V32B, 1), V32S)


def _octet_words(builder, panel, start, j):
    """"u4" / "u4k" outputs 16 j .. 16 j + 15 of the octet of inputs whose rows start at byte
    `start`: 64 bytes as <32 x i16>, word 2 o + t holding its 4 pairs' inputs t, a nibble each."""
    return vload(builder, panel, builder.add(start, start.type(64 * j)), V32S, 1)


def _nibble_lanes(builder, words, k):
    """Nibble k of each word (pair k of the octet) as <32 x i16>, `_pair_weights`' lanes."""
    if k:
        words = builder.lshr(words, ir.Constant(V32S, [4 * k] * 32))
    return words if k == 3 else builder.and_(words, ir.Constant(V32S, [15] * 32))


def _u6_lanes(builder, rows, m):
    """"u6": input pair m of a 16-input group as <32 x i16> (`_pair_weights`' lanes), from its
    three rows (word 2 o + t of rows 0, 1, 2: a 48-bit string, the pair's inputs t at bits
    6 m): the field shifted to the top of each lane (a funnel shift where it spans two rows),
    then arithmetically down by 10, sign and all."""
    row, bit = divmod(6 * m, 16)
    if bit + 6 > 16:
        top = call_intrinsic(builder, "llvm.fshl.v32i16", V32S, [
            rows[row + 1], rows[row], ir.Constant(V32S, [26 - bit] * 32)])
    elif bit < 10:
        top = builder.shl(rows[row], ir.Constant(V32S, [10 - bit] * 32))
    else:
        top = rows[row]
    return builder.ashr(top, ir.Constant(V32S, [10] * 32))


def _sub_scaled(builder, panel, at, table, offset, table_type):
    """16 int8 sub-scales of a panel from byte `at` times 16 entries of a table panel from
    `offset` (the super-scales), as <16 x float>: exact (an f16 field times a byte)."""
    subs = builder.sext(vload(builder, panel, at, V16B, 1), V16I)
    return builder.fmul(builder.sitofp(subs, V16F), _table_vector(builder, table, offset,
                                                                  table_type))


def _table_vector(builder, panel, offset, table_type):
    """16 entries of a scale / min panel from `offset` as <16 x float>."""
    if table_type.dtype == types.int16:
        return widen_half(builder, vload(builder, panel, offset, V16S, 2), False)
    return vload(builder, panel, offset, V16F, 4)


@intrinsic(prefer_literal=True)
def _group_panel_sums(typingctx, w, block, xq, dx, scales, mins, xsum, m0, rows, form, sums):
    """sums[r, :64] = row m0 + r of x (xq, dx: the int16 format; xsum: x's float group sums
    where `mins` has groups, else for "u4" xq's block sums) . the 64 outputs of panel `block`,
    for r < rows (a literal, 1 to GROUP_PANEL_ROWS); `form` (a literal): the panel's
    (_FORM_I8, _FORM_U4, _FORM_U6, _FORM_U4K)."""
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(form, types.IntegerLiteral)
            and 1 <= rows.literal_value <= GROUP_PANEL_ROWS):
        return None
    count, kind = rows.literal_value, form.literal_value

    def codegen(context, builder, signature, args):
        wt, _, xqt, dxt, st, mnt, xst, _, _, _, sumt = signature.args
        block, m0 = (context.cast(builder, args[i], signature.args[i], types.intp)
                     for i in (1, 7))
        ity = block.type
        panel, warr = row_ptr(context, builder, wt, args[0], block, I8)
        scale_panel, sarr = row_ptr(context, builder, st, args[4], block, table_elem(st))
        min_panel, marr = row_ptr(context, builder, mnt, args[5], block, table_elem(mnt))
        pairs = cgutils.unpack_tuple(builder, warr.shape, 3)[1]
        # Input pairs of a weight group: 16 (32 inputs) or 8 (16 inputs, "i8" and "u6"); x's
        # scale d covers 16 pairs, so a 16-input group's is its pair's 32-input block's.
        if kind in (_FORM_U6, _FORM_U4K):  # the tables have a super-scale per 256 inputs
            group_pairs = ity(8 if kind == _FORM_U6 else 16)
            groups = builder.sdiv(pairs, group_pairs)
        else:
            groups = cgutils.unpack_tuple(builder, sarr.shape, 3)[1]
            group_pairs = builder.sdiv(pairs, groups)
        has_min = builder.icmp_signed(">", cgutils.unpack_tuple(builder, marr.shape, 3)[1],
                                      ity(0))
        ms = [builder.add(m0, ity(r)) for r in range(count)]
        # x's int16 pairs read as one i32 each: the lane pattern vpmaddwd pairs with a weight's
        x_pairs = [builder.bitcast(row_ptr(context, builder, xqt, args[2], m, I16)[0],
                                   I32.as_pointer()) for m in ms]
        d_rows = [row_ptr(context, builder, dxt, args[3], m, F32)[0] for m in ms]
        xsum_rows = [row_ptr(context, builder, xst, args[6], m, F32)[0] for m in ms]
        zero_f, zero_i = ir.Constant(V16F, [0.0] * 16), ir.Constant(V16I, [0] * 16)
        sums = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(_VECTORS)]
                for _ in range(count)]
        ints = [[cgutils.alloca_once(builder, V16I) for _ in range(_VECTORS)]
                for _ in range(count)]
        with cgutils.for_range(builder, groups) as group_loop:
            g = group_loop.index
            for row in ints:
                for acc in row:
                    builder.store(zero_i, acc)
            first_pair = builder.mul(g, group_pairs)

            def add_products(pair, wv):
                # ints[r][j] += vector j's weights (<32 x i16>) . x's pair, each row r
                for r in range(count):
                    xv = builder.insert_element(ir.Constant(V16I, ir.Undefined), builder.load(
                        builder.gep(x_pairs[r], [pair])), I32(0))
                    xv = builder.bitcast(builder.shuffle_vector(
                        xv, xv, ir.Constant(V16I, [0] * 16)), V32S)
                    for j in range(_VECTORS):
                        products = call_intrinsic(builder, "llvm.x86.avx512.pmaddw.d.512", V16I,
                                                  [wv[j], xv])
                        builder.store(builder.add(builder.load(ints[r][j]), products),
                                      ints[r][j])

            u6_group = builder.mul(first_pair, ity(U6_PAIR_BYTES))  # its 832 bytes, for "u6"
            if kind == _FORM_U6:  # row 4 r + j: piece r of vector j's strings, 64 bytes
                rows = [[vload(builder, panel, builder.add(u6_group, ity(64 * (4 * r + j))),
                               V32S, 1) for r in range(3)] for j in range(_VECTORS)]
                for m in range(8):
                    add_products(builder.add(first_pair, ity(m)),
                                 [_u6_lanes(builder, rows[j], m) for j in range(_VECTORS)])
            elif kind in (_FORM_U4, _FORM_U4K):  # octets of 256 bytes from the group's start
                group_start = builder.mul(first_pair, ity(
                    GROUP_PANEL_OUTPUTS if kind == _FORM_U4 else U4K_PAIR_BYTES))
                with cgutils.for_range(builder, builder.sdiv(group_pairs, ity(4))) as loop:
                    first = builder.add(first_pair, builder.mul(loop.index, ity(4)))
                    start = builder.add(group_start, builder.mul(loop.index, ity(256)))
                    if count >= PREFETCH_MIN_ROWS and kind == _FORM_U4:  # its 4 lines, ahead
                        _prefetch_ahead(builder, panel, start, 4)
                    words = [_octet_words(builder, panel, start, j) for j in range(_VECTORS)]
                    for k in range(4):
                        add_products(builder.add(first, ity(k)),
                                     [_nibble_lanes(builder, v, k) for v in words])
            else:
                with cgutils.for_range(builder, group_pairs) as pair_loop:
                    pair = builder.add(first_pair, pair_loop.index)
                    if count >= PREFETCH_MIN_ROWS:  # the pair's 2 lines, ahead
                        _prefetch_ahead(builder, panel, builder.mul(
                            pair, ity(2 * GROUP_PANEL_OUTPUTS)), 2)
                    add_products(pair, [_pair_weights(builder, panel, pair, j)
                                        for j in range(_VECTORS)])
            offsets = [builder.add(builder.mul(g, ity(GROUP_PANEL_OUTPUTS)), ity(16 * j))
                       for j in range(_VECTORS)]
            if kind in (_FORM_U6, _FORM_U4K):  # sub-scales (and sub-mins) after its rows
                subs_at = builder.add(u6_group, ity(768)) if kind == _FORM_U6 else builder.add(
                    builder.mul(first_pair, ity(U4K_PAIR_BYTES)), ity(1024))
                supers = builder.mul(builder.sdiv(g, ity(U6_SUPER_GROUPS if kind == _FORM_U6
                                                          else U4K_SUPER_GROUPS)),
                                     ity(GROUP_PANEL_OUTPUTS))
                scale_vectors = [_sub_scaled(builder, panel, builder.add(subs_at, ity(16 * j)),
                                             scale_panel, builder.add(supers, ity(16 * j)), st)
                                 for j in range(_VECTORS)]
            else:
                scale_vectors = [_table_vector(builder, scale_panel, o, st) for o in offsets]
            x_block = builder.lshr(first_pair, ity(4))
            for r in range(count):
                d = splat(builder, builder.load(builder.gep(d_rows[r], [x_block])), 16)
                offset = ir.Constant(V16F, [0.0] * 16)
                if kind == _FORM_U4:  # no min table: values q - 8, xsum x's int16 block sums
                    offset = builder.select(has_min, offset, splat(builder, builder.fmul(
                        builder.load(builder.gep(xsum_rows[r], [g])), F32(8.0)), 16))
                for j in range(_VECTORS):
                    # "u4" without a min table: exact (|isum|, 8 |sum xq| < 2^24)
                    isum = builder.fsub(builder.sitofp(builder.load(ints[r][j]), V16F), offset)
                    term = builder.fmul(isum, builder.fmul(scale_vectors[j], d, flags=FAST),
                                        flags=FAST)
                    builder.store(builder.fadd(builder.load(sums[r][j]), term, flags=FAST),
                                  sums[r][j])
            with builder.if_then(has_min):
                min_vectors = ([_sub_scaled(builder, panel, builder.add(subs_at, ity(64 + 16 * j)),
                                            min_panel, builder.add(supers, ity(16 * j)), mnt)
                                for j in range(_VECTORS)] if kind == _FORM_U4K else
                               [_table_vector(builder, min_panel, o, mnt) for o in offsets])
                for r in range(count):
                    xs = splat(builder, builder.load(builder.gep(xsum_rows[r], [g])), 16)
                    for j in range(_VECTORS):
                        term = builder.fmul(min_vectors[j], xs, flags=FAST)
                        builder.store(builder.fadd(builder.load(sums[r][j]), term, flags=FAST),
                                      sums[r][j])
        for r in range(count):
            out = row_ptr(context, builder, sumt, args[10], ity(r), V16F)[0]
            for j in range(_VECTORS):
                builder.store(builder.load(sums[r][j]), builder.gep(out, [ity(j)]), align=4)
        return context.get_dummy_value()

    return types.void(w, block, xq, dx, scales, mins, xsum, m0, rows, form, sums), codegen


@njit(inline="always", cache=True)
def _group_rows_pass(w, b, xq, dx, scales, mins, xsum, m0, rows, form, sums):
    """`_group_panel_sums` for `rows` (1 to GROUP_PANEL_ROWS) rows, `form` a literal: each
    count a literal."""
    if rows == 4:
        _group_panel_sums(w, b, xq, dx, scales, mins, xsum, m0, 4, form, sums)
    elif rows == 3:
        _group_panel_sums(w, b, xq, dx, scales, mins, xsum, m0, 3, form, sums)
    elif rows == 2:
        _group_panel_sums(w, b, xq, dx, scales, mins, xsum, m0, 2, form, sums)
    else:
        _group_panel_sums(w, b, xq, dx, scales, mins, xsum, m0, 1, form, sums)


@njit(cache=True)
def _int16_x(x, groups, block_sums):
    """x float32 [M, K] -> (xq int16 [M, K], dx [M, K / 32], x's float sums over each of
    `groups` groups of inputs [M, groups] (0: none), or with `block_sums` xq's sums over its
    32-input blocks [M, K / 32] (exact in float32)), as gemv_groups forms them: serial, outside
    the parallel loop (numba would make each array expression a parallel region of its own)."""
    m_rows, k = x.shape
    xq = np.empty((m_rows, k), np.int16)
    dx = np.empty((m_rows, k // INT8_BLOCK), np.float32)
    quantize_rows(x, xq, dx)
    if not block_sums:
        return xq, dx, group_sums(x, k // max(groups, 1), groups)
    sums = np.zeros((m_rows, k // INT8_BLOCK), np.float32)
    for m in range(m_rows):
        for i in range(k):
            sums[m, i // INT8_BLOCK] += np.float32(xq[m, i])
    return xq, dx, sums


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def group_panel_kernel(x, w, scales, mins, packed, out):
    """out [M, N] float32 = x float32 [M, K] (rows contiguous), quantized to the int16 format,
    @ the weight whose panels (`group_panels_of`: "u6" where w has U6_PAIR_BYTES a pair,
    "u4k" where it has U4K_PAIR_BYTES, else "u4" nibbles where `packed`, else "i8") are w,
    scales, mins. The panels are shared among numba's threads (prange's static schedule), each
    taking all of x's rows, GROUP_PANEL_ROWS at a time. No thread count is read inside (it
    would keep the decode stack from being cached)."""
    rows, n = out.shape
    u4k = w.shape[2] == U4K_PAIR_BYTES
    xq, dx, xsum = _int16_x(x, w.shape[1] // 16 if u4k else mins.shape[1],
                            packed and mins.shape[1] == 0)
    for b in prange(w.shape[0]):
        sums = np.empty((GROUP_PANEL_ROWS, GROUP_PANEL_OUTPUTS), np.float32)
        n0 = b * GROUP_PANEL_OUTPUTS
        width = min(GROUP_PANEL_OUTPUTS, n - n0)
        for m0 in range(0, rows, GROUP_PANEL_ROWS):
            count = min(GROUP_PANEL_ROWS, rows - m0)
            # _FORM_U6, _FORM_U4K, _FORM_U4, _FORM_I8 as numbers: a global in prange is no literal
            if w.shape[2] == U6_PAIR_BYTES:
                _group_rows_pass(w, b, xq, dx, scales, mins, xsum, m0, count, 2, sums)
            elif u4k:
                _group_rows_pass(w, b, xq, dx, scales, mins, xsum, m0, count, 3, sums)
            elif packed:
                _group_rows_pass(w, b, xq, dx, scales, mins, xsum, m0, count, 1, sums)
            else:
                _group_rows_pass(w, b, xq, dx, scales, mins, xsum, m0, count, 0, sums)
            for r in range(count):
                out[m0 + r, n0:n0 + width] = sums[r, :width]
