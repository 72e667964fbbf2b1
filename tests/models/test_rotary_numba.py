"""The rotary numba twin against rotate-half, on the strided views the model passes."""

from __future__ import annotations

import pytest
import torch

from mrv2.models.layers import rotary_numba
from mrv2.models.layers.numba_rows import SERIAL_MAX_ROWS
from mrv2.models.layers.rotary import rotate_half

# Serial sizes, then the parallel row-chunk form (a partial last chunk included).
ROWS = [1, 7, SERIAL_MAX_ROWS, SERIAL_MAX_ROWS + 1, 1000]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
@torch.no_grad()
def test_rotary_matches_rotate_half(rows):
    g = _gen(rows)
    head_dim, heads = 16, 3
    qkv = torch.randn(rows, heads * head_dim * 2, generator=g)
    q = qkv[:, :heads * head_dim]  # a strided view, as the fused QKV split gives
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x = q.reshape(rows, heads, head_dim)
    expected = (x * cos[:, None]) + (rotate_half(x) * sin[:, None])
    torch.testing.assert_close(rotary_numba.apply_rotary(q, cos, sin, head_dim),
                               expected.reshape(rows, -1), rtol=1e-5, atol=1e-5)
