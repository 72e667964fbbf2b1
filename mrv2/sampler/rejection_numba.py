"""CPU twin of rejection.verify_drafts (see there): one pass over each request's rows."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def verify_drafts(sampled, input_ids, first_row, num_rows, nan_rows):
    num_reqs = first_row.shape[0]
    num_accepted = np.empty(num_reqs, np.int32)
    final_rows = np.empty(num_reqs, np.int64)
    nan = np.zeros(num_reqs, np.bool_)
    for r in range(num_reqs):
        start = first_row[r]
        accepted = 0
        while (accepted < num_rows[r] - 1
               and sampled[start + accepted] == input_ids[start + accepted + 1]):
            accepted += 1
        num_accepted[r] = accepted
        final_rows[r] = start + accepted
        for j in range(accepted + 1):
            nan[r] |= nan_rows[start + j]
    return num_accepted, final_rows, nan
