"""Triton kernel for RequestState.post_update: one program per batch row.

The row count is the grid's; the one integer argument, `max_model_len`, is the configuration's,
so batches of any size share one compiled variant.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mrv2.platform import triton_kernel


def _post_update_kernel(idx_mapping_ptr, num_scheduled_ptr, sampled_ptr, num_computed_ptr,
                        prefill_len_ptr, total_len_ptr, last_sampled_ptr, token_ids_ptr,
                        max_model_len):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row)
    computed = tl.load(num_computed_ptr + slot) + tl.load(num_scheduled_ptr + row)
    tl.store(num_computed_ptr + slot, computed)
    # A row whose prefill is still incomplete sampled nothing.
    if computed >= tl.load(prefill_len_ptr + slot):
        token = tl.load(sampled_ptr + row)
        pos = tl.minimum(computed, max_model_len - 1)
        tl.store(token_ids_ptr + slot.to(tl.int64) * max_model_len + pos, token.to(tl.int32))
        tl.store(total_len_ptr + slot, computed + 1)
        tl.store(last_sampled_ptr + slot, token.to(tl.int64))


def post_update(idx_mapping: torch.Tensor, num_scheduled: torch.Tensor, sampled: torch.Tensor,
                num_computed: torch.Tensor, prefill_len: torch.Tensor, total_len: torch.Tensor,
                last_sampled: torch.Tensor, token_ids: torch.Tensor) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    triton_kernel(_post_update_kernel)[(num_reqs,)](
        idx_mapping, num_scheduled, sampled, num_computed, prefill_len, total_len,
        last_sampled, token_ids, token_ids.shape[1])
