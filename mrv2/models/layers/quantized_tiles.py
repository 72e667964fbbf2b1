"""Prefill on a packed weight (quantized.py): float32 tiles of output rows dequantized into one
reused buffer, each multiplied with torch.mm, so the float32 weight never exists whole.

Why tiles: past the GEMV's rows a prefill step is bound by its multiply-adds, which torch.mm
(oneDNN / MKL) does at the CPU's float32 rate; a tile small enough to stay in cache while
torch.mm reads it costs one pass over the weight's bytes. The tile is dequantized on the calling
thread (torch.mm parallelises; see quantized_numba.dequant_rows_serial), exactly: the products
are those of x @ dequantize().T, in torch.mm's summation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from mrv2.models.layers import quantized_panel_layout

if TYPE_CHECKING:
    from mrv2.models.layers.quantized import PackedWeight

# Float32 elements of one dequantized tile (4 MiB): stays in L2/L3 while torch.mm reads it,
# large enough that torch.mm's per-call cost is small (bench/README.md: Zen 3's float32 tiles
# and the 16-bit ones).
TILE_ELEMENTS = 1 << 20


def tiled_linear(x: torch.Tensor, weight: PackedWeight,
                 tile_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x float32 [T, K] @ weight^T -> float32 [T, N], tile by tile; `tile_dtype` bfloat16 (a
    CPU that multiplies it on matrix units, a bfloat16 model: LinearKernel.BLOCK_TILES_BF16)
    multiplies x and each tile rounded to bfloat16, each output rounded once, as a bfloat16
    model's linears do, ~4x faster than float32 on AMX at 2048 rows (bench/README.md)."""
    n, t = weight.out_features, x.shape[0]
    # The products go into out [T, N]'s columns, tile by tile: filling out^T [N, T] (its row
    # slices contiguous) and transposing once measured slower in both dtypes (bench/README.md).
    out = torch.empty(t, n, dtype=tile_dtype)
    x = x.to(tile_dtype)  # itself for float32, as out.float() below
    for n0, tile in _tiles(weight, tile_dtype):
        torch.mm(x, tile.t(), out=out[:, n0:n0 + tile.shape[0]])
    return out.float()


def _tiles(weight: PackedWeight, tile_dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """(first output, the weight's rows from it [rows, K] in `tile_dtype`), tile by tile, each
    a view of one reused buffer (of <= TILE_ELEMENTS floats), dequantized in float32 and, for
    another dtype, rounded into a second buffer of the same layout. A weight held as group
    panels gives whole panels, dequantized transposed ([K, outputs]: a panel's outputs lie side
    by side in memory), as a transposed view."""
    n, k = weight.out_features, weight.in_features
    if weight.panel_storage:
        width = quantized_panel_layout.GROUP_PANEL_OUTPUTS
        panels = -(-n // width)
        per_tile = max(1, min(panels, TILE_ELEMENTS // (k * width)))
        buf_t, rounded_t = _tile_buffers((k, per_tile * width), tile_dtype)
        for b0 in range(0, panels, per_tile):
            count = min(per_tile, panels - b0)
            quantized_panel_layout.panel_tile_t(*weight.group_panels(), weight.layout == "u4",
                                               b0, count, buf_t.numpy())
            rows = min(count * width, n - b0 * width)
            yield b0 * width, _rounded(buf_t[:, :rows], rounded_t).t()
        return
    tile = max(16, min(n, TILE_ELEMENTS // k))
    buf, rounded = _tile_buffers((tile, k), tile_dtype)
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        if weight.is_half:  # a slice, widened by torch (no gather of row ids)
            buf[:rows].copy_(weight.q[n0:n0 + rows].view(weight.half_dtype))
        else:
            ids = np.arange(n0, n0 + rows, dtype=np.int64)
            weight.dequantize_rows_into(ids, buf.numpy(), parallel=False)
        yield n0, _rounded(buf[:rows], rounded)


def _tile_buffers(shape: tuple[int, int], tile_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 buffer a tile is dequantized into, and the one it is rounded into for a
    `tile_dtype` other than float32 (None for float32: torch.mm reads the first)."""
    rounded = None if tile_dtype == torch.float32 else torch.empty(shape, dtype=tile_dtype)
    return torch.empty(shape, dtype=torch.float32), rounded


def _rounded(tile: torch.Tensor, rounded: torch.Tensor | None) -> torch.Tensor:
    """`tile` (a slice of the float32 buffer) itself, or rounded into the same slice of
    `rounded`."""
    if rounded is None:
        return tile
    return rounded[:tile.shape[0], :tile.shape[1]].copy_(tile)
