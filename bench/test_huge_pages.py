"""Memory on huge pages (utils/huge_pages.py) against the same memory on ordinary pages, same
kernel, same run: decode attention over a KV cache (as the worker allocates it on the CPU),
and a decode step's stream of weights (as the worker and the oneDNN packing collapse them).

Shape: SmolLM2-135M's heads (9 query, 3 kv, head size 64), a bfloat16 cache of 2,048 blocks of
16 tokens per layer over 30 layers (as a 4 GiB-class cache holds many more blocks than a batch
uses), 32 rows of 192 tokens whose blocks are drawn at random from the whole cache: a step
reads its blocks scattered, as a long-running engine's block tables are. bench/README.md has
the figures.

Weights: W2's projections (bench/e2e_workload.py: hidden 1024, 16 layers, 16 / 8 heads of 64,
MLP 2816), bfloat16 on the AMX tiles at 32 rows (tile_linear, where the CPU has AMX), and
W1's (hidden 512, 8 layers, 8 / 4 heads, MLP 1408) as Q8_0 blocks at one row (the GEMV of
quantized_linear: the group panels, held alone, where the weight's plan runs them), each weight
allocated by torch and then collapsed, or not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.attention import decode_numba
from mrv2.attention.kv_numba import numpy_view
from mrv2.models.layers import tile_linear
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.layers.vector_ir import half_bits
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
    decode_numba.decode_kernel(q, *caches[0], tables, lens, np.float32(0.125), out, 1, 1,
                               *decode_numba.PLAIN_ATTENTION)
    assert np.isfinite(out).all()

    def step() -> None:
        for k_cache, v_cache in caches:
            decode_numba.decode_kernel(q, k_cache, v_cache, tables, lens, np.float32(0.125),
                                       out, 1, 1, *decode_numba.PLAIN_ATTENTION)

    benchmark.pedantic(step, rounds=1 if benchmark.disabled else 15,
                       warmup_rounds=0 if benchmark.disabled else 2)


def _projection_shapes(hidden: int, heads: int, kv_heads: int, mlp: int) -> list[tuple]:
    """[N, K] of a Llama layer's qkv, o, gate_up and down projections (head size 64)."""
    return [((heads + 2 * kv_heads) * 64, hidden), (hidden, heads * 64), (2 * mlp, hidden),
            (hidden, mlp)]


def _stream(pages: str, tensors: list[torch.Tensor]) -> None:
    if pages == "huge":
        assert huge_pages.collapse(tensors) > 0


@pytest.mark.parametrize("pages", ["huge", "ordinary"])
def test_bfloat16_tile_linears_at_32_rows(benchmark, pages: str) -> None:
    if not tile_linear.usable():
        pytest.skip("needs AMX tiles")
    layers = 1 if benchmark.disabled else 16
    benchmark.group = "weight-stream-pages-w2-bf16-tiles"
    benchmark.extra_info.update(rows=32, layers=layers, pages=pages)
    g = torch.Generator().manual_seed(0)
    shapes = _projection_shapes(1024, 16, 8, 2816)
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(*s, generator=g).bfloat16())
              for _ in range(layers) for s in shapes]
    _stream(pages, packed)  # tile_linear reads oneDNN's packed memory in place
    tiles = [tile_linear.weight_tiles(p) for p in packed]
    xs = {k: half_bits(torch.randn(32, k, generator=g).bfloat16()) for _, k in shapes}
    outs = {n: np.empty((32, n), np.uint16) for n, _ in shapes}

    def step() -> None:
        for (n, k), w in zip(shapes * layers, tiles):
            tile_linear.tile_linear_kernel(xs[k], w, outs[n], 2)

    benchmark.pedantic(step, rounds=1 if benchmark.disabled else 15,
                       warmup_rounds=0 if benchmark.disabled else 2)


@pytest.mark.parametrize("pages", ["huge", "ordinary"])
def test_q8_0_gemv_at_one_row(benchmark, pages: str) -> None:
    layers = 1 if benchmark.disabled else 8
    benchmark.group = "weight-stream-pages-w1-q8_0"
    benchmark.extra_info.update(rows=1, layers=layers, pages=pages)
    g = torch.Generator().manual_seed(0)
    shapes = _projection_shapes(512, 8, 4, 1408)
    weights = [PackedWeight("i8", 32, torch.randint(-127, 128, s, generator=g).to(torch.int8),
                               torch.rand(s[0], s[1] // 32, generator=g).half().view(torch.int16),
                               None, "Q8_0") for _ in range(layers) for s in shapes]
    for w in weights:  # as a model's linears are held: as their panels where the plan runs them
        if w.plan.on_panels:
            w.store_as_panels()
    _stream(pages, [t for w in weights for t in w.storage_tensors()])  # as the worker does
    xs = {k: torch.randn(1, k, generator=g) for _, k in shapes}

    def step() -> None:
        for (_, k), w in zip(shapes * layers, weights):
            quantized_linear(xs[k], w)

    benchmark.pedantic(step, rounds=1 if benchmark.disabled else 50,
                       warmup_rounds=0 if benchmark.disabled else 5)
