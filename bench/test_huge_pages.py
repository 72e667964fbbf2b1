"""Decode attention over a KV cache on huge pages (utils/huge_pages.py, as the worker allocates
it on the CPU) against the same cache on ordinary pages (torch.zeros), same kernel, same run.

Shape: SmolLM2-135M's heads (9 query, 3 kv, head size 64), a bfloat16 cache of 2,048 blocks of
16 tokens per layer over 30 layers (as a 4 GiB-class cache holds many more blocks than a batch
uses), 32 rows of 192 tokens whose blocks are drawn at random from the whole cache: a step
reads its blocks scattered, as a long-running engine's block tables are. bench/README.md has
the figures.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import decode_numba
from mrv2.attention.kv_numba import numpy_view
from mrv2.utils import huge_pages

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py


@pytest.mark.parametrize("pages", ["huge", "ordinary"])
def test_decode_attention_over_the_cache(benchmark, pages: str) -> None:
    rows, seq_len, block_size, heads, kv_heads, head_dim = 32, 192, 16, 9, 3, 64
    layers, blocks = (1, rows * seq_len // block_size) if benchmark.disabled else (30, 2048)
    benchmark.group = "decode-attention-kv-pages"
    benchmark.extra_info.update(rows=rows, seq_len=seq_len, layers=layers, blocks=blocks,
                                cache_dtype="bfloat16", pages=pages)
    g = torch.Generator().manual_seed(0)
    shape = (2, blocks, block_size, kv_heads, head_dim)
    allocate = (huge_pages.zeros if pages == "huge"
                else lambda s, d: torch.zeros(s, dtype=d))
    caches = []
    for _ in range(layers):
        cache = allocate(shape, torch.bfloat16)
        cache.copy_(torch.randn(shape, generator=g))
        caches.append(numpy_view(cache))
    per_row = seq_len // block_size
    tables = torch.randperm(blocks, generator=g)[:rows * per_row].view(rows, -1).int().numpy()
    q = torch.randn(rows, heads, head_dim, generator=g).numpy()
    lens = np.full(rows, seq_len, np.int32)
    out = np.empty_like(q)
    decode_numba.decode_kernel(q, *caches[0], tables, lens, np.float32(0.125), out, 1, 1)
    assert np.isfinite(out).all()

    def step() -> None:
        for k_cache, v_cache in caches:
            decode_numba.decode_kernel(q, k_cache, v_cache, tables, lens, np.float32(0.125),
                                       out, 1, 1)

    benchmark.pedantic(step, rounds=1 if benchmark.disabled else 15,
                       warmup_rounds=0 if benchmark.disabled else 2)
