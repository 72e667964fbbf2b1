"""CPU kernels for RequestState.post_update (advance each batch row's slot after sampling)
and post_update_steps (the same for a run of decode steps)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def post_update(idx_mapping, num_scheduled, sampled, num_computed, prefill_len, total_len,
                last_sampled, token_ids):
    max_model_len = token_ids.shape[1]
    for row in range(idx_mapping.shape[0]):
        slot = idx_mapping[row]
        computed = num_computed[slot] + num_scheduled[row]
        num_computed[slot] = computed
        # A row whose prefill is still incomplete sampled nothing.
        if computed >= prefill_len[slot]:
            token = sampled[row]
            token_ids[slot, min(computed, max_model_len - 1)] = token
            total_len[slot] = computed + 1
            last_sampled[slot] = token


@njit(cache=True)
def post_update_steps(idx_mapping, sampled, num_computed, prefill_len, total_len,
                      last_sampled, token_ids):
    """`post_update` for each column of `sampled` [rows, steps] in order, a token a row a
    step (decode rows)."""
    ones = np.ones(idx_mapping.shape[0], np.int32)
    for s in range(sampled.shape[1]):
        post_update(idx_mapping, ones, sampled[:, s], num_computed, prefill_len, total_len,
                    last_sampled, token_ids)
