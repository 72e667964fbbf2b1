"""Causal attention over whole prompts at SmolLM2-135M's shapes (9 query heads, 3 kv heads,
head size 64, float32): prompt_numba's kernel against torch's float32 SDPA (its flash kernel,
the path it replaced), same run, 2 threads. Two steps: 32 prompts of 128 tokens, and one of
512 (issue 51's first-token workloads); one timed call is one layer's attention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mrv2.attention import prompt_numba

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: int, length: int,
          out: torch.Tensor) -> None:
    qb, kb, vb = (t.unflatten(0, (prompts, length)).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=HEAD_DIM ** -0.5,
                                       enable_gqa=True)
    out.copy_(o.transpose(1, 2).flatten(0, 1))


@pytest.mark.parametrize("kernel", ["prompt_numba", "torch_sdpa"])
@pytest.mark.parametrize("prompts,length", [(32, 128), (1, 512)])
def test_prompt_attention_of_one_layer(benchmark, kernel, prompts, length):
    g = torch.Generator().manual_seed(length)
    tokens = prompts * length
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    # The cache holds each prompt in blocks of 16 at consecutive ids (the step wrote them).
    cache = torch.stack([k, v]).view(2, tokens // 16, 16, KV_HEADS, HEAD_DIM)
    tables = torch.arange(tokens // 16, dtype=torch.int32).view(prompts, length // 16)
    starts = np.arange(prompts, dtype=np.int64) * length
    lengths = np.full(prompts, length, np.int64)
    out = torch.empty_like(q)

    def numba_step() -> None:
        prompt_numba.prompt_attention(q, cache, tables, starts, lengths,
                                      np.zeros(prompts, np.int64), HEAD_DIM ** -0.5, out)

    def sdpa_step() -> None:
        _sdpa(q, k, v, prompts, length, out)

    step = numba_step if kernel == "prompt_numba" else sdpa_step
    step()
    check = torch.empty_like(q)
    _sdpa(q, k, v, prompts, length, check)
    torch.testing.assert_close(out, check, atol=2e-6, rtol=1e-5)
    benchmark.group = f"prompt-attention-{prompts}x{length}"
    benchmark(step)
    if not benchmark.disabled:
        benchmark.extra_info.update(prompts=prompts, length=length, threads=2)
