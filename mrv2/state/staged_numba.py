"""CPU kernel for staged writes: copy ragged runs into the flat destination, in staging order.

Runs are copied one after the other, so a later write to the same element wins. The arrays are
bit views (int8/16/32/64 of the destination's item size): one compiled kernel per item size
serves every dtype.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def apply_runs(dst, starts, lengths, values):
    k = 0
    for r in range(starts.shape[0]):
        start = starts[r]
        for j in range(lengths[r]):
            dst[start + j] = values[k]
            k += 1
