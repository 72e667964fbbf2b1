"""Triton kernel for input preparation: one program per (padded) batch row, plus one for the
token tail.

`packed` is the step's host data in one int64 upload: idx_mapping [num_reqs], num_scheduled
[num_reqs], offsets [num_reqs], query_start_loc [num_reqs_padded + 1] (padded entries =
num_tokens). A row program writes its entries of idx_mapping, num_scheduled, query_start_loc,
seq_lens and logits_indices and, for each of its tokens, input_ids, positions and slot_mapping.
A row starts `offset` tokens past its slot's num_computed (speculative decoding's verify rows,
one per token, and a draft's catch-up before it). The token at position num_computed, past
the prefill, is the last sampled one and comes from `last_sampled`; every other token (the
prefill's, the drafts written after the history) comes from the token history. Padded rows
get seq_len 0; the last program writes query_start_loc[0] and pads the token tail (ids and
positions 0 up to num_tokens_padded, slot_mapping -1 up to the buffer's end). `block_table`
stacks the KV cache groups' tables (num_slots rows each); slot_mapping is [groups,
max_num_tokens], one row per group.

The four counts of the batch are not specialised (one compiled variant for every batch); the
other integers (buffer and table widths, block size) come from the configuration.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mrv2.platform import triton_kernel

TOKEN_TILE = 256  # tokens per loop iteration of a program
_PER_STEP_BATCH_ARGS = ("num_reqs", "num_reqs_padded", "num_tokens", "num_tokens_padded")


def _prepare_inputs_kernel(
        packed_ptr, num_reqs, num_reqs_padded, num_tokens, num_tokens_padded, max_num_tokens,
        num_computed_ptr, prefill_len_ptr, last_sampled_ptr, token_ids_ptr, max_model_len,
        block_table_ptr, max_num_blocks, block_size, num_slots,
        idx_mapping_ptr, num_scheduled_ptr, query_start_loc_ptr, seq_lens_ptr,
        logits_indices_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr,
        NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    qsl_ptr = packed_ptr + 3 * num_reqs
    if row < num_reqs_padded:
        end = tl.load(qsl_ptr + row + 1)
        tl.store(query_start_loc_ptr + row + 1, end.to(tl.int32))
        tl.store(logits_indices_ptr + row, end - 1)
        if row < num_reqs:
            slot = tl.load(packed_ptr + row)
            n = tl.load(packed_ptr + num_reqs + row).to(tl.int32)
            start = tl.load(qsl_ptr + row)
            tl.store(idx_mapping_ptr + row, slot)
            tl.store(num_scheduled_ptr + row, n)
            num_computed = tl.load(num_computed_ptr + slot)
            computed = num_computed + tl.load(packed_ptr + 2 * num_reqs + row).to(tl.int32)
            prefill_len = tl.load(prefill_len_ptr + slot)
            last = tl.load(last_sampled_ptr + slot).to(tl.int32)
            tl.store(seq_lens_ptr + row, computed + n)
            for i in range(0, n, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                mask = offs < n
                pos = computed + offs
                from_history = (pos < prefill_len) | (pos != num_computed)
                history = tl.load(token_ids_ptr + slot * max_model_len + pos,
                                  mask=mask & from_history, other=0)
                out = start + offs
                tl.store(input_ids_ptr + out, tl.where(from_history, history, last), mask=mask)
                tl.store(positions_ptr + out, pos.to(tl.int64), mask=mask)
                for g in tl.static_range(NUM_GROUPS):
                    table_row = g * num_slots + slot
                    block = tl.load(block_table_ptr + table_row * max_num_blocks
                                    + pos // block_size, mask=mask, other=0)
                    tl.store(slot_mapping_ptr + g * max_num_tokens + out,
                             block.to(tl.int64) * block_size + pos % block_size, mask=mask)
        else:
            tl.store(idx_mapping_ptr + row, 0)
            tl.store(num_scheduled_ptr + row, 0)
            tl.store(seq_lens_ptr + row, 0)
    else:
        tl.store(query_start_loc_ptr, 0)
        for i in range(num_tokens, max_num_tokens, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            padded = offs < num_tokens_padded
            tl.store(input_ids_ptr + offs, tl.full([BLOCK], 0, dtype=tl.int32), mask=padded)
            tl.store(positions_ptr + offs, tl.full([BLOCK], 0, dtype=tl.int64), mask=padded)
            for g in tl.static_range(NUM_GROUPS):
                tl.store(slot_mapping_ptr + g * max_num_tokens + offs,
                         tl.full([BLOCK], -1, dtype=tl.int64), mask=offs < max_num_tokens)


def prepare_inputs(packed: torch.Tensor, num_reqs: int, num_reqs_padded: int, num_tokens: int,
                   num_tokens_padded: int, num_computed: torch.Tensor,
                   prefill_len: torch.Tensor, last_sampled: torch.Tensor,
                   token_ids: torch.Tensor, block_table: torch.Tensor, block_size: int,
                   idx_mapping: torch.Tensor, num_scheduled: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   logits_indices: torch.Tensor, input_ids: torch.Tensor,
                   positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """slot_mapping [groups, max_num_tokens]; block_table [groups * num_slots, cols]."""
    kernel = triton_kernel(_prepare_inputs_kernel, do_not_specialize=_PER_STEP_BATCH_ARGS)
    kernel[(num_reqs_padded + 1,)](
        packed, num_reqs, num_reqs_padded, num_tokens, num_tokens_padded,
        slot_mapping.shape[1], num_computed, prefill_len, last_sampled, token_ids,
        token_ids.shape[1], block_table, block_table.shape[1], block_size,
        block_table.shape[0] // slot_mapping.shape[0], idx_mapping, num_scheduled,
        query_start_loc, seq_lens, logits_indices, input_ids, positions, slot_mapping,
        NUM_GROUPS=slot_mapping.shape[0], BLOCK=TOKEN_TILE)
