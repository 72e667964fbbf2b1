"""Per-slot block tables, updated by staged deltas.

A running request's step carries only the block ids allocated in that step; they are staged
after the row's current fill and written with the other staged runs in one copy. Per step the
rows of the scheduled requests are gathered into batch order with one kernel (Triton on CUDA,
numba on CPU); prepare_inputs computes the flat KV slot of every token in its own kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2 import platform
from mrv2.protocol import NULL_BLOCK_ID
from mrv2.state.staged import StagedWriteTensor


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

    def append_block_id_runs(self, slots: np.ndarray, lengths: np.ndarray,
                             values: np.ndarray) -> None:
        """`append_block_ids(slot, ids)` for many distinct slots at once, vectorised (the running
        requests' deltas of one step), with the deltas flat: `values` holds `lengths[i]` ids for
        `slots[i]`, slot after slot (the packed form of CachedRequestData). Empty deltas stage
        nothing."""
        slots = np.asarray(slots, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(slots) != len(lengths) or lengths.sum() != len(values):
            raise ValueError(f"{len(slots)} slots, {len(lengths)} block-id counts summing to "
                             f"{int(lengths.sum())} and {len(values)} block ids")
        has_new = lengths > 0
        if not has_new.any():
            return
        slots, lengths = slots[has_new], lengths[has_new]
        starts = self.num_blocks[slots].astype(np.int64)
        ends = starts + lengths
        if (ends > self.max_num_blocks).any():
            bad = int(np.argmax(ends > self.max_num_blocks))
            raise ValueError(f"slot {slots[bad]} would hold {ends[bad]} blocks, more than the "
                             f"{self.max_num_blocks} a request of max_model_len can use")
        self.table.stage_runs(slots, starts, lengths, np.asarray(values, dtype=np.int32))
        self.num_blocks[slots] = ends

    def clear_row(self, slot: int) -> None:
        # Stale ids past the fill count are never read: seq_lens bound every access.
        self.num_blocks[slot] = 0

    def apply_staged_writes(self) -> None:
        self.table.apply()

    def gather_block_tables(self, idx_mapping: torch.Tensor, out: torch.Tensor,
                            num_rows_padded: int | None = None) -> torch.Tensor:
        """Rows of the batch's slots, in batch order, into the persistent `out` buffer, with
        one kernel launch. Rows past the batch up to `num_rows_padded` are zeroed (the null
        block, DESIGN.md invariant 6). Returns `out[:num_rows_padded]`."""
        num_rows = idx_mapping.shape[0]
        num_rows_padded = num_rows if num_rows_padded is None else num_rows_padded
        if not num_rows <= num_rows_padded <= out.shape[0]:
            raise ValueError(f"cannot pad {num_rows} rows to {num_rows_padded} in a buffer of "
                             f"{out.shape[0]}")
        if platform.kernel_impl(out.device) == platform.CPU:
            from mrv2.state.block_table_numba import gather_rows

            gather_rows(self.table.numpy, np.ascontiguousarray(idx_mapping.numpy(), np.int64),
                        num_rows_padded, out.numpy())
        else:
            from mrv2.state.block_table_triton import gather_rows

            gather_rows(self.table.tensor, idx_mapping, num_rows, num_rows_padded, out)
        return out[:num_rows_padded]
