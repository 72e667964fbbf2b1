"""amx_ir: one tile product against torch, the stores' strides, and tile numbers that must be
literals (a typing error, raised before any AMX instruction is generated: safe on any CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit
from numba.core.errors import TypingError

from mrv2.models.layers import tile_linear
from mrv2.models.layers.amx_ir import (tile_config, tile_dot_bf16, tile_load, tile_release,
                                       tile_store, tile_zero)
from mrv2.models.layers.vector_ir import half_bits


def _config() -> np.ndarray:
    config = np.zeros(64, np.uint8)
    config[0] = 1
    config[16:32].view(np.uint16)[:3] = 64  # tiles 0-2: 16 rows of 64 bytes
    config[48:51] = 16
    return config


@njit
def _product(config, a, b, c, accumulate):
    tile_config(config)
    if accumulate:
        tile_load(0, c, 0, 128)  # c's first 16 columns; rows 128 bytes apart
    else:
        tile_zero(0)
    tile_load(1, a, 0, 64)
    tile_load(2, b, 0, 64)
    tile_dot_bf16(0, 1, 2)
    tile_store(0, c, 0, 128)
    tile_release()


@pytest.mark.skipif(not tile_linear.usable(), reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("accumulate", [False, True])
def test_tile_product_is_a_matrix_product(accumulate):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).bfloat16()
    b = torch.randn(32, 16, generator=gen).bfloat16()
    # B's K in interleaved pairs: row p holds, for each output, inputs 2p and 2p + 1
    b_pairs = b.reshape(16, 2, 16).permute(0, 2, 1).contiguous()
    c = np.full((16, 32), 0.5, np.float32)
    _product(_config(), half_bits(a), half_bits(b_pairs), c, accumulate)
    expected = (a.float() @ b.float()).numpy() + (0.5 if accumulate else 0.0)
    np.testing.assert_allclose(c[:, :16], expected, rtol=1e-5, atol=1e-5)
    assert (c[:, 16:] == 0.5).all()  # the stride skipped the other half of each row


def test_tile_number_must_be_a_literal():
    @njit
    def zero_tile(t):
        tile_zero(t)

    with pytest.raises(TypingError):
        zero_tile(3)
