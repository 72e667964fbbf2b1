"""Gather one step's inputs from the persistent slot state into the step buffers.

Positions and seq_lens come from the device num_computed of each slot; input tokens from the
slot's token history, which post_update extends on the device, so a sampled token is fed back
without passing through the host. Host-side work is a handful of vectorised numpy ops over the
batch (never a Python loop over requests).
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.attention.backend import AttentionMetadata
from mrv2.inputs.batch import InputBatch
from mrv2.inputs.buffers import InputBuffers
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState


def decode_first_order(num_scheduled: np.ndarray) -> np.ndarray:
    """Stable permutation that puts rows with one query token first."""
    return np.argsort(num_scheduled > 1, kind="stable")


def prepare_inputs(req_ids: list[str], idx_mapping_np: np.ndarray, num_scheduled_np: np.ndarray,
                   state: RequestState, block_tables: BlockTables,
                   buffers: InputBuffers) -> InputBatch:
    """Rows must already be in decode-first order. Returns views of `buffers`."""
    num_reqs = len(req_ids)
    num_tokens = int(num_scheduled_np.sum())
    if num_tokens > buffers.max_num_tokens:
        raise ValueError(f"{num_tokens} scheduled tokens exceed the step capacity "
                         f"{buffers.max_num_tokens}")
    if num_reqs > buffers.max_num_reqs:
        raise ValueError(f"{num_reqs} rows exceed the step capacity {buffers.max_num_reqs}")
    device = buffers.input_ids.device

    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
    row_of_token = np.repeat(np.arange(num_reqs), num_scheduled_np)
    offset_in_row = np.arange(num_tokens) - query_start_loc_np[row_of_token]
    seq_lens_np = (state.num_computed_host[idx_mapping_np] + num_scheduled_np).astype(np.int32)

    idx_mapping = buffers.idx_mapping[:num_reqs]
    idx_mapping.copy_(torch.from_numpy(idx_mapping_np), non_blocking=True)
    num_scheduled = buffers.num_scheduled[:num_reqs]
    num_scheduled.copy_(torch.from_numpy(num_scheduled_np), non_blocking=True)
    query_start_loc = buffers.query_start_loc[:num_reqs + 1]
    query_start_loc.copy_(torch.from_numpy(query_start_loc_np), non_blocking=True)
    token_slots = buffers.token_slots[:num_tokens]
    token_slots.copy_(torch.from_numpy(idx_mapping_np[row_of_token]), non_blocking=True)

    positions = buffers.positions[:num_tokens]
    torch.add(state.num_computed.tensor[token_slots],
              torch.from_numpy(offset_in_row).to(device, non_blocking=True), out=positions)
    input_ids = buffers.input_ids[:num_tokens]
    flat_index = token_slots * state.max_model_len + positions
    torch.index_select(state.token_ids.tensor.view(-1), 0, flat_index, out=input_ids)

    seq_lens = buffers.seq_lens[:num_reqs]
    torch.add(state.num_computed.tensor[idx_mapping], num_scheduled, out=seq_lens)
    logits_indices = buffers.logits_indices[:num_reqs]
    torch.sub(query_start_loc[1:].long(), 1, out=logits_indices)

    slot_mapping = block_tables.compute_slot_mapping(token_slots, positions, buffers.slot_mapping)
    tables = block_tables.gather_block_tables(idx_mapping, buffers.block_tables)

    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        num_decodes=int((num_scheduled_np == 1).sum()),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc_np,
        seq_lens_cpu=seq_lens_np,
        max_seq_len=int(seq_lens_np.max()) if num_reqs else 0,
    )
    return InputBatch(req_ids=req_ids, idx_mapping=idx_mapping, idx_mapping_np=idx_mapping_np,
                      num_scheduled=num_scheduled, num_scheduled_np=num_scheduled_np,
                      num_tokens=num_tokens, input_ids=input_ids, positions=positions,
                      logits_indices=logits_indices, attn_metadata=metadata)
