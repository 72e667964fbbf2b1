"""Prefill tiles on packed weights (quantized_tiles): the product against x @ dequantize().T for
blocks, 16-bit weights and weights held as group panels, with tiles that do not divide the
outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mrv2.models.layers import quantized_panel_numba, quantized_tiles
from mrv2.models.layers.quantized import PackedWeight

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw  # noqa: E402
from tests.models.quantized_helpers import dequantized  # noqa: E402


def _check(x: torch.Tensor, w: PackedWeight, dense: torch.Tensor) -> None:
    expect = x @ dense.T
    got = quantized_tiles.tiled_linear(x, w)
    assert got.shape == expect.shape and got.is_contiguous()
    # The same float32 weights: only torch.mm's summation order may differ with the tile shape.
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q6_K", "F16", "BF16"])
def test_tiles_of_blocks_and_16_bit_weights(gguf_type, monkeypatch):
    n, k = 150, 256
    w = PackedWeight.from_gguf(random_raw(gguf_type, n, k, 5), gguf_type, (n, k))
    monkeypatch.setattr(quantized_tiles, "TILE_ELEMENTS", 40 * k)  # 40-row tiles, ragged last
    _check(torch.randn(37, k, generator=torch.Generator().manual_seed(1)), w, dequantized(w))


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_K", "Q8_0", "Q5_1"])
@pytest.mark.parametrize("tile_panels", [1, 2, 8])
def test_tiles_of_a_weight_held_as_its_group_panels(gguf_type, tile_panels, monkeypatch):
    n, k = 150, 256  # three panels, the last ragged
    w = PackedWeight.from_gguf(random_raw(gguf_type, n, k, 6), gguf_type, (n, k))
    dense = dequantized(w)
    # Only the panels' dequantization runs here, not their kernel.
    monkeypatch.setattr(quantized_panel_numba, "GROUP_PANELS_RUN", True)
    w.store_as_panels()
    monkeypatch.setattr(quantized_tiles, "TILE_ELEMENTS", tile_panels * 64 * k)
    _check(torch.randn(33, k, generator=torch.Generator().manual_seed(2)), w, dense)


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("panels", [False, True])
def test_bfloat16_tiles_round_x_and_the_weight_once(gguf_type, panels, monkeypatch):
    """BLOCK_TILES_BF16: x and each tile rounded to bfloat16, the products summed in float32,
    each output rounded once: a bfloat16 matmul of the rounded operands, tile by tile."""
    n, k = 150, 256
    w = PackedWeight.from_gguf(random_raw(gguf_type, n, k, 7), gguf_type, (n, k))
    dense = dequantized(w)
    if panels:
        monkeypatch.setattr(quantized_panel_numba, "GROUP_PANELS_RUN", True)
        w.store_as_panels()
    monkeypatch.setattr(quantized_tiles, "TILE_ELEMENTS", 64 * k)  # ragged tiles
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(3))
    got = quantized_tiles.tiled_linear(x, w, torch.bfloat16)
    expect = (x.bfloat16().float() @ dense.bfloat16().float().T)
    # float32 sums of the same products (another order), then one bfloat16 rounding
    torch.testing.assert_close(got, expect, rtol=2 ** -8, atol=1e-5 * expect.abs().max().item())
    assert not torch.equal(got, x @ dense.T)  # it did round


def test_a_bfloat16_gguf_model_prefills_on_bfloat16_tiles(tiny_gguf_factory):
    """quantization="gguf" with dtype="bfloat16" on a CPU that multiplies bfloat16 natively:
    every integer weight's many-row kernel is the bfloat16 tiles (few rows unchanged), the KV
    cache stays float32 (as the file's other weights); float32: the float32 tiles."""
    from mrv2 import LLM, SamplingParams
    from mrv2.models.layers.cpu_linear import computes_natively
    from mrv2.models.layers.linear_plan import LinearKernel

    path = tiny_gguf_factory("llama", "Q8_0")
    prompt = [{"prompt_token_ids": list(range(5, 70))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kernels, tokens = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), quantization="gguf", dtype=dtype, max_model_len=128)
        worker = llm.llm_engine.engine_core.executor.worker
        packed = worker._fast_paths.packed
        kernels[dtype] = {w.plan.many for w in packed.all_weights()
                          if w.layout in ("u4", "i8")}
        assert worker.runner.kv_caches[0].dtype == torch.float32
        tokens[dtype] = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
    assert kernels["float32"] == {LinearKernel.BLOCK_TILES}
    native = computes_natively(torch.bfloat16)
    assert kernels["bfloat16"] == {LinearKernel.BLOCK_TILES_BF16 if native
                                   else LinearKernel.BLOCK_TILES}
    assert len(tokens["bfloat16"]) == 4
