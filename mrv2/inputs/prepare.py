"""Gather one step's inputs from the persistent slot state into the step buffers.

Positions and seq_lens come from the device num_computed of each slot. Prefill tokens come
from the slot's token history; a sampled token being fed back (position >= prefill_len, i.e.
a decode row) comes from the device `last_sampled` of its slot, so it never passes through the
host. One kernel computes input_ids, positions, query_start_loc, seq_lens, logits_indices and
slot_mapping and one more gathers the block-table rows (Triton on CUDA; on CPU one numba
kernel does both). The host computes the step's shapes in one numba pass: no Python loop over
requests.

Padding for graph replay (DESIGN.md invariant 6): with `num_tokens_padded` / `num_reqs_padded`
above the real sizes, padded query_start_loc entries = num_tokens, padded seq_lens = 0,
padded block-table rows = 0, padded input_ids / positions = 0 and slot_mapping = -1 past the
real tokens (up to the buffer's end).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mrv2.attention.backend import AttentionMetadata
from mrv2.inputs import prepare_numba
from mrv2.inputs.batch import InputBatch
from mrv2.inputs.buffers import InputBuffers
from mrv2 import platform
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState


def decode_first_order(is_prefill: np.ndarray) -> np.ndarray:
    """Stable permutation that puts the decode rows (not `is_prefill`: one query token, or a
    verify row, which becomes decode rows) first."""
    return np.argsort(is_prefill, kind="stable")


def run_offsets(counts: np.ndarray) -> np.ndarray:
    """0 .. c - 1 for each count c, concatenated (int64): each row's place in its run when
    rows are repeated `counts` times."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def repeat_offsets(values: np.ndarray) -> np.ndarray:
    """Each value's place in its run of equal consecutive values (0 for one not repeated)."""
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return run_offsets(np.diff(np.r_[starts, len(values)]))


def verify_rows(req_ids: list[str], slots: np.ndarray, num_scheduled: np.ndarray,
                is_verify: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray,
                                                np.ndarray]:
    """A step's rows with each verify row (a request's sampled token and its drafts) split
    into one row per token, in place: (req_ids, slots, num_scheduled, offsets of the rows;
    each request's first row). One-token rows are decode rows, which every attention path
    and the fused decode stack take; each attends to its request's keys up to itself."""
    if not is_verify.any():  # nothing to split (most steps): the rows as they are
        return (req_ids, slots, num_scheduled, np.zeros(len(slots), np.int32),
                np.arange(len(slots), dtype=np.int64))
    reps = np.where(is_verify, num_scheduled, 1)
    first_row = np.zeros(len(reps), np.int64)
    np.cumsum(reps[:-1], out=first_row[1:])
    offsets = run_offsets(reps).astype(np.int32)
    row_scheduled = np.where(np.repeat(is_verify, reps), 1, np.repeat(num_scheduled, reps))
    row_req_ids = np.repeat(np.array(req_ids, dtype=object), reps).tolist()
    return (row_req_ids, np.repeat(slots, reps), row_scheduled.astype(np.int32), offsets,
            first_row)


