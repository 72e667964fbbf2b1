"""Decode attention's block loops: decode_vector_ir's (a position's row widened once, the heads'
sums in registers) against the numba loops they replaced, same kernel otherwise, same run.

The baseline is decode_numba.decode_kernel compiled again with a vector width no head size is a
multiple of, so every block takes `_block_scores` / `_block_values`. Shapes: a batch-32 decode
step at 192 tokens of context, a bfloat16 cache, one work item per (row, kv head) (the split
work_split gives where the step's K/V is larger than the cache it reports), over every layer's
cache (more than the last-level cache, as in a step): SmolLM2-135M's heads (9 query, 3 kv, 30
layers, 141 MB a step) and W2's (16 query, 8 kv, 16 layers, 201 MB); and one row of SmolLM2
at 256 tokens split over the threads (the batch-1 case). bench/README.md has the figures.
"""

from __future__ import annotations

import types
from functools import lru_cache

import numba
import numpy as np
import pytest
import torch

from mrv2.attention import decode_numba, decode_vector_ir
from mrv2.attention.kv_numba import numpy_view

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py

SHAPES = {  # rows, seq_len, query heads, kv heads, layers
    "smollm2-b32": (32, 192, 9, 3, 30),
    "w2-b32": (32, 192, 16, 8, 16),
    "smollm2-b1": (1, 256, 9, 3, 30),
}


@lru_cache(maxsize=1)
def _numba_loops_kernel():
    """decode_kernel's source compiled with no head size taking the vector loops (once: a
    compile takes ~15 s)."""
    source = decode_numba.decode_kernel.py_func
    scope = dict(source.__globals__, VECTOR_WIDTH=1 << 30)
    function = types.FunctionType(source.__code__, scope, source.__name__)
    return numba.njit(parallel=True, fastmath=True, error_model="numpy")(function)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["vector_ir", "numba_loops"])
def test_decode_attention_block_loops(benchmark, impl: str, shape: str) -> None:
    if benchmark.disabled and impl == "numba_loops":
        # An uncached compile of the baseline (~35 s in CI) for a figure nobody reads there;
        # tests/attention/ checks the kernel against its reference.
        pytest.skip("the baseline kernel is compiled only where it is timed")
    rows, seq_len, heads, kv_heads, layers = SHAPES[shape]
    block_size, head_dim = 16, 64
    if benchmark.disabled:  # the suite's check: one layer's cache, the kernel runs
        layers = 1
    benchmark.group = f"decode-attention-loops-{shape}"
    benchmark.extra_info.update(rows=rows, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                                head_dim=head_dim, layers=layers, cache_dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    blocks = rows * seq_len // block_size
    caches = [numpy_view(torch.randn(2, blocks + 1, block_size, kv_heads, head_dim,
                                     generator=g).to(torch.bfloat16)) for _ in range(layers)]
    tables = (torch.randperm(blocks, generator=g) + 1).view(rows, -1).int().numpy()
    q = torch.randn(rows, heads, head_dim, generator=g).numpy()
    lens = np.full(rows, seq_len, np.int32)
    kv_bytes = decode_numba.step_kv_bytes(lens, kv_heads, head_dim, 2, layers)
    split = (*((1, 1) if rows > 1 else decode_numba.work_split(1, kv_heads, 2, kv_bytes)),
             *decode_numba.PLAIN_ATTENTION)
    kernel = (decode_numba.decode_kernel if impl == "vector_ir" else _numba_loops_kernel())
    outs = [np.empty_like(q) for _ in range(2)]
    decode_numba.decode_kernel(q, *caches[0], tables, lens, np.float32(0.125), outs[0], *split)
    kernel(q, *caches[0], tables, lens, np.float32(0.125), outs[1], *split)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)

    def step() -> None:
        for k_cache, v_cache in caches:
            kernel(q, k_cache, v_cache, tables, lens, np.float32(0.125), outs[1], *split)

    benchmark.pedantic(step, rounds=1 if benchmark.disabled else 15,
                       warmup_rounds=0 if benchmark.disabled else 2)


# The block loops alone for one row's kv heads at 192 positions, by the query heads of a kv
# head (GQA group): the register blocks chosen per head count (the defaults) against one
# choice for every count (AVX2's former one position a scores pass and two vectors a value
# block; AVX-512's former choice is the defaults' there).
def _fixed_positions(heads: int) -> int:
    return 4 if decode_vector_ir.vector_width() == 16 else 1


def _fixed_vectors(heads: int) -> int:
    return 4 if decode_vector_ir.vector_width() == 16 else 2


@lru_cache(maxsize=2)
def _block_loops_run(register_blocks: str):
    scores_fn, values_fn = (decode_vector_ir.make_block_loops() if register_blocks == "per_heads"
                            else decode_vector_ir.make_block_loops(_fixed_positions,
                                                                   _fixed_vectors))

    @numba.njit
    def run(qs, k_blocks, v_blocks, scores, acc):
        blocks, block_size, kv_heads = k_blocks.shape[0], k_blocks.shape[1], k_blocks.shape[2]
        for kv in range(kv_heads):
            for b in range(blocks):
                scores_fn(qs, k_blocks[b], kv, block_size, scores, b * block_size)
            for b in range(blocks):
                values_fn(scores, b * block_size, v_blocks[b], kv, block_size, acc)
    return run


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("register_blocks", ["per_heads", "fixed"])
def test_decode_attention_register_blocks(benchmark, register_blocks: str, group: int) -> None:
    blocks, block_size, kv_heads, head_dim = 12, 16, 4, 64
    benchmark.group = f"decode-attention-register-blocks-group{group}"
    benchmark.extra_info.update(positions=blocks * block_size, kv_heads=kv_heads, group=group,
                                head_dim=head_dim, cache_dtype="float32")
    g = torch.Generator().manual_seed(group)
    k_blocks, v_blocks = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
                          .numpy() for _ in range(2))
    qs = torch.randn(group, head_dim, generator=g).numpy()
    results = []
    for choice in ("per_heads", "fixed"):
        scores = np.zeros((group, blocks * block_size), np.float32)
        acc = np.zeros((group, head_dim), np.float32)
        _block_loops_run(choice)(qs, k_blocks, v_blocks, scores, acc)
        results.append((scores, acc))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    run = _block_loops_run(register_blocks)
    scores = np.zeros((group, blocks * block_size), np.float32)
    acc = np.zeros((group, head_dim), np.float32)
    benchmark.pedantic(lambda: [run(qs, k_blocks, v_blocks, scores, acc) for _ in range(100)],
                       rounds=1 if benchmark.disabled else 15,
                       warmup_rounds=0 if benchmark.disabled else 2)
