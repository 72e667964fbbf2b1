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
    monkeypatch.setattr(quantized_tiles, "HALF_TILE_ELEMENTS", 40 * k)
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
