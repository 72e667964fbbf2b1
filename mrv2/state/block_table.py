"""Per-slot block tables, updated by staged deltas.

A running request's step carries only the block ids allocated in that step; they are staged
after the row's current fill and written with the other staged runs in one copy. Per step the
rows of the scheduled requests are gathered into batch order and the flat KV slot of every
token is computed, each with one vectorised op.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.state.staged import StagedWriteTensor

# Row padding points at block 0, the null block the KV cache manager never hands out.
NULL_BLOCK_ID = 0


class BlockTables:
    def __init__(self, max_num_seqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks_per_req
        self.table = StagedWriteTensor(
            torch.full((max_num_seqs, max_num_blocks_per_req), NULL_BLOCK_ID, dtype=torch.int32,
                       device=device))
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)

    def append_block_ids(self, slot: int, block_ids: list[int], overwrite: bool = False) -> None:
        start = 0 if overwrite else int(self.num_blocks[slot])
        if start + len(block_ids) > self.max_num_blocks:
            raise ValueError(f"slot {slot} would hold {start + len(block_ids)} blocks, more than "
                             f"the {self.max_num_blocks} a request of max_model_len can use")
        self.table.stage_write(slot, start, block_ids)
        self.num_blocks[slot] = start + len(block_ids)

    def clear_row(self, slot: int) -> None:
        # Stale ids past the fill count are never read: seq_lens bound every access.
        self.num_blocks[slot] = 0

    def apply_staged_writes(self) -> None:
        self.table.apply()

    def gather_block_tables(self, idx_mapping: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of the batch's slots, in batch order, into the persistent `out` buffer."""
        num_reqs = idx_mapping.shape[0]
        torch.index_select(self.table.tensor, 0, idx_mapping, out=out[:num_reqs])
        return out[:num_reqs]

    def compute_slot_mapping(self, token_slots: torch.Tensor, positions: torch.Tensor,
                             out: torch.Tensor) -> torch.Tensor:
        """Flat KV slot of each token: table[slot, pos // block_size] * block_size + offset.

        `out` beyond the real tokens is filled with -1 so padded tokens write nothing.
        """
        num_tokens = positions.shape[0]
        block_ids = self.table.tensor[token_slots, positions // self.block_size]
        torch.add(block_ids.long() * self.block_size, positions % self.block_size,
                  out=out[:num_tokens])
        out[num_tokens:].fill_(-1)
        return out[:num_tokens]
