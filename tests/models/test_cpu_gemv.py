"""The CPU GEMV kernel against F.linear, and the cases that must fall back to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import cpu_gemv


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dim, in_dim", [(1, 7), (64, 64), (130, 96), (257, 33)])
@torch.no_grad()
def test_matches_f_linear(rows, out_dim, in_dim):
    gen = torch.Generator().manual_seed(rows * 1000 + out_dim)
    x = torch.randn(rows, in_dim, generator=gen)
    w = torch.randn(out_dim, in_dim, generator=gen)
    b = torch.randn(out_dim, generator=gen)
    assert cpu_gemv._use_gemv(x, w)
    torch.testing.assert_close(cpu_gemv.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_gemv.linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-5)


@torch.no_grad()
def test_non_contiguous_x_is_read_correctly():
    x = torch.randn(8, 3).t()  # [3, 8], strided
    w = torch.randn(16, 8)
    torch.testing.assert_close(cpu_gemv.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_other_shapes_and_dtypes_fall_back():
    w = torch.randn(16, 8)
    with torch.no_grad():
        assert not cpu_gemv._use_gemv(torch.randn(cpu_gemv.MAX_GEMV_ROWS + 1, 8), w)
        assert not cpu_gemv._use_gemv(torch.randn(0, 8), w)
        assert not cpu_gemv._use_gemv(torch.randn(2, 2, 8), w)
        assert not cpu_gemv._use_gemv(torch.randn(2, 8).double(), w.double())
        assert not cpu_gemv._use_gemv(torch.randn(2, 8), torch.randn(8, 16).t())
    # With autograd on, F.linear keeps the graph.
    x = torch.randn(2, 8, requires_grad=True)
    assert not cpu_gemv._use_gemv(x, w)
    cpu_gemv.linear(x, w).sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        big = torch.randn(6, 8)
        torch.testing.assert_close(cpu_gemv.linear(big, w), F.linear(big, w))
