"""CPU kernel for input preparation: the same outputs as prepare_triton and the block-table
gather (block_table_triton), in one call, row by row.

Inputs are host arrays (idx_mapping, num_scheduled, query_start_loc padded with num_tokens)
and the persistent slot state; outputs are the step buffers. A row starts `offsets[row]`
tokens after its slot's computed count (0, except the verify rows of speculative decoding:
one row per token; a draft model's catch-up, from before it). The token at `num_computed`, once
past `prefill_len`, is the sampled one: it comes from `last_sampled` (on the device, never
through the host); every other token comes from the token history (prefill tokens, tokens
sampled before, the drafts after the sampled one).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def prepare_inputs(idx_mapping_host, num_scheduled_host, offsets, query_start_loc_host,
                   num_tokens_padded, num_computed, prefill_len, last_sampled, token_ids,
                   block_table, block_size, idx_mapping, num_scheduled, query_start_loc,
                   seq_lens, logits_indices, input_ids, positions, slot_mapping,
                   block_tables):
    """`block_table` stacks the KV cache groups' tables (num_slots rows each); `block_tables`
    [groups, rows, cols] and `slot_mapping` [groups, tokens] get each group's."""
    num_reqs = idx_mapping_host.shape[0]
    num_reqs_padded = query_start_loc_host.shape[0] - 1
    num_tokens = query_start_loc_host[num_reqs]
    num_groups = block_tables.shape[0]
    num_slots = block_table.shape[0] // num_groups
    query_start_loc[0] = 0
    for row in range(num_reqs_padded):
        end = query_start_loc_host[row + 1]
        query_start_loc[row + 1] = end
        logits_indices[row] = end - 1
        if row >= num_reqs:  # padding: no tokens, no keys, the null block
            idx_mapping[row] = 0
            num_scheduled[row] = 0
            seq_lens[row] = 0
            for g in range(num_groups):
                for col in range(block_tables.shape[2]):
                    block_tables[g, row, col] = 0
            continue
        slot = idx_mapping_host[row]
        # Element loops: numba's slice assignment is several times slower here.
        for g in range(num_groups):
            for col in range(block_tables.shape[2]):
                block_tables[g, row, col] = block_table[g * num_slots + slot, col]
        n = num_scheduled_host[row]
        idx_mapping[row] = slot
        num_scheduled[row] = n
        computed = num_computed[slot] + offsets[row]
        seq_lens[row] = computed + n
        start = query_start_loc_host[row]
        for i in range(n):
            pos = computed + i
            token = start + i
            positions[token] = pos
            if pos < prefill_len[slot] or pos != num_computed[slot]:
                input_ids[token] = token_ids[slot, pos]
            else:
                input_ids[token] = last_sampled[slot]
            for g in range(num_groups):
                block = block_table[g * num_slots + slot, pos // block_size]
                slot_mapping[g, token] = block * block_size + pos % block_size
    for token in range(num_tokens, num_tokens_padded):
        input_ids[token] = 0
        positions[token] = 0
    # Padded tokens, and everything past them, never write the KV cache.
    for g in range(num_groups):
        for token in range(num_tokens, slot_mapping.shape[1]):
            slot_mapping[g, token] = -1


@njit(cache=True)
def host_sizes(num_scheduled, idx_mapping, offsets, num_computed_host, num_reqs_padded):
    """Host-side shapes of a step in one pass: (query_start_loc [num_reqs_padded + 1], seq_lens
    [num_reqs_padded] from the host mirror of num_computed, num_tokens, max_seq_len,
    num_decodes). Padded entries: query_start_loc = num_tokens, seq_lens = 0."""
    num_reqs = num_scheduled.shape[0]
    query_start_loc = np.empty(num_reqs_padded + 1, dtype=np.int32)
    seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
    total = 0
    max_seq_len = 0
    num_decodes = 0
    query_start_loc[0] = 0
    for row in range(num_reqs):
        n = num_scheduled[row]
        total += n
        query_start_loc[row + 1] = total
        seq_len = num_computed_host[idx_mapping[row]] + offsets[row] + n
        seq_lens[row] = seq_len
        max_seq_len = max(max_seq_len, seq_len)
        if n == 1:
            num_decodes += 1
    query_start_loc[num_reqs + 1:] = total
    return query_start_loc, seq_lens, total, max_seq_len, num_decodes
