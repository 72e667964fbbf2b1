"""Prefill on a packed weight (quantized.py): float32 tiles of output rows dequantized into one
reused buffer, each multiplied with torch.mm, so the float32 weight never exists whole.

Why tiles: past the GEMV's rows a prefill step is bound by its multiply-adds, which torch.mm
(oneDNN / MKL) does at the CPU's float32 rate; a tile small enough to stay in cache while
torch.mm reads it costs one pass over the weight's bytes. The tile is dequantized on the calling
thread (torch.mm parallelises; see quantized_numba.dequant_rows_serial), exactly: the products
are those of x @ dequantize().T, in torch.mm's summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mrv2.models.layers import quantized_panel_layout

if TYPE_CHECKING:
    from mrv2.models.layers.quantized import PackedWeight

# Float32 elements of one dequantized tile (1 MiB): stays in L2/L3 while torch.mm reads it.
TILE_ELEMENTS = 1 << 18
# A 16-bit weight widens fast (torch's vectorised copy), so the per-tile cost of torch.mm
# dominates instead: larger tiles (4 MiB) measured faster (bench/README.md).
HALF_TILE_ELEMENTS = 1 << 20


def tiled_linear(x: torch.Tensor, weight: PackedWeight,
                 tile_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x float32 [T, K] @ weight^T -> float32 [T, N], tile by tile; `tile_dtype` bfloat16 (a
    CPU that multiplies it on matrix units, a bfloat16 model: LinearKernel.BLOCK_TILES_BF16)
    multiplies x and each tile rounded to bfloat16, each output rounded once, as a bfloat16
    model's linears do, ~4x faster than float32 on AMX at 2048 rows (bench/README.md)."""
    if tile_dtype == torch.bfloat16:
        return _bf16_tiled_linear(x, weight)
    if weight.panel_storage:
        return _panel_tiled_linear(x, weight)
    # out^T [N, T] is filled tile by tile: its row slices are contiguous, so torch.mm writes
    # them in place; one buffer of <= TILE_ELEMENTS floats (HALF_TILE_ELEMENTS for a 16-bit
    # weight) is reused for every tile.
    n, k = weight.out_features, weight.in_features
    tile_elements = HALF_TILE_ELEMENTS if weight.is_half else TILE_ELEMENTS
    tile = max(16, min(n, tile_elements // k))
    buf = torch.empty(tile, k, dtype=torch.float32)
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    xt = x.t()
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        if weight.is_half:  # a slice, widened by torch (no gather of row ids)
            buf[:rows].copy_(weight.q[n0:n0 + rows].view(weight.half_dtype))
        else:
            ids = np.arange(n0, n0 + rows, dtype=np.int64)
            weight.dequantize_rows_into(ids, buf.numpy(), parallel=False)
        torch.mm(buf[:rows], xt, out=out_t[n0:n0 + rows])
    return out_t.t().contiguous()


def _panel_tiled_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    # A weight held as group panels: a tile of whole panels dequantized transposed ([K,
    # outputs]: a panel's outputs lie side by side in memory), torch.mm taking its transpose.
    n, k = weight.out_features, weight.in_features
    width = quantized_panel_layout.GROUP_PANEL_OUTPUTS
    panels = -(-n // width)
    per_tile = max(1, min(panels, TILE_ELEMENTS // (k * width)))
    buf_t = torch.empty(k, per_tile * width, dtype=torch.float32)
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    xt = x.t()
    for b0 in range(0, panels, per_tile):
        count = min(per_tile, panels - b0)
        quantized_panel_layout.panel_tile_t(*weight.group_panels(), weight.layout == "u4", b0,
                                           count, buf_t.numpy())
        n0 = b0 * width
        rows = min(count * width, n - n0)
        torch.mm(buf_t[:, :rows].t(), xt, out=out_t[n0:n0 + rows])
    return out_t.t().contiguous()


def _bf16_tiled_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    # Each float32 tile ([outputs, K] rows of the blocks, or [K, outputs] of whole panels)
    # rounded into a bfloat16 buffer, multiplied by x in bfloat16 into out's columns.
    n, k = weight.out_features, weight.in_features
    xb = x.to(torch.bfloat16)
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if weight.panel_storage:
        width = quantized_panel_layout.GROUP_PANEL_OUTPUTS
        panels = -(-n // width)
        per_tile = max(1, min(panels, TILE_ELEMENTS // (k * width)))
        buf_t = torch.empty(k, per_tile * width, dtype=torch.float32)
        half_t = torch.empty(k, per_tile * width, dtype=torch.bfloat16)
        for b0 in range(0, panels, per_tile):
            count = min(per_tile, panels - b0)
            quantized_panel_layout.panel_tile_t(*weight.group_panels(), weight.layout == "u4",
                                               b0, count, buf_t.numpy())
            n0 = b0 * width
            rows = min(count * width, n - n0)
            half_t[:, :rows].copy_(buf_t[:, :rows])
            torch.mm(xb, half_t[:, :rows], out=out[:, n0:n0 + rows])
        return out.float()
    tile = max(16, min(n, TILE_ELEMENTS // k))
    buf = torch.empty(tile, k, dtype=torch.float32)
    half = torch.empty(tile, k, dtype=torch.bfloat16)
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        weight.dequantize_rows_into(np.arange(n0, n0 + rows, dtype=np.int64), buf.numpy(),
                                    parallel=False)
        half[:rows].copy_(buf[:rows])
        torch.mm(xb, half[:rows].t(), out=out[:, n0:n0 + rows])
    return out.float()
