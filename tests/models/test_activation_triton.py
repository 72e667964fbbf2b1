"""activation_triton (SiLU- and GeLU(tanh)-and-mul) against activation.py's torch path:
interpreted on CPU tensors (odd widths, strided rows), compiled on a GPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2 import platform
from mrv2.models.layers import activation_triton
from mrv2.models.layers.activation import gelu_tanh_and_mul, silu_and_mul
from tests.models.triton_layer_helpers import (COMPILED_TOL, INTERPRETED_TOL, compiled_variants,
                                               needs_cuda)


def _reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def _gate_up(rows: int, width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[rows, 2 * width] whose rows are strided (a column slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    wide = torch.randn(rows, 2 * width + 3, generator=gen) * 3
    return wide.to(device, dtype)[:, 1:1 + 2 * width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 8), (3, 19)])
@torch.no_grad()
def test_interpreted_matches_torch(rows: int, width: int, dtype: torch.dtype) -> None:
    gate_up = _gate_up(rows, width, dtype, "cpu")
    with platform.triton_interpreter():
        out = silu_and_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    torch.testing.assert_close(out, _reference(gate_up), **INTERPRETED_TOL[dtype])


@torch.no_grad()
def test_more_columns_than_one_block() -> None:
    gate_up = _gate_up(2, activation_triton.COLUMN_BLOCK + 7, torch.float32, "cpu")
    with platform.triton_interpreter():
        out = silu_and_mul(gate_up)
    torch.testing.assert_close(out, _reference(gate_up), **INTERPRETED_TOL[torch.float32])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_compiled_matches_torch(dtype: torch.dtype) -> None:
    for rows in (1, 7, 33, 256):
        gate_up = _gate_up(rows, 1536, dtype, "cuda")  # SmolLM2-135M's intermediate size
        out = silu_and_mul(gate_up)
        torch.testing.assert_close(out, _reference(gate_up), **COMPILED_TOL[dtype])
        # Process-wide count; one row may get its own variant (test_norm_triton.py): from
        # the second row count on it must not grow.
        if rows == 7:
            first_variants = compiled_variants(activation_triton._gated_act_kernel)
    assert compiled_variants(activation_triton._gated_act_kernel) == first_variants


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_gelu_tanh_interpreted_matches_torch(dtype: torch.dtype) -> None:
    """Gemma's gelu_pytorch_tanh, saturated gates included (|x| up to ~10)."""
    gate_up = _gate_up(3, 19, dtype, "cpu")
    with platform.triton_interpreter():
        out = gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.split(19, dim=-1)
    reference = F.gelu(gate, approximate="tanh") * up
    assert out.shape == (3, 19) and out.dtype == dtype
    torch.testing.assert_close(out, reference, **INTERPRETED_TOL[dtype])
