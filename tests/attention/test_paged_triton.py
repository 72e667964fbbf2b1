"""Triton paged attention and KV write vs the torch (CPU) backend.

The kernels run under TRITON_INTERPRET=1 on CPU tensors (`platform.triton_interpreter()`), so
shapes are tiny: ~20 tokens, head_dim 16, block_size 4. The `cuda` test runs them compiled on a GPU, in
bf16 and fp32, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mrv2 import platform
from mrv2.attention import paged_torch as torch_paged
from mrv2.attention import paged_triton as triton_paged
from mrv2.attention.backend import AttentionMetadata


HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS = 16, 4, 48, 4
SCALE = HEAD_DIM ** -0.5
# Block ids no kernel may ever dereference: far past the end of the cache.
POISON = 1 << 20


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # cached prefixes written, finite garbage everywhere else
    meta: AttentionMetadata  # unpadded, for the torch backend


def make_step(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, seed: int,
              num_heads: int = NUM_HEADS, head_dim: int = HEAD_DIM,
              block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> Step:
    """Rows get disjoint, shuffled (non-contiguous, out of order) block ids; each row's
    cached prefix (seq_len - query_len tokens) is already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # one spare column
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    new_slots, prefix_slots = [], []
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        n = -(-seq_len // block_size)
        tables[row, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(seq_len)
        slots = tables[row].long()[pos // block_size] * block_size + pos % block_size
        prefix_slots.append(slots[:seq_len - q_len])
        new_slots.append(slots[seq_len - q_len:])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    sl = np.array(seq_lens, dtype=np.int32)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    num_tokens = int(qsl[-1])
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 100
    prefix = torch.cat(prefix_slots)
    torch_paged.write_kv(randn(len(prefix), num_kv_heads, head_dim),
                         randn(len(prefix), num_kv_heads, head_dim), kv_cache, prefix)
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=len(seq_lens), num_decodes=num_decodes,
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(sl).to(device), block_tables=tables.to(device),
        slot_mapping=torch.cat(new_slots).to(device), query_start_loc_np=qsl,
        seq_lens_np=sl, max_seq_len=int(sl.max()))
    return Step(randn(num_tokens, num_heads, head_dim).to(device),
                randn(num_tokens, num_kv_heads, head_dim).to(device),
                randn(num_tokens, num_kv_heads, head_dim).to(device), kv_cache.to(device), meta)


def reference(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the write) from the torch backend."""
    cache = step.kv_cache.clone()
    torch_paged.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    return torch_paged.paged_attention(step.q, cache, step.meta, SCALE), cache


def padded_inputs(step: Step, extra_rows: int, extra_tokens: int,
                  poison: bool = True) -> dict[str, torch.Tensor]:
    """The step's device inputs padded as for graph replay (DESIGN.md invariant 6): padded
    query_start_loc entries = num_tokens, seq_lens 0, block-table rows 0, slot_mapping -1;
    padded tokens carry garbage q/k/v. With `poison`, every block-table entry a real row does
    not need holds a block id far outside the cache."""
    meta, device = step.meta, step.q.device
    n = meta.num_actual_tokens
    tables = meta.block_tables.clone()
    if poison:
        needed = -(-meta.seq_lens.long() // BLOCK_SIZE)
        cols = torch.arange(tables.shape[1], device=device)
        tables[cols[None, :] >= needed[:, None]] = POISON
    zeros_rows = torch.zeros(extra_rows, tables.shape[1], dtype=torch.int32, device=device)

    def garbage(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.full((extra_tokens, *x.shape[1:]), 1e4, dtype=x.dtype,
                                        device=device)])

    return dict(
        q=garbage(step.q), k=garbage(step.k), v=garbage(step.v),
        query_start_loc=torch.cat([meta.query_start_loc,
                                   torch.full((extra_rows,), n, dtype=torch.int32,
                                              device=device)]),
        seq_lens=torch.cat([meta.seq_lens,
                            torch.zeros(extra_rows, dtype=torch.int32, device=device)]),
        block_tables=torch.cat([tables, zeros_rows]),
        slot_mapping=torch.cat([meta.slot_mapping,
                                torch.full((extra_tokens,), -1, dtype=torch.int64,
                                           device=device)]))


def run_triton(step: Step, inputs: dict[str, torch.Tensor], **tiles
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output filled with a NaN sentinel first, cache after the write) from Triton."""
    cache = step.kv_cache.clone()
    out = torch.full_like(inputs["q"], float("nan"))
    triton_paged.write_kv(inputs["k"], inputs["v"], cache, inputs["slot_mapping"])
    triton_paged.paged_attention(inputs["q"], cache, inputs["query_start_loc"],
                                 inputs["seq_lens"], inputs["block_tables"], SCALE, out=out,
                                 **tiles)
    return out, cache


def check(step: Step, extra_rows: int = 0, extra_tokens: int = 0, tol: float = 1e-5,
          **tiles) -> None:
    ref_out, ref_cache = reference(step)
    with platform.triton_interpreter():
        out, cache = run_triton(step, padded_inputs(step, extra_rows, extra_tokens), **tiles)
    n = step.meta.num_actual_tokens
    # Only the real slots changed, to exactly the values the torch write stores.
    assert torch.equal(cache, ref_cache)
    assert (out[:n].float() - ref_out.float()).abs().max().item() <= tol
    # Padded tokens belong to no row: their output rows are left untouched.
    assert out[n:].isnan().all()


DECODE = ([1, 1, 1, 1, 1], [1, 4, 5, 9, 14])
PREFILL = ([6, 3, 9], [6, 3, 9])
# Decodes first, then chunks: a cached prefix ending mid-block, one on a block boundary,
# one from scratch.
MIXED = ([1, 1, 5, 4, 7], [6, 11, 7, 12, 7])


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("batch", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
def test_matches_torch_backend(batch: tuple[list[int], list[int]], num_kv_heads: int) -> None:
    query_lens, seq_lens = batch
    check(make_step(query_lens, seq_lens, num_kv_heads, seed=sum(seq_lens) + num_kv_heads))


@pytest.mark.parametrize("block_m,tile", [(4, 4), (2, 2), (8, 8), (16, 16)],
                         ids=["tile=block", "tile<block", "tile=2blocks", "one-q-block"])
def test_tile_sizes(block_m: int, tile: int) -> None:
    """Several query blocks per row (block_m 2..8 over GQA group 2), key tiles smaller than,
    equal to and spanning several cache blocks."""
    check(make_step(*MIXED, num_kv_heads=2, seed=7), block_m=block_m, tile=tile)


@pytest.mark.parametrize("batch", [DECODE, MIXED], ids=["decode", "mixed"])
def test_graph_padding_changes_nothing(batch: tuple[list[int], list[int]]) -> None:
    """Padded rows (no query tokens, seq_len 0) and padded tokens (slot -1, garbage q/k/v)
    leave the cache and the real outputs as they are; padded output rows stay untouched."""
    check(make_step(*batch, num_kv_heads=2, seed=3), extra_rows=3, extra_tokens=5,
          block_m=4, tile=8)


def test_half_precision() -> None:
    """fp16 q and cache: scores and output accumulate in fp32, probabilities are rounded to
    fp16 for the second product (bf16 is tested on CUDA only: the interpreter's bf16 tl.dot
    is wrong)."""
    step = make_step(*MIXED, num_kv_heads=2, seed=5, dtype=torch.float16)
    as_fp32 = Step(step.q.float(), step.k.float(), step.v.float(), step.kv_cache.float(),
                   step.meta)
    ref_out, ref_cache = reference(as_fp32)
    with platform.triton_interpreter():
        out, cache = run_triton(step, padded_inputs(step, 0, 0))
    assert out.dtype == torch.float16
    assert torch.equal(cache.float(), ref_cache)
    assert (out.float() - ref_out).abs().max().item() <= 2e-3


_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs a CUDA GPU")]


# float16 on CUDA only: under the interpreter it differs from bfloat16 in the cast alone, and
# each case costs CI ~25 s there.
@pytest.mark.parametrize("cache_dtype, device", [
    pytest.param(torch.bfloat16, "cpu", id="bf16-cpu"),
    pytest.param(torch.float16, "cuda", id="f16-cuda", marks=_CUDA),
    pytest.param(torch.bfloat16, "cuda", id="bf16-cuda", marks=_CUDA)])
def test_float32_queries_over_a_16_bit_cache(cache_dtype: torch.dtype, device: str) -> None:
    """kv_cache_dtype under a float32 model: the write rounds as torch's `.to()` does, and
    attention reads the cache widened to float32, as the torch backend does."""
    def with_16_bit_cache(step: Step) -> Step:
        return Step(step.q, step.k, step.v, step.kv_cache.to(cache_dtype), step.meta)

    step = with_16_bit_cache(make_step(*MIXED, num_kv_heads=2, seed=7))
    on_device = with_16_bit_cache(make_step(*MIXED, num_kv_heads=2, seed=7, device=device))
    _, ref_cache = reference(step)
    with platform.triton_interpreter() if device == "cpu" else contextlib.nullcontext():
        out, cache = run_triton(on_device, padded_inputs(on_device, 0, 0))
    out, cache = out.cpu(), cache.cpu()
    ulps = (cache.view(torch.int16).int() - ref_cache.view(torch.int16).int()).abs().max()
    # The interpreter narrows to bfloat16 by truncation (compiled Triton rounds to nearest
    # even, as torch does): one ulp apart there.
    assert ulps <= (1 if device == "cpu" and cache_dtype == torch.bfloat16 else 0)
    torch_out = torch_paged.paged_attention(step.q, cache, step.meta, SCALE)
    assert (out - torch_out).abs().max().item() <= 1e-4


def test_write_kv_strided_inputs_skip_negative_slots() -> None:
    """k/v as column slices of one fused qkv tensor; slot -1 writes nothing."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, tokens = 2, 6
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * kv_heads) * HEAD_DIM, generator=gen)
    _, k, v = qkv.split([NUM_HEADS * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], -1)
    k, v = k.view(tokens, kv_heads, HEAD_DIM), v.view(tokens, kv_heads, HEAD_DIM)
    assert not k.is_contiguous()
    slots = torch.tensor([5, -1, 0, 17, -1, 30])
    cache = torch.randn(2, 8, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=gen)
    expected = cache.clone()
    torch_paged.write_kv(k, v, expected, slots)
    with platform.triton_interpreter():
        triton_paged.write_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_needs_the_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    step = make_step(*DECODE, num_kv_heads=2, seed=0)
    with pytest.raises(RuntimeError, match="triton_interpreter"):
        triton_paged.paged_attention(step.q, step.kv_cache, step.meta.query_start_loc,
                                     step.meta.seq_lens, step.meta.block_tables, SCALE)
    with pytest.raises(RuntimeError, match="triton_interpreter"):
        triton_paged.write_kv(step.k, step.v, step.kv_cache, step.meta.slot_mapping)


def test_rejects_bad_shapes() -> None:
    step = make_step(*DECODE, num_kv_heads=2, seed=0)
    meta = step.meta
    with platform.triton_interpreter():
        with pytest.raises(ValueError, match="power of two"):
            triton_paged.paged_attention(step.q[..., :12], step.kv_cache[..., :12],
                                         meta.query_start_loc, meta.seq_lens,
                                         meta.block_tables, SCALE)
        with pytest.raises(ValueError, match="does not fit"):
            triton_paged.paged_attention(step.q[:, :3], step.kv_cache, meta.query_start_loc,
                                         meta.seq_lens, meta.block_tables, SCALE)
        with pytest.raises(ValueError, match="multiple"):
            triton_paged.paged_attention(step.q, step.kv_cache, meta.query_start_loc,
                                         meta.seq_lens, meta.block_tables, SCALE, block_m=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_on_cuda_eager_and_graph_replay(dtype: torch.dtype) -> None:
    """Compiled kernels vs the torch backend (in fp32 on the same values), eagerly and
    replayed from a CUDA graph whose inputs are refilled with another batch of the same
    padded shape."""
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 128, 16, 96
    tol = 5e-5 if dtype == torch.float32 else 2e-2
    tokens_padded, rows_padded = 160, 8
    batches = [([1, 1, 1, 40, 77], [17, 300, 1, 90, 77]),  # decodes + chunks (one cached)
               ([1, 1, 1, 1, 1, 1, 1], [5, 64, 129, 33, 400, 2, 16]),  # decode only
               ([130], [250])]  # one long chunk after a long prefix
    steps = [make_step(q, s, kv_heads, seed=i, num_heads=heads, head_dim=head_dim,
                       block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                       device="cuda")
             for i, (q, s) in enumerate(batches)]

    def padded(step: Step) -> dict[str, torch.Tensor]:
        meta = step.meta
        inputs = padded_inputs(step, rows_padded - meta.num_reqs,
                               tokens_padded - meta.num_actual_tokens, poison=False)
        cols = 300 // block_size + 8
        inputs["block_tables"] = torch.nn.functional.pad(
            inputs["block_tables"], (0, cols - inputs["block_tables"].shape[1]))
        return inputs

    def expected(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        as_fp32 = Step(step.q.float(), step.k.float(), step.v.float(), step.kv_cache.float(),
                       step.meta)
        out, cache = reference(as_fp32)
        return out, cache.to(dtype)

    def check_result(step: Step, out: torch.Tensor, cache: torch.Tensor) -> None:
        ref_out, ref_cache = expected(step)
        n = step.meta.num_actual_tokens
        assert torch.equal(cache, ref_cache)
        assert (out[:n].float() - ref_out).abs().max().item() <= tol

    # Eager, compiled.
    for step in steps:
        inputs = padded(step)
        # Decode-only batches also run with the decode tile (as decode graphs do).
        for uniform_decode in {False, step.meta.num_decodes == step.meta.num_reqs}:
            out, cache = run_triton(step, inputs, uniform_decode=uniform_decode)
            check_result(step, out, cache)
            assert out[step.meta.num_actual_tokens:].isnan().all()

    # Captured once on static buffers, replayed with each batch copied in.
    static = {name: t.clone() for name, t in padded(steps[0]).items()}
    cache = steps[0].kv_cache.clone()
    out = torch.empty_like(static["q"])

    def forward() -> None:
        triton_paged.write_kv(static["k"], static["v"], cache, static["slot_mapping"])
        triton_paged.paged_attention(static["q"], cache, static["query_start_loc"],
                                     static["seq_lens"], static["block_tables"], SCALE,
                                     out=out)

    forward()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for step in steps:
        for name, t in padded(step).items():
            static[name].copy_(t)
        cache.copy_(step.kv_cache)
        graph.replay()
        torch.cuda.synchronize()
        check_result(step, out, cache)
