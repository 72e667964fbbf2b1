"""prompt_numba's kernel against a float64 causal reference: GQA groups of one to several
heads, head sizes of one vector to several (and a last tile of fewer vectors), whole prompts
shorter than a tile and longer than several blocks, chunks after a cached prefix, float32 and
16-bit caches, chunks at any rows of the step (other rows left alone), and each chunk's result
bit for bit the same alone as beside others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import prompt_numba
from mrv2.attention.decode_vector_ir import vector_width

BLOCK_SIZE = 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of a sequence, q [n, H, D] over k/v
    [L, KV, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
    hidden = torch.arange(k.shape[0])[None, :] > positions[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def _step(lengths: list[int], prefixes: list[int], gaps: list[int], heads: int,
          kv_heads: int, head_dim: int, seed: int, cache_dtype: torch.dtype = torch.float32):
    """A step whose chunk i (lengths[i] queries after prefixes[i] cached positions) starts
    after gaps[i] rows of other tokens: (q, the cache holding every chunk's sequence in blocks
    of random ids, the chunks' block tables, first rows, and their sequences' k, v)."""
    gen = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for length, gap in zip(lengths, gaps):
        starts.append(row + gap)
        row += gap + length
    q = torch.randn(row + 2, heads, head_dim, generator=gen)
    seqs = [p + n for p, n in zip(prefixes, lengths)]
    blocks = [-(-s // BLOCK_SIZE) for s in seqs]
    ids = torch.randperm(sum(blocks) + 3, generator=gen)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    cache = torch.full((2, ids.numel(), BLOCK_SIZE, kv_heads, head_dim), float("nan"),
                       dtype=cache_dtype)
    ks, vs, used = [], [], 0
    for i, s in enumerate(seqs):
        tables[i, :blocks[i]] = ids[used:used + blocks[i]].int()
        used += blocks[i]
        k = torch.randn(s, kv_heads, head_dim, generator=gen).to(cache_dtype)
        v = torch.randn(s, kv_heads, head_dim, generator=gen).to(cache_dtype)
        for j in range(s):
            cache[0, tables[i, j // BLOCK_SIZE], j % BLOCK_SIZE] = k[j]
            cache[1, tables[i, j // BLOCK_SIZE], j % BLOCK_SIZE] = v[j]
        ks.append(k.float())
        vs.append(v.float())
    return q, cache, tables, np.array(starts, np.int64), ks, vs


def _run(q, cache, tables, starts, lengths, prefixes, scale, out=None):
    out = torch.full_like(q, float("nan")) if out is None else out
    prompt_numba.prompt_attention(q, cache, tables, starts, np.array(lengths),
                                  np.array(prefixes), scale, out)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("vectors", [1, 5])
def test_chunks_match_the_reference(heads, kv_heads, vectors, monkeypatch):
    monkeypatch.setattr(prompt_numba, "BLOCK_ROWS", 16)  # several blocks per chunk
    head_dim = vectors * vector_width()
    lengths, prefixes = [1, 3, 16, 37, 70, 5, 21], [0, 0, 0, 0, 0, 30, 17]
    q, cache, tables, starts, ks, vs = _step(lengths, prefixes, [0, 2, 0, 5, 1, 0, 3], heads,
                                             kv_heads, head_dim, seed=heads)
    scale = head_dim ** -0.5
    out = _run(q, cache, tables, starts, lengths, prefixes, scale)
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, length, k, v in zip(starts.tolist(), lengths, ks, vs):
        rows = slice(start, start + length)
        torch.testing.assert_close(out[rows], _reference(q[rows], k, v, scale), atol=2e-6,
                                   rtol=1e-5)
        written[rows] = True
    assert out[~written].isnan().all()


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_is_read_as_its_float32_values(cache_dtype):
    lengths, prefixes = [40, 9], [0, 50]
    q, cache, tables, starts, ks, vs = _step(lengths, prefixes, [1, 0], 8, 2,
                                             2 * vector_width(), seed=7, cache_dtype=cache_dtype)
    out = _run(q, cache, tables, starts, lengths, prefixes, 0.125)
    for start, length, k, v in zip(starts.tolist(), lengths, ks, vs):
        rows = slice(start, start + length)
        torch.testing.assert_close(out[rows], _reference(q[rows], k, v, 0.125), atol=2e-6,
                                   rtol=1e-5)


def test_a_chunk_alone_equals_itself_beside_others():
    lengths, prefixes = [70, 5, 130, 12], [0, 0, 0, 40]
    q, cache, tables, starts, _, _ = _step(lengths, prefixes, [3, 0, 4, 1], 8, 2,
                                           2 * vector_width(), seed=1)
    together = _run(q, cache, tables, starts, lengths, prefixes, 0.125)
    for i, (start, length) in enumerate(zip(starts.tolist(), lengths)):
        alone = _run(q, cache, tables[i:i + 1], starts[i:i + 1], lengths[i:i + 1],
                     prefixes[i:i + 1], 0.125)
        rows = slice(start, start + length)
        assert torch.equal(alone[rows], together[rows])


def test_large_scores_stay_finite():
    """Scores far beyond exp's range: the softmax subtracts each row's maximum first."""
    q, cache, tables, starts, ks, vs = _step([40], [0], [0], 2, 1, vector_width(), seed=2)
    q, cache = q * 30, cache * 30
    out = _run(q, cache, tables, starts, [40], [0], 1.0)
    assert out[:40].isfinite().all()
    torch.testing.assert_close(out[:40], _reference(q[:40], ks[0] * 30, vs[0] * 30, 1.0),
                               atol=1e-5, rtol=1e-4)


def test_work_items_pair_short_blocks_with_long_ones():
    chunk, block = prompt_numba.work_items(np.array([130, 20]), 64)
    assert sorted(zip(chunk.tolist(), block.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert (chunk.tolist(), block.tolist()) == ([0, 1, 0, 0], [0, 0, 1, 2])


def test_a_strided_out_is_refused():
    q, cache, tables, starts, _, _ = _step([4], [0], [0], 2, 1, vector_width(), seed=3)
    out = torch.zeros(q.shape[1], q.shape[0], q.shape[2]).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        _run(q, cache, tables, starts, [4], [0], 0.5, out)
