"""BlockTables operations only tests use: the list form of the batched append and a torch
reference for the slot mapping (prepare_inputs computes it in its own kernel)."""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np
import torch

from mrv2.state.block_table import BlockTables


def append_block_ids_batch(tables: BlockTables, slots: np.ndarray,
                           block_ids: Sequence[Sequence[int]]) -> None:
    """`tables.append_block_ids(slot, ids)` for many distinct slots at once, vectorised through
    `append_block_id_runs` (the packed form production uses), for tables of one KV cache
    group. Empty deltas stage nothing."""
    lengths = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    values = np.fromiter(chain.from_iterable(block_ids), dtype=np.int32,
                         count=int(lengths.sum()))
    tables.append_block_id_runs(slots, lengths, values)


def compute_slot_mapping(tables: BlockTables, token_slots: torch.Tensor,
                         positions: torch.Tensor, out: torch.Tensor,
                         group: int = 0) -> torch.Tensor:
    """Flat KV slot of each token in KV cache group `group`: table[group's row of slot,
    pos // block_size] * block_size + offset.

    `out` beyond the real tokens is filled with -1 so padded tokens write nothing. Torch ops,
    any device.
    """
    num_tokens = positions.shape[0]
    rows = group * tables.max_num_seqs + token_slots
    block_ids = tables.table.tensor[rows, positions // tables.block_size]
    torch.add(block_ids.long() * tables.block_size, positions % tables.block_size,
              out=out[:num_tokens])
    out[num_tokens:].fill_(-1)
    return out[:num_tokens]