def prepare_inputs(req_ids: list[str], idx_mapping_np: np.ndarray, num_scheduled_np: np.ndarray,
                   state: RequestState, block_tables: BlockTables, buffers: InputBuffers,
                   num_tokens_padded: int | None = None,
                   num_reqs_padded: int | None = None, num_layers: int = 1,
                   offsets: np.ndarray | None = None,
                   num_decode_sequences: int | None = None) -> InputBatch:
    """Rows must already be in decode-first order. Returns views of `buffers`.

    input_ids, positions and slot_mapping span `num_tokens_padded` tokens; query_start_loc,
    seq_lens and block_tables span `num_reqs_padded` rows (the metadata's num_actual_tokens and
    num_reqs stay the real counts); idx_mapping, num_scheduled and logits_indices span the
    real rows. The metadata is KV cache group 0's, with the other groups' in `other_groups`;
    `num_layers`: the model's (AttentionMetadata.num_layers). `offsets` (int32):
    where each row starts after its slot's computed tokens (speculative decoding's verify
    rows, one per token: `verify_rows`); None: 0. `num_decode_sequences`: the metadata's
    (the requests of the decode rows, when verify rows split some; None: one per row).
    """
    num_reqs = len(req_ids)
    idx_mapping_np = np.ascontiguousarray(idx_mapping_np, dtype=np.int64)
    num_scheduled_np = np.ascontiguousarray(num_scheduled_np, dtype=np.int32)
    if not num_reqs == len(idx_mapping_np) == len(num_scheduled_np):
        raise ValueError(f"{num_reqs} req_ids, {len(idx_mapping_np)} slots and "
                         f"{len(num_scheduled_np)} token counts")
    num_reqs_padded = num_reqs if num_reqs_padded is None else num_reqs_padded
    if not num_reqs <= num_reqs_padded <= buffers.max_num_reqs:
        raise ValueError(f"{num_reqs} rows padded to {num_reqs_padded}: the step holds at "
                         f"most {buffers.max_num_reqs}")
    offsets = np.zeros(num_reqs, np.int32) if offsets is None else offsets
    # Host shapes in one pass (seq_lens from the host mirror of num_computed).
    query_start_loc_np, seq_lens_np, num_tokens, max_seq_len, num_decodes = (
        prepare_numba.host_sizes(num_scheduled_np, idx_mapping_np, offsets,
                                 state.num_computed_host, num_reqs_padded))
    num_tokens_padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if not num_tokens <= num_tokens_padded <= buffers.max_num_tokens:
        raise ValueError(f"{num_tokens} tokens padded to {num_tokens_padded}: the step holds "
                         f"at most {buffers.max_num_tokens}")
    if max_seq_len > state.max_model_len:
        raise ValueError(f"a row reaches {max_seq_len} tokens, more than "
                         f"max_model_len={state.max_model_len}")

    idx_mapping = buffers.idx_mapping[:num_reqs]
    if platform.kernel_impl(buffers.input_ids.device) == platform.CPU:
        # One call, the block-table gather included.
        prepare_numba.prepare_inputs(
            idx_mapping_np, num_scheduled_np, offsets, query_start_loc_np, num_tokens_padded,
            state.num_computed.numpy, state.prefill_len.numpy, state.last_sampled.numpy,
            state.token_ids.numpy, block_tables.table.numpy, block_tables.block_size,
            *buffers.numpy_outputs())
        tables = buffers.block_tables[:, :num_reqs_padded]
    else:
        _prepare_triton(idx_mapping_np, num_scheduled_np, offsets, query_start_loc_np,
                        num_tokens, num_tokens_padded, state, block_tables, buffers)
        tables = block_tables.gather_block_tables(idx_mapping, buffers.block_tables,
                                                  num_reqs_padded)

    slot_mappings = buffers.slot_mapping[:, :num_tokens_padded]
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        num_decode_sequences=num_decode_sequences,
        query_start_loc=buffers.query_start_loc[:num_reqs_padded + 1],
        seq_lens=buffers.seq_lens[:num_reqs_padded],
        block_tables=tables[0],
        slot_mapping=slot_mappings[0],
        query_start_loc_np=query_start_loc_np,
        seq_lens_np=seq_lens_np,
        max_seq_len=max_seq_len,
        num_layers=num_layers,
        slots=idx_mapping,
        slots_np=idx_mapping_np,
    )
    if len(tables) > 1:
        metadata.other_groups = tuple(
            dataclasses.replace(metadata, block_tables=tables[g], slot_mapping=slot_mappings[g])
            for g in range(1, len(tables)))
    return InputBatch(req_ids=req_ids, idx_mapping=idx_mapping, idx_mapping_np=idx_mapping_np,
                      num_scheduled=buffers.num_scheduled[:num_reqs],
                      num_scheduled_np=num_scheduled_np, num_tokens=num_tokens,
                      input_ids=buffers.input_ids[:num_tokens_padded],
                      positions=buffers.positions[:num_tokens_padded],
                      logits_indices=buffers.logits_indices[:num_reqs], attn_metadata=metadata)


def _prepare_triton(idx_mapping_np: np.ndarray, num_scheduled_np: np.ndarray,
                    offsets: np.ndarray, query_start_loc_np: np.ndarray, num_tokens: int,
                    num_tokens_padded: int, state: RequestState, block_tables: BlockTables,
                    buffers: InputBuffers) -> None:
    from mrv2.inputs import prepare_triton

    num_reqs, num_reqs_padded = len(idx_mapping_np), len(query_start_loc_np) - 1
    # One int64 upload: idx_mapping, num_scheduled, offsets, query_start_loc.
    size = 3 * num_reqs + num_reqs_padded + 1
    host = buffers.staging.host_buffer(8 * size)[:8 * size].view(np.int64)
    host[:num_reqs] = idx_mapping_np
    host[num_reqs:2 * num_reqs] = num_scheduled_np
    host[2 * num_reqs:3 * num_reqs] = offsets
    host[3 * num_reqs:] = query_start_loc_np
    packed = buffers.staging.upload(8 * size).view(torch.int64)
    prepare_triton.prepare_inputs(
        packed, num_reqs, num_reqs_padded, num_tokens, num_tokens_padded,
        state.num_computed.tensor, state.prefill_len.tensor, state.last_sampled.tensor,
        state.token_ids.tensor, block_tables.table.tensor, block_tables.block_size,
        *buffers.outputs()[:-1])
