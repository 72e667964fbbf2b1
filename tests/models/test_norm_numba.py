"""The RMSNorm numba twin against the torch formulation, with and without the residual."""

from __future__ import annotations

import pytest
import torch

from mrv2.models.layers import norm_numba
from mrv2.models.layers.numba_rows import SERIAL_MAX_ROWS

# Serial sizes, then the parallel row-chunk form (a partial last chunk included).
ROWS = [1, 7, SERIAL_MAX_ROWS, SERIAL_MAX_ROWS + 1, 1000]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rms_reference(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", ROWS)
@torch.no_grad()
def test_rms_norm_with_and_without_residual(rows):
    g = _gen(rows)
    x, residual = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(norm_numba.rms_norm(x, weight, 1e-5),
                               _rms_reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    out, summed = norm_numba.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, _rms_reference(x + residual, weight, 1e-5), rtol=1e-5,
                               atol=1e-5)
