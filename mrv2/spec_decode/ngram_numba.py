"""N-gram (prompt-lookup) draft proposer on the CPU: the numba twin of ngram.propose_ngram.

Same name, same argument order and identical results (drafts[r, k:] = 0 included), on numpy
arrays: token_ids int32 [S, L], slots int64 [R], total_len int32 [S], min_n, max_n ints,
max_drafts int32 [R], drafts int32 [R, K] (out), num_drafts int32 [R] (out). ngram.py states
the semantics. Each row scans its context backwards from the latest admissible start, so the
first hit is the latest occurrence and the scan stops there.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def propose_ngram(token_ids: np.ndarray, slots: np.ndarray, total_len: np.ndarray, min_n: int,
                  max_n: int, max_drafts: np.ndarray, drafts: np.ndarray,
                  num_drafts: np.ndarray) -> None:
    """Fill drafts [R, K] and num_drafts [R] with each row's n-gram proposal."""
    k_max = drafts.shape[1]
    for r in range(slots.shape[0]):
        drafts[r, :] = 0
        num_drafts[r] = 0
        s = slots[r]
        n_tok = total_len[s]
        cap = min(k_max, max_drafts[r])
        if cap <= 0:
            continue
        c = token_ids[s]
        tail = n_tok - 1  # n <= n_tok - 1: the suffix needs an earlier start
        for n in range(min(max_n, tail), min_n - 1, -1):
            suffix_at = n_tok - n
            start = -1
            # i + n < n_tok; the latest such i is n_tok - n - 1.
            for i in range(suffix_at - 1, -1, -1):
                j = 0
                while j < n and c[i + j] == c[suffix_at + j]:
                    j += 1
                if j == n:
                    start = i
                    break
            if start >= 0:
                k = min(cap, n_tok - (start + n))
                for j in range(k):
                    drafts[r, j] = c[start + n + j]
                num_drafts[r] = k
                break
