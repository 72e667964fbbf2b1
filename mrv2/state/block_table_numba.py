"""CPU kernel: gather the block-table rows of a batch's slots into batch order."""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def gather_rows(table, idx_mapping, num_rows_padded, out):
    """out[g, r] = table[g * num_slots + idx_mapping[r]] for each KV cache group g (the table
    stacks the groups' tables, `num_slots` rows each) and the real rows; padded rows (up to
    num_rows_padded) are zeros, the null block."""
    num_rows = idx_mapping.shape[0]
    num_groups = out.shape[0]
    num_slots = table.shape[0] // num_groups
    # Element loops: numba's slice assignment is several times slower here.
    for g in range(num_groups):
        for r in range(num_rows):
            slot = g * num_slots + idx_mapping[r]
            for c in range(table.shape[1]):
                out[g, r, c] = table[slot, c]
        for r in range(num_rows, num_rows_padded):
            for c in range(table.shape[1]):
                out[g, r, c] = 0
