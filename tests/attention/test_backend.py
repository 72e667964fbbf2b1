"""Attention layer interface: head checks, the cache layout, and one prefill + one decode
against a dense causal reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mrv2.attention.backend import Attention, AttentionMetadata, kv_cache_shape

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 8


def test_num_heads_must_be_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads=6.*num_kv_heads=4"):
        Attention(num_heads=6, head_dim=8, num_kv_heads=4, scale=1.0)
    Attention(num_heads=8, head_dim=8, num_kv_heads=4, scale=1.0)
    Attention(num_heads=4, head_dim=8, num_kv_heads=4, scale=1.0)


def test_kv_cache_shape():
    assert kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


def metadata(query_lens: list[int], seq_lens: list[int], block_table: list[int],
             slot_mapping: list[int]) -> AttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = np.array(seq_lens, dtype=np.int32)
    tables = torch.tensor([block_table] * len(query_lens), dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(query_lens),
        num_decodes=sum(1 for q in query_lens if q == 1),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
        block_tables=tables, slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, max_seq_len=int(seq.max()))


def dense_causal(q, k, v, scale):
    """q [T, H, D], k/v [L, KV, D]; query t sits at position L - T + t."""
    t, length = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    q_pos = torch.arange(length - t, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def test_prefill_then_decode_matches_dense_reference():
    gen = torch.Generator().manual_seed(0)
    total = 6  # 5 prompt tokens, then one decode token
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    attn = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, scale)
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    blocks = [5, 2]  # non-adjacent, out of order
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)]

    def flat(x):
        return x.reshape(x.shape[0], -1)

    out = attn(flat(q[:5]), flat(k[:5]), flat(v[:5]), cache,
               metadata([5], [5], blocks, slots[:5]))
    assert out.shape == (5, NUM_HEADS * HEAD_DIM)
    torch.testing.assert_close(out.view(5, NUM_HEADS, HEAD_DIM),
                               dense_causal(q[:5], k[:5], v[:5], scale))
    # K and V land at their flat slots, and nowhere else.
    k_flat = cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    v_flat = cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(k_flat[slots[:5]], k[:5])
    torch.testing.assert_close(v_flat[slots[:5]], v[:5])
    written = torch.zeros(k_flat.shape[0], dtype=torch.bool)
    written[slots[:5]] = True
    assert not k_flat[~written].any() and not v_flat[~written].any()

    # One decode token at position 5 attends to the cached prefix plus itself.
    out = attn(flat(q[5:]), flat(k[5:]), flat(v[5:]), cache,
               metadata([1], [6], blocks, slots[5:]))
    torch.testing.assert_close(out.view(1, NUM_HEADS, HEAD_DIM),
                               dense_causal(q[5:], k, v, scale))
