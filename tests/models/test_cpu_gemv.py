"""The numba GEMV kernel against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import cpu_gemv


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dim, in_dim", [(1, 7), (64, 64), (130, 96), (257, 33)])
def test_matches_f_linear(rows, out_dim, in_dim):
    gen = torch.Generator().manual_seed(rows * 1000 + out_dim)
    x = torch.randn(rows, in_dim, generator=gen)
    w = torch.randn(out_dim, in_dim, generator=gen)
    b = torch.randn(out_dim, generator=gen)
    torch.testing.assert_close(cpu_gemv.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_gemv.gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_non_contiguous_x_is_read_correctly():
    x = torch.randn(8, 3).t()  # [3, 8], strided
    w = torch.randn(16, 8)
    torch.testing.assert_close(cpu_gemv.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
