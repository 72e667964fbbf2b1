"""The fused CPU kernels against the torch formulations they replace, with strided inputs as the
model passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import cpu_fused
from mrv2.models.layers.rotary import rotate_half

# Serial sizes, then the parallel row-chunk form (a partial last chunk included).
ROWS = [1, 7, cpu_fused.MAX_ROWS, cpu_fused.MAX_ROWS + 1, 1000]


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
    torch.testing.assert_close(cpu_fused.rms_norm(x, weight, 1e-5),
                               _rms_reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    out, summed = cpu_fused.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, _rms_reference(x + residual, weight, 1e-5), rtol=1e-5,
                               atol=1e-5)


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
    torch.testing.assert_close(cpu_fused.rotary(q, cos, sin, head_dim),
                               expected.reshape(rows, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@torch.no_grad()
def test_silu_and_mul(rows):
    gate_up = torch.randn(rows, 2 * 40, generator=_gen(rows)) * 8  # large |x|: exp overflow
    gate, up = gate_up.split(40, -1)
    torch.testing.assert_close(cpu_fused.silu_and_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)


def test_parallel_form_is_taken_beyond_max_rows(monkeypatch):
    calls = []
    real = cpu_fused._add_rms_norm_rows

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_fused, "_add_rms_norm_rows", counted)
    weight = torch.ones(8)
    with torch.no_grad():
        cpu_fused.rms_norm(torch.ones(cpu_fused.MAX_ROWS, 8), weight, 1e-5)
        cpu_fused.rms_norm(torch.ones(cpu_fused.MAX_ROWS + 1, 8), weight, 1e-5)
    assert calls == [cpu_fused.MAX_ROWS + 1]


def test_supported_only_for_float32_cpu_inference():
    x = torch.zeros(2, 4)
    with torch.no_grad():
        assert cpu_fused.supported(x, x)
        assert not cpu_fused.supported(x, x.double())
        assert not cpu_fused.supported(torch.zeros(2, 2, 4))
        assert cpu_fused.supported(torch.zeros(4096, 4))  # prefills: the parallel form
    assert not cpu_fused.supported(x)  # autograd on: the torch path keeps the graph
