"""CPU kernel: gather the block-table rows of a batch's slots into batch order."""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def gather_rows(table, idx_mapping, num_rows_padded, out):
    """out[r] = table[idx_mapping[r]] for the real rows; padded rows (up to num_rows_padded)
    are zeros, the null block."""
    num_rows = idx_mapping.shape[0]
    # Element loops: numba's slice assignment is several times slower here.
    for r in range(num_rows):
        slot = idx_mapping[r]
        for c in range(table.shape[1]):
            out[r, c] = table[slot, c]
    for r in range(num_rows, num_rows_padded):
        for c in range(table.shape[1]):
            out[r, c] = 0
