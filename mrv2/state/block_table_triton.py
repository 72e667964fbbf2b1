"""Triton kernel: gather the block-table rows of a batch's slots into batch order.

Grid (padded rows, column blocks, KV cache groups): the table stacks the groups' tables
(`num_slots` rows each), the output is [groups, rows, columns]. Real rows copy their slot's
row; padded rows are zeros,
the null block (DESIGN.md invariant 6). `num_rows` changes per step and is not specialised;
`num_cols` is the table's width, fixed by the configuration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

COLUMN_TILE = 512  # block-table columns per program


def _gather_rows_kernel(table_ptr, idx_mapping_ptr, out_ptr, num_rows, num_cols, num_slots,
                        out_rows, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    group = tl.program_id(2).to(tl.int64)
    mask = cols < num_cols
    if row < num_rows:
        slot = group * num_slots + tl.load(idx_mapping_ptr + row).to(tl.int64)
        values = tl.load(table_ptr + slot * num_cols + cols, mask=mask)
    else:
        values = tl.full([BLOCK], 0, dtype=tl.int32)
    tl.store(out_ptr + (group * out_rows + row) * num_cols + cols, values, mask=mask)


def gather_rows(table: torch.Tensor, idx_mapping: torch.Tensor, num_rows: int,
                num_rows_padded: int, out: torch.Tensor) -> None:
    """table [G * S, C] int32, idx_mapping [>= num_rows] int64, out [G, >= num_rows_padded,
    C] (contiguous)."""
    if num_rows_padded == 0:
        return
    num_groups, out_rows, num_cols = out.shape
    grid = (num_rows_padded, triton.cdiv(num_cols, COLUMN_TILE), num_groups)
    triton_kernel(_gather_rows_kernel, do_not_specialize=("num_rows",))[grid](
        table, idx_mapping, out, num_rows, num_cols, table.shape[0] // num_groups, out_rows,
        BLOCK=COLUMN_TILE)
