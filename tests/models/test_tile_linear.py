"""tile_linear: the AMX kernel against oneDNN's linear on the same packed weight, and the parts
that run on any CPU (the layout reference, the tile configurations, the output rounding)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from mrv2.models.layers import cpu_linear, tile_linear
from mrv2.models.layers.vector_ir import half_bits

amx = pytest.mark.skipif(not tile_linear.usable(), reason="this CPU has no AMX tiles")

# SmolLM2-135M's projections (qkv, o, gate_up, down) and its tied LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def test_tiles_of_is_the_blocked_layout():
    n, k = 64, 96
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    tiles = tile_linear.tiles_of(w)
    assert tiles.shape == (n // 32, k // 32, 16, 64)
    for nb, kb, pair, col in [(0, 0, 0, 0), (1, 2, 15, 63), (0, 1, 3, 17), (1, 0, 7, 40)]:
        # a block row holds, for each of its 32 outputs, a pair of consecutive inputs
        out, first = nb * 32 + col // 2, kb * 32 + pair * 2 + col % 2
        assert tiles[nb, kb, pair, col] == w[out, first]


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 50, 64])
def test_configurations_shape_each_pass(rows):
    configs = tile_linear._configurations(rows)
    assert configs.shape == (2, 64) and (configs[:, 0] == 1).all()
    full_rows, tail_rows = configs[:, 48:56], configs[:, 16:32].view(np.uint16)
    assert list(full_rows[0]) == [16] * 8 and list(tail_rows[0]) == [64] * 8
    tail = rows % 32
    low, high = (min(tail, 16), max(tail - 16, 0))
    for t, expected in zip(range(8), [low, low, high, high, low, high, 16, 16]):
        assert configs[1, 48 + t] == expected
        assert tail_rows[1, t] == (64 if expected else 0)  # unused: 0 rows, 0 bytes


def test_store_rounded_rounds_as_torch():
    special = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 1e-40, -3e-39, 3.4e38, 1.00390625,
                        1.01171875], dtype=np.float32)  # ties to even both ways, denormals
    rng = np.random.default_rng(0)
    values = np.concatenate([special, rng.standard_normal(22).astype(np.float32)])
    values = values.reshape(1, 32)
    out = np.empty((1, 32), np.uint16)
    tile_linear.store_rounded(values.view(np.uint32), 1, out, 0, 0)
    expected = half_bits(torch.from_numpy(values).bfloat16())
    np.testing.assert_array_equal(out, expected)
    nan = np.full((1, 32), np.nan, np.float32)
    tile_linear.store_rounded(nan.view(np.uint32), 1, out, 0, 0)
    assert torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).isnan().all()


def test_weight_tiles_none_where_the_kernel_cannot_read():
    assert tile_linear._packs_as_tiles(100, 64) is False  # outputs not a multiple of 32
    assert tile_linear._packs_as_tiles(64, 48) is False  # inputs not a multiple of 32


@amx
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_weight_tiles_views_onednns_packing(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    tiles = tile_linear.weight_tiles(packed)
    assert tiles is not None and tile_linear.weight_tiles(packed) is tiles  # kept
    np.testing.assert_array_equal(tiles, half_bits(tile_linear.tiles_of(w)))


@amx
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32])
def test_tile_linear_is_onednns_linear_up_to_32_rows(shape, rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, shape[1], generator=gen).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    out = cpu_linear.few_rows_linear(x, tile_linear.weight_tiles(packed))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    torch.testing.assert_close(out, _onednn(x, packed), rtol=0, atol=0)


@amx
@pytest.mark.parametrize("rows", [33, 47, 64])
def test_tile_linear_beyond_32_rows_within_summation_and_one_rounding(rows):
    """oneDNN splits K beyond 32 rows (its float32 partial sums added after), this kernel sums
    all of K in its tiles: the float32 sums differ by at most two summations' error (K eps
    each, of the sum of |products|), the outputs by that and one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    out = cpu_linear.few_rows_linear(x, tile_linear.weight_tiles(packed)).float()
    reference = _onednn(x, packed).float()
    magnitude = x.float().abs() @ w.float().abs().T
    bound = (torch.finfo(torch.bfloat16).eps * reference.abs()
             + 2 * 576 * torch.finfo(torch.float32).eps * magnitude)
    assert ((out - reference).abs() <= bound).all()
    # and each 32-row pass is oneDNN's result for those rows alone
    torch.testing.assert_close(out[:32], _onednn(x[:32].contiguous(), packed).float(),
                               rtol=0, atol=0)


@amx
def test_weight_tiles_keep_the_packed_weight_alive():
    w = torch.randn(64, 64).bfloat16()
    tiles = tile_linear.weight_tiles(torch.ops.mkldnn._reorder_linear_weight(w))
    gc.collect()
    np.testing.assert_array_equal(tiles, half_bits(tile_linear.tiles_of(w)))


@amx
def test_tile_linear_writes_into_out_and_takes_no_rows():
    w = torch.randn(64, 64).bfloat16()
    tiles = tile_linear.weight_tiles(torch.ops.mkldnn._reorder_linear_weight(w))
    out = torch.full((3, 64), 7.0, dtype=torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    assert cpu_linear.few_rows_linear(x, tiles, out) is out
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    assert cpu_linear.few_rows_linear(x[:0], tiles).shape == (0, 64)
