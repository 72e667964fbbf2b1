"""The SiLU-and-mul numba twin against the torch ops, over the range where exp overflows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import activation_numba
from mrv2.models.layers.numba_rows import SERIAL_MAX_ROWS

# Serial sizes, then the parallel row-chunk form (a partial last chunk included).
ROWS = [1, 7, SERIAL_MAX_ROWS, SERIAL_MAX_ROWS + 1, 1000]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
@torch.no_grad()
def test_silu_and_mul(rows):
    gate_up = torch.randn(rows, 2 * 40, generator=_gen(rows)) * 8  # large |x|: exp overflow
    gate, up = gate_up.split(40, -1)
    torch.testing.assert_close(activation_numba.silu_and_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 17, 40])
@torch.no_grad()
def test_silu_and_mul_bf16_is_the_float32_result_rounded_once(rows):
    gate_up = (torch.randn(rows, 2 * 40, generator=_gen(rows)) * 8).to(torch.bfloat16)
    gate_up[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    expected = activation_numba.silu_and_mul(gate_up.float()).to(torch.bfloat16)
    got = activation_numba.silu_and_mul_bf16(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows", ROWS)
@torch.no_grad()
def test_swigluoai_and_mul(rows):
    """gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate on de-interleaved
    gate and up), both clamps reached; the torch form (activation.py) likewise."""
    from mrv2.models.layers.activation import swigluoai_and_mul

    gate_up = torch.randn(rows, 2 * 40, generator=_gen(rows)) * 4
    gate, up = gate_up.split(40, -1)
    gate, up = gate.clamp(max=2.5), up.clamp(-2.5, 2.5)
    expected = (up + 1) * (gate * torch.sigmoid(gate * 1.5))
    torch.testing.assert_close(activation_numba.swigluoai_and_mul(gate_up, 1.5, 2.5), expected,
                               rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # outside the numba twin's conditions: the torch ops
        torch.testing.assert_close(swigluoai_and_mul(gate_up, 1.5, 2.5), expected)
