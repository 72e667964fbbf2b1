"""Split-KV decode (flash-decoding) vs the torch backend.

Under the interpreter on CPU tensors: GQA 8:1 at head_dim 128, one row of 8k and of 32k
tokens (block size 256 and a 1024-key tile keep the interpreter's step count small), a batch
where long rows split and short ones leave splits empty, seq lens off the tile grid, and graph
padding rows. The `cuda` test runs the compiled kernels in fp32 and bf16, eagerly and replayed
from a CUDA graph.
"""

from __future__ import annotations

import time

import pytest
import torch
# Imported outside the interpreter, as a full test run does: the kernels must not rely on
# Triton's own jitted helpers (tl.sum, tl.max), which then fail under the interpreter.
import triton.language  # noqa: F401

from mrv2 import platform
from mrv2.attention.split_kv_triton import SplitKVScratch, num_kv_splits, split_kv_decode
from tests.attention.test_paged_triton import Step, make_step, padded_inputs

CPU = torch.device("cpu")


def run_split(step: Step, inputs: dict[str, torch.Tensor], num_splits: int, tile: int,
              max_rows: int = 8) -> torch.Tensor:
    num_heads, head_dim = step.q.shape[1:]
    scratch = SplitKVScratch.allocate(max_rows, num_heads, num_splits, head_dim,
                                      step.q.device)
    cache = step.kv_cache.clone()
    from mrv2.attention import paged_triton

    paged_triton.write_kv(inputs["k"], inputs["v"], cache, inputs["slot_mapping"])
    out = torch.full_like(inputs["q"], float("nan"))
    split_kv_decode(inputs["q"], cache, inputs["query_start_loc"], inputs["seq_lens"],
                    inputs["block_tables"], step_scale(step), scratch, out=out, tile=tile)
    return out


def step_scale(step: Step) -> float:
    return step.q.shape[-1] ** -0.5


def check(step: Step, num_splits: int, tile: int, extra_rows: int = 0,
          tol: float = 1e-5) -> None:
    ref_out, _ = reference_scaled(step)
    with platform.triton_interpreter():
        out = run_split(step, padded_inputs(step, extra_rows, extra_rows, poison=False),
                        num_splits, tile)
    n = step.meta.num_actual_tokens
    assert (out[:n] - ref_out).abs().max().item() <= tol
    assert out[n:].isnan().all()


