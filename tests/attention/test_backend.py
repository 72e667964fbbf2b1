"""Attention layer interface: head checks, the cache layout, one prefill + one decode against a
dense causal reference, and backend dispatch (torch on CPU, Triton on CUDA; the Triton backend
interpreted on CPU matches the torch one, also with graph padding and dummy host arrays)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mrv2 import platform
from mrv2.attention import backend
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
        query_start_loc_np=qsl, seq_lens_np=seq, max_seq_len=int(seq.max()))


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


def test_backend_follows_the_device_unless_forced():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert backend.attention_backend(cpu) == platform.CPU
    assert backend.attention_backend(cuda) == platform.TRITON
    with platform.forced_impl(platform.TRITON):
        assert backend.attention_backend(cpu) == platform.TRITON
        # The torch twin runs on any device, so the override holds on CUDA tensors too.
        with platform.forced_impl(platform.CPU):
            assert backend.attention_backend(cuda) == platform.CPU
        assert backend.attention_backend(cpu) == platform.TRITON
    assert backend.attention_backend(cpu) == platform.CPU


def _two_steps(gen: torch.Generator):
    """Step 1: row A prefills 5 tokens (blocks 5, 2). Step 2: row A decodes its 6th token,
    row B prefills 3 tokens (block 6). Returns per step (q, k, v, slots, query_lens,
    seq_lens, block-table rows)."""

    def qkv(n):
        return (torch.randn(n, NUM_HEADS * HEAD_DIM, generator=gen),
                torch.randn(n, NUM_KV_HEADS * HEAD_DIM, generator=gen),
                torch.randn(n, NUM_KV_HEADS * HEAD_DIM, generator=gen))

    a, b = [5, 2], [6, 0]
    slots_a = [a[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(6)]
    slots_b = [b[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(3)]
    return [(*qkv(5), slots_a[:5], [5], [5], [a]),
            (*qkv(4), slots_a[5:] + slots_b, [1, 3], [6, 3], [a, b])]


def _meta(slots, query_lens, seq_lens, tables, pad_rows=0, pad_tokens=0, host=True):
    """Metadata; with padding, as `ModelRunner.capture_model` builds it for a graph: padded
    sizes, dummy host arrays, padding per invariant 6."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    qsl_dev = np.concatenate([qsl, np.full(pad_rows, num_tokens, np.int32)])
    seq = np.array(seq_lens + [0] * pad_rows, dtype=np.int32)
    rows = len(query_lens) + pad_rows
    return AttentionMetadata(
        num_actual_tokens=num_tokens + pad_tokens, num_reqs=rows,
        num_decodes=sum(1 for q in query_lens if q == 1) if host else 0,
        query_start_loc=torch.from_numpy(qsl_dev), seq_lens=torch.from_numpy(seq),
        block_tables=torch.tensor(tables + [[0, 0]] * pad_rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64),
        query_start_loc_np=qsl_dev if host else np.zeros(rows + 1, np.int32),
        seq_lens_np=seq if host else np.zeros(rows, np.int32),
        max_seq_len=int(seq.max()) if host else 64)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-padded"])
def test_triton_backend_matches_torch_backend(padded: bool):
    """The layer on the Triton backend (interpreted on CPU) against the torch one. Padded, the
    metadata is what a captured graph sees: padded sizes and dummy host arrays, so the result
    shows the Triton path reads only device tensors."""
    steps = _two_steps(torch.Generator().manual_seed(1))
    attn = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, 1 / math.sqrt(HEAD_DIM))
    torch_cache = torch.randn(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    triton_cache = torch_cache.clone()
    for q, k, v, slots, query_lens, seq_lens, tables in steps:
        n = len(slots)
        expected = attn(q, k, v, torch_cache, _meta(slots, query_lens, seq_lens, tables))
        pad_rows, pad_tokens = (2, 3) if padded else (0, 0)
        meta = _meta(slots, query_lens, seq_lens, tables, pad_rows, pad_tokens, host=not padded)

        def pad(x):
            return torch.cat([x, torch.full((pad_tokens, x.shape[1]), 1e4)])

        with platform.triton_interpreter():
            out = attn(pad(q), pad(k), pad(v), triton_cache, meta)
        assert out.shape == (n + pad_tokens, NUM_HEADS * HEAD_DIM)
        assert (out[:n] - expected).abs().max().item() <= 1e-5
        assert torch.equal(triton_cache, torch_cache)


def test_decode_steps_take_the_split_kv_path_once_scratch_is_attached(monkeypatch):
    """With split-KV scratch attached, the decode-only step runs `split_kv_decode` (mixed
    steps keep `paged_attention`) and still matches the torch backend."""
    from mrv2.attention import split_kv_triton

    model = torch.nn.ModuleList([Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, 0.3)
                                 for _ in range(2)])
    backend.attach_split_kv_scratch(model, max_num_seqs=4, max_model_len=32,
                                    device=torch.device("cpu"), num_splits=4)
    assert model[0].split_kv_scratch is model[1].split_kv_scratch
    assert model[0].split_kv_scratch.num_splits == 4
    calls = []
    real = split_kv_triton.split_kv_decode
    monkeypatch.setattr(split_kv_triton, "split_kv_decode",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                        generator=gen)
    q = torch.randn(2, NUM_HEADS * HEAD_DIM, generator=gen)
    k, v = (torch.randn(2, NUM_KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))
    # Two decode rows of 7 and 3 tokens, blocks (5, 2) and (6, 0), plus one padding row.
    meta = _meta([5 * BLOCK_SIZE + 2, 6 * BLOCK_SIZE + 2], [1, 1], [7, 3], [[5, 2], [6, 0]],
                 pad_rows=1)
    meta.num_decodes = meta.num_reqs
    expected = model[0](q, k, v, cache.clone(), _meta(
        [5 * BLOCK_SIZE + 2, 6 * BLOCK_SIZE + 2], [1, 1], [7, 3], [[5, 2], [6, 0]]))
    with platform.triton_interpreter():
        out = model[0](q, k, v, cache, meta)
    assert calls == [1]
    assert (out - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_a_layer_without_keys_reads_what_its_source_wrote(impl):
    """A KV-shared layer (Gemma 4) passes no k/v: it attends over the cache its source layer
    filled this step, writes nothing, and equals attending with the keys themselves."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    blocks = [3, 1]
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(5)]
    meta = metadata([5], [5], blocks, slots)
    source, reader = (Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, 0.5) for _ in range(2))
    cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    with platform.kernels_on_cpu(impl):
        source(q.flatten(1), k.flatten(1), v.flatten(1), cache, meta)
        before = cache.clone()
        out = reader(q.flatten(1), None, None, cache, meta)
    assert torch.equal(cache, before)
    torch.testing.assert_close(out.view(5, NUM_HEADS, HEAD_DIM), dense_causal(q, k, v, 0.5))
