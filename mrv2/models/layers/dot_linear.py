"""Bfloat16 linears of a few rows on AVX-512 BF16 dot products (VDPBF16PS), reading oneDNN's
packed weights in place: on CPUs with AVX-512 BF16 and no AMX tiles (where tile_linear.py's
kernel runs instead), a bfloat16 model's linears of up to `cpu_linear.FEW_ROWS_MAX` rows
(cpu_linear.half_linear decides; onednn_decode.py calls the kernel from its one-call step).

Why: numba code can call this kernel, not oneDNN, so with it a thin model's batched decode step
runs as one numba call instead of some 120 linears each reached through Python and torch's
dispatcher; at these rows it also runs at or above oneDNN's rate (bench/README.md).

The weight: on such CPUs oneDNN packs a bfloat16 [N, K] weight in blocks of 64 outputs, each
holding all of K in input pairs: per pair 64 outputs x 2 inputs, 256 bytes, four 16-output
vectors of the pair's two bfloat16 each (what VDPBF16PS multiplies against a broadcast pair of
x). `weight_pairs` views that memory as [N/64, K/2, 128] uint16 after checking, once per
shape, that oneDNN packs that shape so (`_packs_as_pairs`); other shapes and CPUs stay on
oneDNN.

Numerics: each output one float32 accumulator over K's pairs in order (each product exact,
each addition rounded), rounded to bfloat16 once: within K float32 roundings and one bfloat16
rounding of the exact sum (tested). oneDNN sums in another order, so the two differ in the
last bits of some outputs; every 16-bit linear of up to `cpu_linear.FEW_ROWS_MAX` rows takes
this kernel where it runs (cpu_linear.half_linear), so the decode paths and the layer path
still agree.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mrv2 import cpu_caps
from mrv2.models.layers.tile_linear import kept_view, onednn_packs_as, store_sums
from mrv2.models.layers.vector_ir import F32, I32, call_intrinsic
from mrv2.utils.kernel_flags import FASTMATH

BLOCK_OUTPUTS = 64  # outputs of a packed block
LANES = 16  # outputs of one vector
PASS_ROWS = 6  # rows of x per pass over a block: 4 x 6 accumulators, in 32 vector registers
_PAIRS_ATTR = "_mrv2_weight_pairs"


class _BFloat(ir.types.Type):
    """LLVM's bfloat, which llvmlite's IR builder has no class for."""

    def _to_string(self) -> str:
        return "bfloat"


_LANE_FLOATS, _LANE_INTS = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)
_LANE_PAIRS = ir.VectorType(_BFloat(), 2 * LANES)


@lru_cache(maxsize=1)
def runs_here() -> bool:
    """Whether the kernel runs here: AVX-512 BF16 without AMX tiles (where tile_linear's
    kernel takes these linears) and oneDNN built in (it packs the weights)."""
    caps = cpu_caps.caps()
    return (caps.native_16bit(torch.bfloat16) and not caps.matrix_tiles
            and torch.backends.mkldnn.is_available())


def _pair_view(packed: torch.Tensor) -> np.ndarray:
    """The memory of oneDNN's packed [N, K] bfloat16 weight as [N/64, K/2, 128] uint16; the
    view's buffer holds `packed`, so the memory lives as long as the view does."""
    n, k = packed.shape
    buffer = (ctypes.c_uint16 * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed
    return np.ctypeslib.as_array(buffer).reshape(n // BLOCK_OUTPUTS, k // 2, 2 * BLOCK_OUTPUTS)


def pairs_of(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [N, K] weight in the layout `weight_pairs` expects, [N/64, K/2, 128]: the
    reference for oneDNN's packing."""
    n, k = weight.shape
    blocks = weight.reshape(n // BLOCK_OUTPUTS, BLOCK_OUTPUTS, k // 2, 2)
    return blocks.permute(0, 2, 1, 3).reshape(n // BLOCK_OUTPUTS, k // 2, 2 * BLOCK_OUTPUTS)


@lru_cache(maxsize=None)
def _packs_as_pairs(n: int, k: int) -> bool:
    return (n % BLOCK_OUTPUTS == 0 and k % 2 == 0 and runs_here()
            and onednn_packs_as(n, k, pairs_of, _pair_view))


def weight_pairs(packed: torch.Tensor) -> np.ndarray | None:
    """The pair view of a bfloat16 weight oneDNN packed (`_reorder_linear_weight`), kept on
    the packed tensor; None where the kernel cannot read it (shape, layout or CPU)."""
    return kept_view(packed, _PAIRS_ATTR, _packs_as_pairs, _pair_view)


@intrinsic(prefer_literal=True)
def _block_sums(typingctx, w, block, x, m0, rows, sums):
    """sums[r, :64] = x[m0 + r] . the 64 outputs of packed block `block` of w, over all of K,
    float32, for r < rows (a literal, 1 to PASS_ROWS): one accumulator per output, K's pairs
    in order."""
    if not (isinstance(rows, types.IntegerLiteral) and 1 <= rows.literal_value <= PASS_ROWS):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        wt, _, xt, _, _, st = signature.args
        warr = context.make_array(wt)(context, builder, args[0])
        xarr = context.make_array(xt)(context, builder, args[2])
        sarr = context.make_array(st)(context, builder, args[5])
        pairs = cgutils.unpack_tuple(builder, warr.shape, 3)[1]
        block = context.cast(builder, args[1], signature.args[1], types.intp)
        m0 = context.cast(builder, args[3], signature.args[3], types.intp)
        ity = pairs.type
        # The block as <16 x i32> vectors (a pair per lane), four per input pair.
        wbase = builder.gep(builder.bitcast(warr.data, _LANE_INTS.as_pointer()),
                            [builder.mul(block, builder.mul(pairs, ity(4)))])
        x_stride = cgutils.unpack_tuple(builder, xarr.strides, 2)[0]
        xbytes = builder.bitcast(xarr.data, ir.IntType(8).as_pointer())
        xrows = [builder.bitcast(builder.gep(xbytes, [builder.mul(builder.add(m0, ity(r)),
                                                                  x_stride)]),
                                 I32.as_pointer()) for r in range(count)]
        zero = ir.Constant(_LANE_FLOATS, [0.0] * LANES)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)]
                for _ in range(count)]
        with cgutils.for_range(builder, pairs) as loop:
            p = loop.index
            wv = [builder.bitcast(builder.load(builder.gep(
                wbase, [builder.add(builder.mul(p, ity(4)), ity(j))]), align=64), _LANE_PAIRS)
                for j in range(4)]
            for r in range(count):
                pair = builder.load(builder.gep(xrows[r], [p]), align=4)
                splat = builder.insert_element(ir.Constant(_LANE_INTS, ir.Undefined), pair, I32(0))
                splat = builder.shuffle_vector(splat, splat, ir.Constant(_LANE_INTS, [0] * LANES))
                xv = builder.bitcast(splat, _LANE_PAIRS)
                for j in range(4):
                    acc = call_intrinsic(builder, "llvm.x86.avx512bf16.dpbf16ps.512", _LANE_FLOATS,
                                         [builder.load(accs[r][j]), wv[j], xv])
                    builder.store(acc, accs[r][j])
        s_stride = cgutils.unpack_tuple(builder, sarr.strides, 2)[0]
        sbytes = builder.bitcast(sarr.data, ir.IntType(8).as_pointer())
        for r in range(count):
            row = builder.bitcast(builder.gep(sbytes, [builder.mul(ity(r), s_stride)]),
                                  _LANE_FLOATS.as_pointer())
            for j in range(4):
                builder.store(builder.load(accs[r][j]), builder.gep(row, [ity(j)]), align=4)
        return context.get_dummy_value()

    return types.void(w, block, x, m0, rows, sums), codegen


@njit(inline="always", cache=True)
def _pass(w, b, x, m0, rows, sums):
    """`_block_sums` for `rows` (1 to PASS_ROWS) rows: each count is a literal the intrinsic
    is generated for."""
    if rows == 6:
        _block_sums(w, b, x, m0, 6, sums)
    elif rows == 5:
        _block_sums(w, b, x, m0, 5, sums)
    elif rows == 4:
        _block_sums(w, b, x, m0, 4, sums)
    elif rows == 3:
        _block_sums(w, b, x, m0, 3, sums)
    elif rows == 2:
        _block_sums(w, b, x, m0, 2, sums)
    else:
        _block_sums(w, b, x, m0, 1, sums)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def dot_linear_kernel(x, w, out, threads):
    """out [M, N] = x [M, K] @ the weight whose pair view is w [N/64, K/2, 128], x and w
    bfloat16 bits (uint16), `out` bfloat16 bits or float32 (tile_linear.store_sums). Each of
    `threads` threads takes a contiguous run of 64-output blocks, and each block all of x's
    rows, PASS_ROWS at a time (the block stays in L2)."""
    rows = x.shape[0]
    blocks = w.shape[0]
    threads = min(threads, blocks)
    for thread in prange(threads):
        first = blocks * thread // threads
        stop = blocks * (thread + 1) // threads
        sums = np.empty((PASS_ROWS, BLOCK_OUTPUTS), np.float32)
        for b in range(first, stop):
            for m0 in range(0, rows, PASS_ROWS):
                count = min(PASS_ROWS, rows - m0)
                _pass(w, b, x, m0, count, sums)
                store_sums(sums, count, out, m0, b * BLOCK_OUTPUTS)
