"""Padding for graph replay (DESIGN.md invariant 6), end to end through the attention layer.

A real batch is padded to the descriptor the dispatcher picks: padded query_start_loc entries =
num_tokens, padded seq_lens = 0, padded block-table rows = 0, padded slot_mapping = -1, and
garbage in the padded q/k/v rows. Attention on the padded step must write exactly what the real
step writes to the KV cache and give the real tokens the same outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import Attention, AttentionMetadata
from mrv2.config import CompilationConfig
from mrv2.cudagraph import BatchDescriptor, CudaGraphDispatcher

BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 24, 4, 2, 8
MAX_BLOCKS_PER_REQ = 6


def _real_step(seq_lens: list[int], query_lens: list[int], gen: torch.Generator):
    """Metadata pieces of a real step; block 0 is never given to a request here, so that the
    test can see that padded rows (which point at block 0) leave it alone."""
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), MAX_BLOCKS_PER_REQ, dtype=torch.int32)
    slots = []
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        n = -(-seq_len // BLOCK_SIZE)
        tables[row, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(seq_len)
        row_slots = tables[row].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        slots.append(row_slots[seq_len - q_len:])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return qsl, np.array(seq_lens, dtype=np.int32), tables, torch.cat(slots)


def _metadata(qsl: np.ndarray, seq_lens: np.ndarray, tables: torch.Tensor,
              slot_mapping: torch.Tensor, num_tokens: int, num_decodes: int) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=len(seq_lens), num_decodes=num_decodes,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_tables=tables, slot_mapping=slot_mapping, query_start_loc_np=qsl,
        seq_lens_np=seq_lens, max_seq_len=int(seq_lens.max()))


def _pad(qsl, seq_lens, tables, slot_mapping, num_tokens_padded: int, num_reqs_padded: int):
    """Invariant 6, as prepare_inputs applies it to the fixed-address step buffers."""
    num_reqs, num_tokens = len(seq_lens), int(qsl[-1])
    qsl_p = np.full(num_reqs_padded + 1, num_tokens, dtype=np.int32)
    qsl_p[:num_reqs + 1] = qsl
    seq_lens_p = np.zeros(num_reqs_padded, dtype=np.int32)
    seq_lens_p[:num_reqs] = seq_lens
    tables_p = torch.zeros(num_reqs_padded, tables.shape[1], dtype=torch.int32)
    tables_p[:num_reqs] = tables
    slots_p = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
    slots_p[:num_tokens] = slot_mapping
    return qsl_p, seq_lens_p, tables_p, slots_p


@pytest.mark.parametrize("mode, seq_lens, query_lens", [
    # Uniform decode: 3 rows padded to the 4-row decode graph.
    ("FULL_DECODE_ONLY", [5, 9, 13], [1, 1, 1]),
    ("FULL_DECODE_ONLY", [1, 4, 7, 8, 17], [1, 1, 1, 1, 1]),
    # Mixed: decodes then prefill chunks (one with a cached prefix) padded to a FULL graph.
    ("FULL", [6, 11, 7, 3], [1, 1, 4, 3]),
    ("FULL", [9, 2], [1, 2]),
])
def test_padded_tokens_never_write_kv_and_real_outputs_match(mode: str, seq_lens: list[int],
                                                            query_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) * 31 + len(query_lens))
    num_reqs, num_tokens = len(seq_lens), sum(query_lens)
    uniform = num_tokens == num_reqs
    dispatcher = CudaGraphDispatcher(CompilationConfig(mode), max_num_tokens=64, max_num_reqs=8)
    num_tokens_p, num_reqs_p, desc = dispatcher.padded_sizes(num_tokens, num_reqs, uniform)
    assert desc == BatchDescriptor(num_tokens_p, num_reqs_p, uniform)
    assert num_tokens_p > num_tokens and num_reqs_p > num_reqs  # the cases really pad

    qsl, sl, tables, slots = _real_step(seq_lens, query_lens, gen)
    attn = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, scale=HEAD_DIM ** -0.5)
    # Padded tokens carry large garbage, as stale step buffers would; the cache holds random
    # (finite) values everywhere, standing in for earlier steps' K/V.
    q = torch.randn(num_tokens_p, NUM_HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens_p, NUM_KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens_p, NUM_KV_HEADS * HEAD_DIM, generator=gen)
    q[num_tokens:] *= 1e3
    k[num_tokens:] *= 1e3
    v[num_tokens:] += 1e3
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    original = cache.clone()

    real_cache = cache.clone()
    real_meta = _metadata(qsl, sl, tables, slots, num_tokens,
                          num_decodes=sum(n == 1 for n in query_lens))
    real_out = attn(q[:num_tokens], k[:num_tokens], v[:num_tokens], real_cache, real_meta)

    # The padded step sees only what a graph freezes: the descriptor's sizes. A decode graph
    # treats every row as a decode row; a mixed one keeps the real decode count.
    qsl_p, sl_p, tables_p, slots_p = _pad(qsl, sl, tables, slots, num_tokens_p, num_reqs_p)
    assert (qsl_p[num_reqs + 1:] == num_tokens).all() and (sl_p[num_reqs:] == 0).all()
    padded_meta = _metadata(qsl_p, sl_p, tables_p, slots_p, num_tokens_p,
                            num_decodes=num_reqs_p if uniform else real_meta.num_decodes)
    padded_cache = cache.clone()
    padded_out = attn(q, k, v, padded_cache, padded_meta)

    assert padded_out.shape == (num_tokens_p, NUM_HEADS * HEAD_DIM)
    torch.testing.assert_close(padded_out[:num_tokens], real_out, rtol=0, atol=0)
    # The padded step wrote exactly what the real one wrote: nothing from padded tokens.
    assert torch.equal(padded_cache, real_cache)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots] = True
    flat = lambda c: c.view(2, NUM_BLOCKS * BLOCK_SIZE, -1)  # noqa: E731
    assert torch.equal(flat(padded_cache)[:, ~written], flat(original)[:, ~written])
    assert not torch.equal(flat(padded_cache)[:, written], flat(original)[:, written])
    # Block 0, where padded rows point, is untouched (it holds no real slot in these steps).
    assert not written.view(NUM_BLOCKS, BLOCK_SIZE)[0].any()
    assert torch.equal(padded_cache[:, 0], original[:, 0])


def test_padding_without_minus_one_would_corrupt_the_cache() -> None:
    """Control: the same padded step with slot 0 instead of -1 overwrites block 0."""
    gen = torch.Generator().manual_seed(7)
    qsl, sl, tables, slots = _real_step([5, 9, 13], [1, 1, 1], gen)
    qsl_p, sl_p, tables_p, slots_p = _pad(qsl, sl, tables, slots, 4, 4)
    slots_p[3] = 0
    attn = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, scale=HEAD_DIM ** -0.5)
    q = torch.randn(4, NUM_HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(4, NUM_KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(4, NUM_KV_HEADS * HEAD_DIM, generator=gen)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    before = cache[:, 0].clone()
    attn(q, k, v, cache, _metadata(qsl_p, sl_p, tables_p, slots_p, 4, num_decodes=4))
    assert not torch.equal(cache[:, 0], before)
