"""Persistent per-step input buffers (DESIGN.md invariant 2).

Allocated once with fixed addresses and fixed capacity (max_num_batched_tokens tokens,
max_num_seqs rows); every step writes a prefix of them. A captured graph can therefore read the
same addresses on every replay.
"""

from __future__ import annotations

import torch


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 device: torch.device) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs

        def buf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = buf(max_num_tokens, dtype=torch.int32)
        self.positions = buf(max_num_tokens, dtype=torch.int64)
        self.token_slots = buf(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = buf(max_num_tokens, dtype=torch.int64)
        self.query_start_loc = buf(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(max_num_reqs, dtype=torch.int32)
        self.idx_mapping = buf(max_num_reqs, dtype=torch.int64)
        self.num_scheduled = buf(max_num_reqs, dtype=torch.int32)
        self.logits_indices = buf(max_num_reqs, dtype=torch.int64)
        self.block_tables = buf(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32)
