"""prompt_numba's kernel against a float64 causal reference: GQA groups of one to several
heads, head sizes of one vector to several (and a last tile of fewer vectors), prompts shorter
than a tile and longer than several blocks, prompts at any rows of the step (other rows left
alone), and each prompt's result bit for bit the same alone as beside others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import prompt_numba
from mrv2.attention.decode_vector_ir import vector_width


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one prompt, q [L, H, D] over k/v [L, KV, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    length = q.shape[0]
    hidden = torch.arange(length)[None, :] > torch.arange(length)[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def _step(lengths: list[int], gaps: list[int], heads: int, kv_heads: int, head_dim: int,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """q, k, v of a step whose prompt i starts after gaps[i] rows of other tokens, and the
    prompts' first rows."""
    gen = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for length, gap in zip(lengths, gaps):
        starts.append(row + gap)
        row += gap + length
    tokens = row + 2
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    return q, k, v, np.array(starts, np.int64)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("vectors", [1, 5])
def test_whole_prompts_match_the_reference(heads, kv_heads, vectors, monkeypatch):
    monkeypatch.setattr(prompt_numba, "BLOCK_ROWS", 16)  # several blocks per prompt
    head_dim = vectors * vector_width()
    lengths = [1, 3, 16, 37, 70]
    q, k, v, starts = _step(lengths, [0, 2, 0, 5, 1], heads, kv_heads, head_dim, seed=heads)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    prompt_numba.prompt_attention(q, k, v, starts, np.array(lengths), scale, out)
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, length in zip(starts.tolist(), lengths):
        rows = slice(start, start + length)
        torch.testing.assert_close(out[rows], _reference(q[rows], k[rows], v[rows], scale),
                                   atol=2e-6, rtol=1e-5)
        written[rows] = True
    assert out[~written].isnan().all()


def test_a_prompt_alone_equals_itself_beside_others():
    lengths = [70, 5, 130]
    q, k, v, starts = _step(lengths, [3, 0, 4], 8, 2, 2 * vector_width(), seed=1)
    together = torch.zeros_like(q)
    prompt_numba.prompt_attention(q, k, v, starts, np.array(lengths), 0.125, together)
    for i, (start, length) in enumerate(zip(starts.tolist(), lengths)):
        alone = torch.zeros_like(q)
        prompt_numba.prompt_attention(q, k, v, starts[i:i + 1], np.array([length]), 0.125,
                                      alone)
        rows = slice(start, start + length)
        assert torch.equal(alone[rows], together[rows])


def test_large_scores_stay_finite():
    """Scores far beyond exp's range: the softmax subtracts each row's maximum first."""
    q, k, v, starts = _step([40], [0], 2, 1, vector_width(), seed=2)
    q, k = q * 30, k * 30
    out = torch.zeros_like(q)
    prompt_numba.prompt_attention(q, k, v, starts, np.array([40]), 1.0, out)
    assert out[:40].isfinite().all()
    torch.testing.assert_close(out[:40], _reference(q[:40], k[:40], v[:40], 1.0), atol=1e-5,
                               rtol=1e-4)


def test_work_items_pair_short_blocks_with_long_ones():
    prompt, block = prompt_numba.work_items(np.array([130, 20]), 64)
    assert sorted(zip(prompt.tolist(), block.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert (prompt.tolist(), block.tolist()) == ([0, 1, 0, 0], [0, 0, 1, 2])


def test_a_strided_out_is_refused():
    q, k, v, starts = _step([4], [0], 2, 1, vector_width(), seed=3)
    out = torch.zeros(q.shape[1], q.shape[0], q.shape[2]).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        prompt_numba.prompt_attention(q, k, v, starts, np.array([4]), 0.5, out)