def reference_scaled(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    from mrv2.attention import paged_torch

    cache = step.kv_cache.clone()
    paged_torch.write_kv(step.k, step.v, cache, step.meta.slot_mapping)
    return paged_torch.paged_attention(step.q, cache, step.meta, step_scale(step)), cache


@pytest.mark.parametrize("seq_len", [8192, 32768 - 37], ids=["8k", "32k"])
def test_one_long_row_gqa8(seq_len: int) -> None:
    """8 query heads on 1 kv head, head_dim 128; 32k - 37 ends mid-tile and mid-block."""
    block_size = 256
    step = make_step([1], [seq_len], num_kv_heads=1, seed=seq_len, num_heads=8,
                     head_dim=128, block_size=block_size,
                     num_blocks=seq_len // block_size + 2)
    start = time.perf_counter()
    check(step, num_splits=16 if seq_len > 8192 else 4, tile=1024)
    assert time.perf_counter() - start < 15


def test_mixed_rows_some_split_some_not() -> None:
    """With 4 splits of 16-key tiles: rows of 1..16 keys use split 0 only, 40 and 67 keys
    some splits with a partial last tile, 200 keys all four; graph padding rows exit."""
    seq_lens = [1, 15, 40, 67, 200, 16]
    step = make_step([1] * len(seq_lens), seq_lens, num_kv_heads=2, seed=11, num_heads=8,
                     head_dim=16, block_size=16, num_blocks=30)
    check(step, num_splits=4, tile=16, extra_rows=1)


def test_one_split_is_plain_flash_attention() -> None:
    step = make_step([1, 1, 1], [5, 33, 70], num_kv_heads=4, seed=2, num_heads=4,
                     head_dim=16, block_size=8, num_blocks=20)
    check(step, num_splits=1, tile=16)


def test_num_kv_splits_is_a_power_of_two_capped_by_the_context() -> None:
    assert num_kv_splits(8, 1 << 20, CPU) == 1  # one "SM": 2 programs over 8 kv heads
    assert num_kv_splits(1, 1 << 20, CPU) == 2
    assert num_kv_splits(1, 100, CPU, tile=64) == 1


def test_scratch_must_fit() -> None:
    step = make_step([1, 1], [4, 9], num_kv_heads=1, seed=0, num_heads=2, head_dim=16)
    small = SplitKVScratch.allocate(1, 2, 2, 16, CPU)
    with platform.triton_interpreter():
        with pytest.raises(ValueError, match="does not hold"):
            split_kv_decode(step.q, step.kv_cache, step.meta.query_start_loc,
                            step.meta.seq_lens, step.meta.block_tables, 0.25, small)
    with pytest.raises(ValueError, match="power of two"):
        SplitKVScratch.allocate(1, 2, 3, 16, CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_on_cuda_eager_and_graph_replay(dtype: torch.dtype) -> None:
    """Compiled kernels vs the torch backend in fp32 on the same values; then one graph
    captured on static buffers replays each batch copied in (padded to 8 rows)."""
    device = torch.device("cuda")
    heads, kv_heads, head_dim, block_size = 8, 1, 128, 16
    tol = 5e-5 if dtype == torch.float32 else 2e-2
    rows_padded = 8
    batches = [[8000], [1, 17, 4096, 300, 64], [33, 2, 7000, 16, 1000, 5, 129]]
    num_splits = num_kv_splits(kv_heads, 8192, device)
    scratch = SplitKVScratch.allocate(rows_padded, heads, num_splits, head_dim, device)
    steps = [make_step([1] * len(s), s, kv_heads, seed=i, num_heads=heads, head_dim=head_dim,
                       block_size=block_size, num_blocks=sum(s) // block_size + 2 * len(s),
                       dtype=dtype, device="cuda")
             for i, s in enumerate(batches)]
    cols = 8192 // block_size + 1

    def padded(step: Step) -> dict[str, torch.Tensor]:
        extra = rows_padded - step.meta.num_reqs
        inputs = padded_inputs(step, extra, extra, poison=False)
        inputs["block_tables"] = torch.nn.functional.pad(
            inputs["block_tables"], (0, cols - inputs["block_tables"].shape[1]))
        return inputs

    def expected(step: Step) -> torch.Tensor:
        as_fp32 = Step(step.q.float(), step.k.float(), step.v.float(), step.kv_cache.float(),
                       step.meta)
        return reference_scaled(as_fp32)[0]

    def forward(inputs: dict[str, torch.Tensor], cache: torch.Tensor,
                out: torch.Tensor) -> None:
        from mrv2.attention import paged_triton

        paged_triton.write_kv(inputs["k"], inputs["v"], cache, inputs["slot_mapping"])
        split_kv_decode(inputs["q"], cache, inputs["query_start_loc"], inputs["seq_lens"],
                        inputs["block_tables"], head_dim ** -0.5, scratch, out=out)

    for step in steps:
        inputs, cache = padded(step), step.kv_cache.clone()
        out = torch.full_like(inputs["q"], float("nan"))
        forward(inputs, cache, out)
        n = step.meta.num_actual_tokens
        assert (out[:n].float() - expected(step)).abs().max().item() <= tol
        assert out[n:].isnan().all()

    static = {name: t.clone() for name, t in padded(steps[0]).items()}
    cache = torch.zeros(2, max(s.kv_cache.shape[1] for s in steps), block_size, kv_heads,
                        head_dim, dtype=dtype, device=device)
    out = torch.empty_like(static["q"])
    forward(static, cache, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(static, cache, out)
    for step in steps:
        for name, t in padded(step).items():
            static[name].copy_(t)
        cache.zero_()
        cache[:, :step.kv_cache.shape[1]].copy_(step.kv_cache)
        graph.replay()
        torch.cuda.synchronize()
        n = step.meta.num_actual_tokens
        assert (out[:n].float() - expected(step)).abs().max().item() <= tol
