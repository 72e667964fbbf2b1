"""Bfloat16 linears of a few rows on the CPU's AMX tiles, reading oneDNN's packed weights in
place: on CPUs with AMX, a bfloat16 model's linears of up to `MAX_ROWS` rows
(cpu_linear.half_linear decides; onednn_decode.py calls the kernel into its step's buffers).

Why: at decode's 2-64 rows a linear is a stream of its weight, and oneDNN's inner product
reads it at about half the rate the machine streams (its tile loads wait on memory one after
another; bench/README.md has the figures). This kernel walks each thread's share of the
packed weight in address order, prefetching `PREFETCH_BYTES` ahead, with the rows' products
in tiles.

The weight: oneDNN packs a bfloat16 [N, K] weight for AMX in blocks of 32 outputs x 32 inputs,
2 KiB each, in output-block-major order (format AB16b32a2b): within a block 16 rows, one per
pair of inputs, each of the 32 outputs' pair, so the two halves of a row are two 16-output B
tiles with a 128-byte stride. `weight_tiles` views that memory as [N/32, K/32, 16, 64] uint16
after checking, once per shape, that oneDNN packs that shape so (`_packs_as_tiles`); other
shapes, and CPUs without AMX (`usable`), stay on oneDNN.

Numerics: the same tile products as oneDNN's kernel, all of K summed in the tiles in order,
each output rounded to bfloat16 once. Up to 32 rows that is oneDNN's result bit for bit
(tested on SmolLM2's shapes); beyond, oneDNN splits K into parts summed apart (by shape and row
count), and the two differ by at most one rounding. Every 16-bit linear of up to `MAX_ROWS`
rows takes this kernel (cpu_linear.half_linear), so the decode paths and the layer path agree.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from mrv2 import cpu_caps
from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, prefetch_at
from mrv2.models.layers.amx_ir import (tile_config, tile_dot_bf16, tile_load, tile_release,
                                       tile_store, tile_zero)
from mrv2.models.layers.vector_ir import half_bits
from mrv2.utils.kernel_flags import FASTMATH

BLOCK = 32  # outputs and inputs of a packed block; rows of x per pass
# The most rows the kernel takes (cpu_linear.half_linear): by 64 a linear is bound by its
# products rather than its weight's stream, and the kernel and oneDNN are level
# (bench/README.md); onednn_decode's rows stay within it.
MAX_ROWS = 64
_BLOCK_BYTES = BLOCK * BLOCK * 2
_ROW_BYTES = 2 * BLOCK * 2  # a block row: 32 outputs x a pair of inputs, bfloat16
# How far ahead of its tile loads a thread prefetches its weight (measured against none, 1, 2
# and 4 blocks ahead: bench/README.md).
PREFETCH_BYTES = 4 * _BLOCK_BYTES
_TILES_ATTR = "_mrv2_weight_tiles"


@lru_cache(maxsize=1)
def usable() -> bool:
    """Whether this process can run the kernel: a CPU with AMX tiles and the kernel's
    permission for the tiles' state (asked for here, once). Its weights come packed by oneDNN,
    so where there are any oneDNN is built in."""
    return cpu_caps.caps().matrix_tiles and bool(torch.cpu._init_amx())


def _tile_view(packed: torch.Tensor) -> np.ndarray:
    """The memory of oneDNN's packed [N, K] bfloat16 weight as [N/32, K/32, 16, 64] uint16. The
    view's buffer holds `packed`, so the memory lives as long as the view does."""
    n, k = packed.shape
    buffer = (ctypes.c_uint16 * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed
    return np.ctypeslib.as_array(buffer).reshape(n // BLOCK, k // BLOCK, BLOCK // 2, 2 * BLOCK)


def tiles_of(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [N, K] weight in the layout `weight_tiles` expects, [N/32, K/32, 16, 64]: the
    reference for oneDNN's packing."""
    n, k = weight.shape
    blocks = weight.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // BLOCK, BLOCK // 2, 2 * BLOCK)


def onednn_packs_as(n: int, k: int, reference, view) -> bool:
    """Whether oneDNN packs a bfloat16 [n, k] weight as `reference(weight)` lays it out, read
    through `view(packed)`: a probe weight packed and compared."""
    probe = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(probe)
    if torch.ops.mkldnn._nbytes(packed) != n * k * 2:
        return False
    return bool(np.array_equal(view(packed), half_bits(reference(probe))))


def kept_view(packed: torch.Tensor, attr: str, packs_as, view) -> np.ndarray | None:
    """A kernel's view of a weight oneDNN packed, `view(packed)`, where the weight is bfloat16
    and `packs_as(n, k)` holds for its shape, else None; made once and kept on the packed
    tensor as `attr`."""
    cached = getattr(packed, attr, None)
    if cached is None:
        usable_here = packed.dtype == torch.bfloat16 and packs_as(*packed.shape)
        cached = (view(packed) if usable_here else None,)
        setattr(packed, attr, cached)
    return cached[0]


@lru_cache(maxsize=None)
def _packs_as_tiles(n: int, k: int) -> bool:
    return (n % BLOCK == 0 and k % BLOCK == 0 and usable()
            and onednn_packs_as(n, k, tiles_of, _tile_view))


def weight_tiles(packed: torch.Tensor) -> np.ndarray | None:
    """The tile view of a bfloat16 weight oneDNN packed (`_reorder_linear_weight`), kept on
    the packed tensor; None where the kernel cannot read it (shape, layout or CPU)."""
    return kept_view(packed, _TILES_ATTR, _packs_as_tiles, _tile_view)


@njit(cache=True)
def _configurations(rows):
    """Tile configurations: [0] for a pass of 32 rows, [1] for the last pass's rows % 32.
    Tiles 0-3: C (rows 0-15 x outputs 0-15 and 16-31, rows 16-31 x the same), 4-5: A (x's
    rows 0-15, 16-31 of the pass), 6-7: B (the two 16-output halves of a weight block)."""
    tail = rows % BLOCK
    configs = np.zeros((2, 64), np.uint8)
    for c in range(2):
        low = BLOCK // 2 if c == 0 or tail > BLOCK // 2 else tail
        high = BLOCK // 2 if c == 0 else max(tail - BLOCK // 2, 0)
        configs[c, 0] = 1  # palette 1
        for t in range(8):
            tile_rows = low if t in (0, 1, 4) else (high if t in (2, 3, 5) else BLOCK // 2)
            if tile_rows > 0:  # an unused tile keeps 0 rows and 0 bytes per row
                configs[c, 16 + 2 * t] = 64
                configs[c, 48 + t] = tile_rows
    return configs


@njit(inline="always", cache=True)
def store_rounded(bits, rows, out, row0, col0):
    """out[row0 + r, col0 + j] = the float32 sum whose bit pattern is bits[r, j], for r < rows,
    rounded to bfloat16 (vector_ir.float_to_bf16_bits' rounding, written on the bits). Each
    row of `out` is sliced before the loop: indexed as out[row0 + r, col0 + j], numba's
    negative-index check on col0 + j kept LLVM from vectorising the stores."""
    for r in range(rows):
        row = out[row0 + r, col0:col0 + bits.shape[1]]
        for j in range(bits.shape[1]):
            b = bits[r, j]
            rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> 16
            is_nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            row[j] = np.uint16(0x7FC0) if is_nan else np.uint16(rounded)


@njit(inline="always", cache=True)
def _store_exact(sums, rows, out, row0, col0):
    """out[row0 + r, col0 + j] = sums[r, j] for r < rows: float32 outputs, not rounded."""
    for r in range(rows):
        row = out[row0 + r, col0:col0 + sums.shape[1]]
        for j in range(sums.shape[1]):
            row[j] = sums[r, j]


def store_sums(sums, rows, out, row0, col0):
    """The first `rows` rows of a pass's float32 `sums` into `out` at (row0, col0): rounded to
    bfloat16 once where `out` holds bfloat16 bits (uint16: a layer's output), as they are where
    `out` is float32 (logits, which are never rounded). Called from the kernels only."""
    raise NotImplementedError("store_sums runs inside numba code only")


@overload(store_sums, inline="always")
def _store_sums_overload(sums, rows, out, row0, col0):
    if out.dtype == types.float32:
        return lambda sums, rows, out, row0, col0: _store_exact(sums, rows, out, row0, col0)
    return lambda sums, rows, out, row0, col0: store_rounded(sums.view(np.uint32), rows, out,
                                                             row0, col0)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def tile_linear_kernel(x, w, out, threads):
    """out [M, N] = x [M, K] @ the weight whose tile view is w [N/32, K/32, 16, 64], x and w
    bfloat16 bits (uint16), `out` bfloat16 bits or float32 (`store_sums`). Each of `threads`
    threads takes a contiguous run of 32-output blocks (numba.get_num_threads() here would keep
    numba from caching the kernel)."""
    rows, k = x.shape
    out_blocks, k_blocks = w.shape[0], w.shape[1]
    x_stride = k * 2
    weight_bytes = out_blocks * k_blocks * _BLOCK_BYTES
    configs = _configurations(rows)
    threads = min(threads, out_blocks)
    for thread in prange(threads):
        first = out_blocks * thread // threads
        stop = out_blocks * (thread + 1) // threads
        sums = np.empty((BLOCK, BLOCK), np.float32)
        loaded = -1
        for b in range(first, stop):
            for m0 in range(0, rows, BLOCK):
                config = 0 if rows - m0 >= BLOCK else 1
                if config != loaded:
                    tile_config(configs[config])
                    loaded = config
                both = rows - m0 > BLOCK // 2
                tile_zero(0)
                tile_zero(1)
                if both:
                    tile_zero(2)
                    tile_zero(3)
                for kb in range(k_blocks):
                    at = (b * k_blocks + kb) * _BLOCK_BYTES
                    if m0 == 0 and at + PREFETCH_BYTES < weight_bytes:
                        for line in range(0, _BLOCK_BYTES, CACHE_LINE_BYTES):
                            prefetch_at(w, 0, at + PREFETCH_BYTES + line)
                    tile_load(4, x, (m0 * k + kb * BLOCK) * 2, x_stride)
                    tile_load(6, w, at, _ROW_BYTES)
                    tile_load(7, w, at + _ROW_BYTES // 2, _ROW_BYTES)
                    tile_dot_bf16(0, 4, 6)
                    tile_dot_bf16(1, 4, 7)
                    if both:
                        tile_load(5, x, ((m0 + BLOCK // 2) * k + kb * BLOCK) * 2, x_stride)
                        tile_dot_bf16(2, 5, 6)
                        tile_dot_bf16(3, 5, 7)
                tile_store(0, sums, 0, BLOCK * 4)
                tile_store(1, sums, BLOCK * 2, BLOCK * 4)
                if both:
                    tile_store(2, sums, BLOCK * BLOCK * 2, BLOCK * 4)
                    tile_store(3, sums, BLOCK * BLOCK * 2 + BLOCK * 2, BLOCK * 4)
                store_sums(sums, min(BLOCK, rows - m0), out, m0, b * BLOCK)
        tile_release()
