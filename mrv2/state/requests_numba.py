"""CPU kernel for RequestState.post_update: advance each batch row's slot after sampling."""

from __future__ import annotations

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
