"""Per-slot block tables, updated by staged deltas; one table per KV cache group
(core/kv_cache_layout.py), stacked: group g's row of slot s is row g * max_num_seqs + s.

A group whose layers' caches are narrower than the KV tensors (`block_scale` > 1) addresses
block id b as its block b * block_scale: its ids are scaled here, as they are staged, so every
kernel after reads the ids of the group's own cache view.

A running request's step carries only the block ids allocated in that step; they are staged
after the row's current fill and written with the other staged runs in one copy. Per step the
rows of the scheduled requests are gathered into batch order with one kernel (Triton on CUDA,
numba on CPU); prepare_inputs computes the flat KV slot of every token in its own kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mrv2 import platform
from mrv2.protocol import NULL_BLOCK_ID
from mrv2.state.staged import StagedWriteTensor


class BlockTables:
    def __init__(self, max_num_seqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device, num_groups: int = 1,
                 block_scales: Sequence[int] | None = None) -> None:
        self.block_size = block_size
        self.block_scales = (None if block_scales is None or set(block_scales) == {1}
                             else np.asarray(block_scales, dtype=np.int32))
        self.max_num_blocks = max_num_blocks_per_req
        self.max_num_seqs = max_num_seqs
        self.num_groups = num_groups
        self.table = StagedWriteTensor(
            torch.full((num_groups * max_num_seqs, max_num_blocks_per_req), NULL_BLOCK_ID,
                       dtype=torch.int32, device=device))
        # Per table row (group-major, as `table`): how many entries are filled.
        self.num_blocks = np.zeros(num_groups * max_num_seqs, dtype=np.int32)

    def append_block_ids(self, slot: int, block_ids: Sequence[int], overwrite: bool = False,
                         group: int = 0) -> None:
        """Append `block_ids` to the slot's table of KV cache group `group` (after clearing
        it when `overwrite`)."""
        row = group * self.max_num_seqs + slot
        start = 0 if overwrite else int(self.num_blocks[row])
        if start + len(block_ids) > self.max_num_blocks:
            raise ValueError(f"slot {slot} would hold {start + len(block_ids)} blocks, more than "
                             f"the {self.max_num_blocks} a request of max_model_len can use")
        if self.block_scales is not None:
            block_ids = np.asarray(block_ids, dtype=np.int32) * self.block_scales[group]
        self.table.stage_write(row, start, block_ids)
        self.num_blocks[row] = start + len(block_ids)

    def append_block_id_runs(self, slots: np.ndarray, lengths: np.ndarray,
                             values: np.ndarray) -> None:
        """`append_block_ids(slot, ids)` for many distinct slots at once, vectorised (the running
        requests' deltas of one step), with the deltas flat: `values` holds `lengths[g, i]` ids
        for `slots[i]` in group g, group after group and slot after slot within one (the packed
        form of CachedRequestData). Empty deltas stage nothing."""
        slots = np.asarray(slots, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, len(slots))
        if len(lengths) != self.num_groups or lengths.sum() != len(values):
            raise ValueError(f"{len(slots)} slots, {lengths.shape} block-id counts summing to "
                             f"{int(lengths.sum())} and {len(values)} block ids for "
                             f"{self.num_groups} KV cache groups")
        values = np.asarray(values, dtype=np.int32)
        if self.block_scales is not None:
            values = values * np.repeat(self.block_scales, lengths.sum(axis=1))
        rows = (slots if self.num_groups == 1 else
                (np.arange(self.num_groups)[:, None] * self.max_num_seqs + slots).reshape(-1))
        lengths = lengths.reshape(-1)
        has_new = lengths > 0
        if not has_new.any():
            return
        rows, lengths = rows[has_new], lengths[has_new]
        starts = self.num_blocks[rows].astype(np.int64)
        ends = starts + lengths
        if (ends > self.max_num_blocks).any():
            bad = int(np.argmax(ends > self.max_num_blocks))
            raise ValueError(f"slot {rows[bad] % self.max_num_seqs} would hold {ends[bad]} "
                             f"blocks, more than the {self.max_num_blocks} a request of "
                             f"max_model_len can use")
        self.table.stage_runs(rows, starts, lengths, values)
        self.num_blocks[rows] = ends

    def clear_row(self, slot: int) -> None:
        # Stale ids past the fill count are never read: seq_lens bound every access.
        self.num_blocks[slot::self.max_num_seqs] = 0

    def apply_staged_writes(self) -> None:
        self.table.apply()

    def gather_block_tables(self, idx_mapping: torch.Tensor, out: torch.Tensor,
                            num_rows_padded: int | None = None) -> torch.Tensor:
        """Rows of the batch's slots, in batch order, of every group into the persistent `out`
        buffer [num_groups, rows, max_num_blocks], with one kernel launch. Rows past the batch
        up to `num_rows_padded` are zeroed (the null block, DESIGN.md invariant 6). Returns
        `out[:, :num_rows_padded]`."""
        num_rows = idx_mapping.shape[0]
        num_rows_padded = num_rows if num_rows_padded is None else num_rows_padded
        if not num_rows <= num_rows_padded <= out.shape[1]:
            raise ValueError(f"cannot pad {num_rows} rows to {num_rows_padded} in a buffer of "
                             f"{out.shape[1]}")
        if platform.kernel_impl(out.device) == platform.CPU:
            from mrv2.state.block_table_numba import gather_rows

            gather_rows(self.table.numpy, np.ascontiguousarray(idx_mapping.numpy(), np.int64),
                        num_rows_padded, out.numpy())
        else:
            from mrv2.state.block_table_triton import gather_rows

            gather_rows(self.table.tensor, idx_mapping, num_rows, num_rows_padded, out)
        return out[:, :num_rows_padded]
