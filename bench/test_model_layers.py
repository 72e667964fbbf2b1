"""The CPU kernels behind the decode-step gains, each next to what it replaced (same run):

- `gemv`: one decode step's worth of W1 projections (8 layers + LM head, 127 MB of fp32
  weights, more than the L3, so weights stream from DRAM as in a real step) at 1 and 4 rows,
  the numba GEMV (`cpu_gemv.gemv`) vs `F.linear`;
- `linear`: the same step at 32 rows (W1's decode batch) and a 512-row prefill chunk,
  `cpu_linear.linear` (oneDNN, weights packed once) vs `F.linear` (MKL);
- `linear-random-rows`: prefill-sized inputs of a new row count every call (17-600 rows,
  SmolLM2's four projection shapes), `cpu_linear.linear` padding rows to `padded_rows` (so
  oneDNN's per-shape primitives are reused and their memory stays bounded) vs unpadded;
- `decode-attention`: 32 decode rows of 256 tokens (W1's attention shape), the numba kernel
  reading the paged cache in place vs the gather-then-einsum torch path;
- `decode-attention-prefetch`: W2's decode attention (32 rows of 192 tokens, 16 layers, a
  bfloat16 cache on huge pages, 202 MB of K/V a step from DRAM), the kernel prefetching its
  K/V blocks into L2 vs the same kernel prefetching into L1 (its source compiled with
  `prefetch_at`);
- `silu-and-mul`: W1's decode step (32 rows x 1408, 8 layers), the fused kernel with the
  vectorised `numba_exp.exp32` vs the same loop with numba's scalar libm exp;
- `norm-rotary`: one W2 prefill layer's norms and q/k rotary (4096 rows), the fused kernels
  in parallel row chunks vs the torch formulations;
- `write-kv`: a decode step's K/V write (8 rows, SmolLM2's kv heads, a bfloat16 cache, 30
  layers), kv_numba's kernel vs torch's index_copy_;
- `native-half-mlp`: SmolLM2's MLP at 32 rows, 30 layers of bfloat16 weights on the matrix
  units, gate/up and the activation kept in bfloat16 vs the layer path's float32 round trip
  (skips on a CPU without bfloat16 matrix units).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numba import njit

from mrv2.attention import AttentionMetadata
from mrv2.attention import paged_torch as torch_paged
from mrv2.attention.decode_numba import decode_attention
from mrv2.models.layers import activation_numba, cpu_gemv, cpu_linear, norm_numba, rotary_numba

# W1: hidden 512, 8 layers, q 512 + kv 2*256, intermediate 1408, vocab 16000.
W1_SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(16000, 512)]
ROUNDS = 20


pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py


@pytest.fixture(scope="module")
def w1_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) for n, k in W1_SHAPES]


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("impl", ["numba_gemv", "torch_linear"])
def test_gemv(benchmark, w1_weights, impl, rows):
    benchmark.group = f"gemv-w1-step-{rows}rows"
    nbytes = sum(w.numel() * 4 for w in w1_weights)
    benchmark.extra_info.update(rows=rows, weight_bytes=nbytes, shapes="W1 x8 + lm_head",
                                threads=2, seed=0)
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=g) for k in (512, 1408)}
    fn = cpu_gemv.gemv if impl == "numba_gemv" else F.linear
    for w in w1_weights[-1:]:
        torch.testing.assert_close(cpu_gemv.gemv(xs[512], w), F.linear(xs[512], w),
                                   rtol=1e-4, atol=1e-3)

    def step() -> None:
        with torch.inference_mode():
            for w in w1_weights:
                fn(xs[w.shape[1]], w)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.parametrize("rows", [32, 512])
@pytest.mark.parametrize("impl", ["onednn_packed", "torch_linear"])
def test_linear(benchmark, w1_weights, impl, rows):
    benchmark.group = f"linear-w1-step-{rows}rows"
    flops = sum(2 * rows * w.numel() for w in w1_weights)
    benchmark.extra_info.update(rows=rows, gflop=flops / 1e9, shapes="W1 x8 + lm_head",
                                threads=2, seed=0)
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=g) for k in (512, 1408)}
    fn = cpu_linear.linear if impl == "onednn_packed" else F.linear
    with torch.inference_mode():
        torch.testing.assert_close(fn(xs[512], w1_weights[-1]), F.linear(xs[512], w1_weights[-1]),
                                   rtol=1e-4, atol=1e-3)

    def step() -> None:
        with torch.inference_mode():
            for w in w1_weights:
                fn(xs[w.shape[1]], w)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


SMOLLM2_SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]


@pytest.mark.parametrize("impl", ["padded", "unpadded"])
def test_linear_random_rows(benchmark, impl, monkeypatch):
    benchmark.group = "linear-random-rows"
    if impl == "unpadded":
        monkeypatch.setattr(cpu_linear, "padded_rows", lambda rows: rows)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(n, k, generator=g) for n, k in SMOLLM2_SHAPES]
    # Each round a row count this process has not seen (the two impls get different ones).
    counts = iter(range(17 if impl == "padded" else 18, 10**6, 2))
    benchmark.extra_info.update(shapes="SmolLM2 qkv, down, gate_up, o", threads=2)

    def step() -> None:
        rows = next(counts) % 584 + 17
        with torch.inference_mode():
            for w in weights:
                cpu_linear.linear(torch.randn(rows, w.shape[1]), w)

    benchmark.pedantic(step, rounds=ROUNDS * 5, warmup_rounds=2)


def _decode_case(rows: int = 32, seq_len: int = 256, block_size: int = 16, layers: int = 1):
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim = 4, 8, 64
    blocks_per_row = seq_len // block_size
    num_blocks = rows * blocks_per_row + 1
    caches = [torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
              for _ in range(layers)]
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is the null block
    tables = perm.view(rows, blocks_per_row).to(torch.int32)
    seq_lens = np.full(rows, seq_len, np.int32)
    qsl = np.arange(rows + 1, dtype=np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=rows, num_reqs=rows, num_decodes=rows,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_tables=tables, slot_mapping=torch.zeros(rows, dtype=torch.int64),
        query_start_loc_np=qsl, seq_lens_np=seq_lens, max_seq_len=seq_len)
    q = torch.randn(rows, heads, head_dim, generator=g)
    return q, caches, meta


# 1 layer: the cache (16 MiB) stays in the L3; 8 layers (134 MiB): every step reads from DRAM,
# as W1's decode does, where the kernel's prefetching counts.
@pytest.mark.parametrize("layers", [1, 8])
@pytest.mark.parametrize("impl", ["numba_in_place", "torch_gather"])
def test_decode_attention(benchmark, impl, layers):
    benchmark.group = f"decode-attention-32x256-{layers}layers"
    benchmark.extra_info.update(rows=32, seq_len=256, heads=8, kv_heads=4, head_dim=64,
                                block_size=16, layers=layers, threads=2, seed=0)
    q, caches, meta = _decode_case(layers=layers)
    scale = 64 ** -0.5
    expected = torch_paged._decode_attention(q, caches[0], meta, scale)
    torch.testing.assert_close(decode_attention(q, caches[0], meta.block_tables,
                                                meta.seq_lens_np, scale), expected,
                               rtol=1e-4, atol=1e-5)

    def step() -> None:
        for cache in caches:
            if impl == "numba_in_place":
                decode_attention(q, cache, meta.block_tables, meta.seq_lens_np, scale)
            else:
                torch_paged._decode_attention(q, cache, meta, scale)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


# Batch 1 at a long context, SmolLM2's heads (9 query, 3 kv, 64 wide), 30 layers from DRAM:
# each row's context split in two (work_split: 6 items on 2 threads) against whole contexts
# (3 items: one thread takes two). bench/README.md has the figures.
@pytest.mark.parametrize("impl", ["split_context", "whole_context"])
def test_decode_attention_batch_1(benchmark, impl):
    from mrv2.attention import decode_numba

    seq_len, block_size, layers = 1536, 16, 30
    benchmark.group = f"decode-attention-1x{seq_len}-{layers}layers"
    benchmark.extra_info.update(rows=1, seq_len=seq_len, heads=9, kv_heads=3, head_dim=64,
                                block_size=block_size, layers=layers, threads=2)
    g = torch.Generator().manual_seed(0)
    blocks = seq_len // block_size
    caches = [torch.randn(2, blocks + 1, block_size, 3, 64, generator=g).numpy()
              for _ in range(layers)]
    table = (torch.randperm(blocks, generator=g) + 1).view(1, blocks).int().numpy()
    q = torch.randn(1, 9, 64, generator=g).numpy()
    lens = np.array([seq_len], np.int32)
    split = decode_numba.work_split(1, 3, 2, 0) if impl == "split_context" else (1, 1)
    _time_work_split(benchmark, q, caches, table, lens, split, other=(1, 1))


def _time_work_split(benchmark, q, caches, tables, lens, work, other) -> None:
    """Check that the kernel gives the same result under work splits `work` and `other` (on
    the first layer's cache), then time it under `work` over every layer's cache."""
    from mrv2.attention import decode_numba

    outs = [np.empty_like(q) for _ in range(2)]
    for out, split in zip(outs, (work, other)):
        decode_numba.decode_kernel(q, caches[0][0], caches[0][1], tables, lens,
                                   np.float32(0.125), out, *split, *decode_numba.PLAIN_ATTENTION)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)

    def step() -> None:
        for cache in caches:
            decode_numba.decode_kernel(q, cache[0], cache[1], tables, lens, np.float32(0.125),
                                       outs[0], *work, *decode_numba.PLAIN_ATTENTION)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


# 32 rows of 192 tokens, SmolLM2's heads, a bfloat16 cache, 30 layers (141 MB of K/V a step):
# work items of one kv head against items of a whole row (work_split picks by whether the
# last-level cache holds the step's K/V). bench/README.md has the figures.
@pytest.mark.parametrize("items", ["kv_head", "whole_row"])
def test_decode_attention_work_items(benchmark, items):
    from mrv2.attention.kv_numba import numpy_view

    rows, seq_len, block_size, layers = 32, 192, 16, 30
    benchmark.group = f"decode-attention-{rows}x{seq_len}-{layers}layers-bf16"
    benchmark.extra_info.update(rows=rows, seq_len=seq_len, heads=9, kv_heads=3, head_dim=64,
                                block_size=block_size, layers=layers, threads=2)
    g = torch.Generator().manual_seed(0)
    blocks = rows * seq_len // block_size
    caches = [numpy_view(torch.randn(2, blocks + 1, block_size, 3, 64, generator=g)
                         .to(torch.bfloat16)) for _ in range(layers)]
    tables = (torch.randperm(blocks, generator=g) + 1).view(rows, -1).int().numpy()
    q = torch.randn(rows, 9, 64, generator=g).numpy()
    lens = np.full(rows, seq_len, np.int32)
    kv_head, whole_row = (1, 1), (3, 1)
    work, other = (kv_head, whole_row) if items == "kv_head" else (whole_row, kv_head)
    _time_work_split(benchmark, q, caches, tables, lens, work, other)


def _kernel_prefetching_into_l1():
    """decode_numba's kernel compiled from its source with the K/V prefetches into L1
    (`prefetch_at`) instead of L2, as it was before: the baseline of the prefetch level."""
    import types
    from pathlib import Path

    from mrv2.attention import decode_numba

    source = Path(decode_numba.__file__).read_text()
    call = "prefetch_to_l2_at(cache, block, line)"
    assert call in source, "the kernel's prefetch call changed: update this baseline"
    source = (source.replace(call, "prefetch_at(cache, block, line)")
              .replace("CACHE_LINE_BYTES, prefetch_to_l2_at", "CACHE_LINE_BYTES, prefetch_at")
              .replace("cache=True", "cache=False"))
    module = types.ModuleType("decode_numba_prefetch_l1")
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module.decode_kernel


# W2's decode attention at batch 32 (16 heads, 8 kv heads of 64, 16 layers, rows of 192
# tokens, blocks laid out as the engine allocates them: each prompt's 8 in a run, the rest
# interleaved), the K/V from DRAM: prefetched into L2 (the kernel) against into L1 (its
# previous form). bench/README.md has the figures.
@pytest.mark.parametrize("level", ["to_l2", "to_l1"])
def test_decode_attention_prefetch_level(benchmark, level):
    from mrv2.attention import decode_numba
    from mrv2.attention.kv_numba import numpy_view
    from mrv2.utils import huge_pages

    if benchmark.disabled and level == "to_l1":  # an uncached compile (~35 s) of a baseline
        pytest.skip("the baseline kernel is compiled only where it is timed")
    rows, seq_len, block_size, layers, heads, kv_heads = 32, 192, 16, 16, 16, 8
    benchmark.group = f"decode-attention-prefetch-{rows}x{seq_len}-{layers}layers-bf16"
    benchmark.extra_info.update(rows=rows, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                                head_dim=64, block_size=block_size, layers=layers, threads=2)
    g = torch.Generator().manual_seed(0)
    per_row = seq_len // block_size
    caches = []
    for _ in range(layers):
        cache = huge_pages.zeros((2, rows * per_row, block_size, kv_heads, 64), torch.bfloat16)
        cache.copy_(torch.randn(cache.shape, generator=g))
        caches.append((numpy_view(cache[0]), numpy_view(cache[1]), cache))
    prompt_blocks = np.arange(rows * 8).reshape(rows, 8)
    later = rows * 8 + np.arange(rows * (per_row - 8)).reshape(per_row - 8, rows).T
    tables = np.ascontiguousarray(np.concatenate([prompt_blocks, later], 1), dtype=np.int32)
    q = torch.randn(rows, heads, 64, generator=g).numpy()
    lens = np.full(rows, seq_len, np.int32)
    kernel = decode_numba.decode_kernel if level == "to_l2" else _kernel_prefetching_into_l1()
    outs = [np.empty_like(q) for _ in range(2)]
    kernel(q, caches[0][0], caches[0][1], tables, lens, np.float32(0.125), outs[0], 1, 1,
           *decode_numba.PLAIN_ATTENTION)
    decode_numba.decode_kernel(q, caches[0][0], caches[0][1], tables, lens, np.float32(0.125),
                               outs[1], 1, 1, *decode_numba.PLAIN_ATTENTION)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)

    def step() -> None:
        for k_cache, v_cache, _ in caches:
            kernel(q, k_cache, v_cache, tables, lens, np.float32(0.125), outs[0], 1, 1,
                   *decode_numba.PLAIN_ATTENTION)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


# Decode attention from the caches (4 rows of 192 tokens, one layer: 0.6 MB of K/V in
# bfloat16), a bfloat16 cache against the same values in a float32 cache: a 16-bit key or value
# row is widened once for the three query heads of its group (decode_numba.widen_four).
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float32"])
def test_decode_attention_from_cache(benchmark, cache_dtype):
    from mrv2.attention.kv_numba import numpy_view

    rows, seq_len, block_size = 4, 192, 16
    benchmark.group = f"decode-attention-{rows}x{seq_len}-hot"
    benchmark.extra_info.update(rows=rows, seq_len=seq_len, heads=9, kv_heads=3, head_dim=64,
                                cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    blocks = rows * seq_len // block_size
    cache = torch.randn(2, blocks + 1, block_size, 3, 64, generator=g).to(torch.bfloat16)
    caches = [numpy_view(cache.to(getattr(torch, cache_dtype)))]
    tables = (torch.randperm(blocks, generator=g) + 1).view(rows, -1).int().numpy()
    q = torch.randn(rows, 9, 64, generator=g).numpy()
    lens = np.full(rows, seq_len, np.int32)
    _time_work_split(benchmark, q, caches, tables, lens, (1, 1), (3, 1))


@njit(fastmath=True, error_model="numpy", cache=True)
def _silu_and_mul_libm(gate_up, width, out):
    """activation_numba's SiLU-and-mul with numba's np.exp (a scalar libm call), the baseline."""
    for r in range(gate_up.shape[0]):
        for i in range(width):
            g = gate_up[r, i]
            out[r, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[r, width + i]


# W1's decode step: 32 rows of the [32, 2 * 1408] gate/up output, 8 layers.
@pytest.mark.parametrize("impl", ["exp32", "libm_exp"])
def test_silu_and_mul(benchmark, impl):
    benchmark.group = "silu-and-mul-w1-step-32rows"
    benchmark.extra_info.update(rows=32, intermediate=1408, layers=8, threads=1, seed=0)
    g = torch.Generator().manual_seed(0)
    gate_ups = [torch.randn(32, 2 * 1408, generator=g) * 4 for _ in range(8)]
    expected = F.silu(gate_ups[0][:, :1408]) * gate_ups[0][:, 1408:]
    torch.testing.assert_close(activation_numba.silu_and_mul(gate_ups[0]), expected,
                               rtol=1e-5, atol=1e-6)
    out = np.empty((32, 1408), np.float32)

    def step() -> None:
        for gate_up in gate_ups:
            if impl == "exp32":
                activation_numba.silu_and_mul(gate_up)
            else:
                _silu_and_mul_libm(gate_up.numpy(), 1408, out)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


def _torch_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's torch formulation (norm.py's fallback): the baseline."""
    summed = x + residual
    return weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)), summed


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos[:, None, :]) + (rotated * sin[:, None, :])).reshape(shape)


