"""Triton kernel: gather the block-table rows of a batch's slots into batch order.

Grid (padded rows, column blocks). Real rows copy their slot's row; padded rows are zeros,
the null block (DESIGN.md invariant 6). `num_rows` changes per step and is not specialised;
`num_cols` is the table's width, fixed by the configuration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

COLUMN_TILE = 512  # block-table columns per program


def _gather_rows_kernel(table_ptr, idx_mapping_ptr, out_ptr, num_rows, num_cols,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    if row < num_rows:
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        values = tl.load(table_ptr + slot * num_cols + cols, mask=mask)
    else:
        values = tl.full([BLOCK], 0, dtype=tl.int32)
    tl.store(out_ptr + row.to(tl.int64) * num_cols + cols, values, mask=mask)


def gather_rows(table: torch.Tensor, idx_mapping: torch.Tensor, num_rows: int,
                num_rows_padded: int, out: torch.Tensor) -> None:
    """table [R, C] int32, idx_mapping [>= num_rows] int64, out [>= num_rows_padded, C]."""
    if num_rows_padded == 0:
        return
    num_cols = table.shape[1]
    grid = (num_rows_padded, triton.cdiv(num_cols, COLUMN_TILE))
    triton_kernel(_gather_rows_kernel, do_not_specialize=("num_rows",))[grid](
        table, idx_mapping, out, num_rows, num_cols, BLOCK=COLUMN_TILE)