# W2's prefill: 32 prompts x 128 tokens = 4096 rows of hidden 1024 (16 MB per tensor, far past
# the L3), q of 16 heads x 64; one layer's two norms and q/k rotary.
@pytest.mark.parametrize("impl", ["fused_parallel", "torch_ops"])
def test_prefill_norm_and_rotary(benchmark, impl):
    benchmark.group = "norm-rotary-w2-prefill-4096rows"
    rows, hidden, head_dim = 4096, 1024, 64
    benchmark.extra_info.update(rows=rows, hidden=hidden, heads=16, kv_heads=8,
                                head_dim=head_dim, threads=2, seed=0)
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    weight = torch.rand(hidden, generator=g) + 0.5
    qkv = torch.randn(rows, 2 * hidden, generator=g)
    q, k = qkv[:, :hidden], qkv[:, hidden:hidden + hidden // 2]  # strided views, as split
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    with torch.inference_mode():
        torch.testing.assert_close(norm_numba.rms_norm(x, weight, 1e-5, residual),
                                   _torch_rms_norm(x, residual, weight, 1e-5),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rotary_numba.apply_rotary(q, cos, sin, head_dim),
                                   _torch_rotary(q, cos, sin, head_dim), rtol=1e-5, atol=1e-5)

    def layer() -> None:
        with torch.inference_mode():
            for _ in range(2):
                if impl == "fused_parallel":
                    norm_numba.rms_norm(x, weight, 1e-5, residual)
                else:
                    _torch_rms_norm(x, residual, weight, 1e-5)
            for t in (q, k):
                if impl == "fused_parallel":
                    rotary_numba.apply_rotary(t, cos, sin, head_dim)
                else:
                    _torch_rotary(t, cos, sin, head_dim)

    benchmark.pedantic(layer, rounds=ROUNDS, warmup_rounds=2)


# SmolLM2's MLP (576 -> 2 x 1536 -> 576), 32 rows, 30 layers of bfloat16 weights (~160 MB):
# GatedMLP's bfloat16 intermediate (layers/mlp.py) against its plain path (each projection's
# own forward, float32 between them).
@pytest.mark.parametrize("impl", ["bf16_intermediate", "float32_round_trip"])
def test_native_half_mlp(benchmark, impl):
    from mrv2.models.layers import linear, quantized
    from mrv2.models.layers.activation import silu_and_mul
    from mrv2.models.layers.mlp import GatedMLP, native_bfloat16_weights
    from mrv2.models.layers.quantized import PackedWeight

    if not quantized.computes_natively(torch.bfloat16):
        pytest.skip("no bfloat16 matrix units on this CPU")
    benchmark.group = "native-half-mlp-32rows-30layers"
    benchmark.extra_info.update(rows=32, hidden=576, intermediate=1536, layers=30, threads=2)
    g = torch.Generator().manual_seed(0)
    forwards = []
    for _ in range(30):
        mlp = GatedMLP(576, 1536, bias=False, hidden_act="silu")
        for module in (mlp.gate_up_proj, mlp.down_proj):
            weight = torch.randn(module.weight.shape, generator=g) * 0.05
            linear.set_packed(module, PackedWeight.from_float(weight, torch.bfloat16))
        assert native_bfloat16_weights(mlp, 32) is not None  # the case measures that path
        forwards.append(mlp.forward_rows if impl == "bf16_intermediate" else
                        (lambda x, m=mlp: m.down_proj(silu_and_mul(m.gate_up_proj(x)))))
    x = torch.randn(32, 576, generator=g)

    def step() -> None:
        with torch.inference_mode():
            for forward in forwards:
                forward(x)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.parametrize("impl", ["numba_kernel", "torch_index_copy"])
def test_write_kv(benchmark, impl, monkeypatch):
    from mrv2.attention import paged_torch

    if impl == "torch_index_copy":
        monkeypatch.setattr(paged_torch, "NUMBA_WRITE_MAX_TOKENS", 0)
    benchmark.group = "write-kv-8rows-30layers-bf16"
    benchmark.extra_info.update(rows=8, kv_heads=3, head_dim=64, layers=30, threads=2)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(8, 960, generator=g)
    k, v = qkv[:, 576:768].view(8, 3, 64), qkv[:, 768:].view(8, 3, 64)
    caches = [torch.zeros(2, 256, 16, 3, 64, dtype=torch.bfloat16) for _ in range(30)]
    slots = torch.randperm(256 * 16, generator=g)[:8]

    def step() -> None:
        for cache in caches:
            paged_torch.write_kv(k, v, cache, slots)

    benchmark.pedantic(step, rounds=ROUNDS * 5, warmup_rounds=2)
