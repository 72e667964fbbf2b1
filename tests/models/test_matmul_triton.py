"""matmul_triton (batch-invariant mode's linears on CUDA), under the Triton interpreter:
x @ w^T (+ bias) as torch computes it, and a row's result bit-identical alone, among any
number of other rows and at any place in the batch (one tile shape for every row count)."""

from __future__ import annotations

import pytest
import torch

from mrv2 import platform
from mrv2.models.layers import matmul_triton


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(dtype, atol, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 80, generator=gen).to(dtype)  # 70 rows, 96 outputs: partial tiles
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    with platform.triton_interpreter():
        out = matmul_triton.invariant_linear(x, w, b)
        logits = matmul_triton.invariant_linear(x[:3], w, out_dtype=torch.float32)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert out.dtype == dtype and logits.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(logits, x[:3].float() @ w.float().T, atol=atol, rtol=1e-3)


@pytest.mark.usefixtures("row_invariant_interpreter_dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(72, 100, generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype)
    row = torch.randn(1, 100, generator=gen).to(dtype)
    with platform.triton_interpreter():
        alone = matmul_triton.invariant_linear(row, w, b)
        for m in (2, 9, 63, 64, 65, 131):
            for place in (0, m // 2, m - 1):
                x = torch.randn(m, 100, generator=gen).to(dtype)
                x[place] = row[0]
                out = matmul_triton.invariant_linear(x, w, b)
                assert torch.equal(out[place], alone[0]), (m, place)


def test_3d_inputs_and_refusals():
    w = torch.randn(8, 16)
    with platform.triton_interpreter():
        assert matmul_triton.invariant_linear(torch.randn(2, 3, 16), w).shape == (2, 3, 8)
        assert matmul_triton.invariant_linear(torch.randn(0, 16), w).shape == (0, 8)
        with pytest.raises(ValueError, match="one dtype"):
            matmul_triton.invariant_linear(torch.randn(2, 16).half(), w)
        with pytest.raises(ValueError, match="does not fit"):
            matmul_triton.invariant_linear(torch.randn(2, 15), w)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_on_cuda(dtype):
    """Compiled: close to cuBLAS, and a row bit-identical at every row count (where cuBLAS's
    choice of algorithm by shape need not be)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(4096, 2048, generator=gen, device="cuda").to(dtype)
    row = torch.randn(1, 2048, generator=gen, device="cuda").to(dtype)
    alone = matmul_triton.invariant_linear(row, w)
    torch.testing.assert_close(alone.float(), (row.float() @ w.float().T),
                               atol=0.5 if dtype != torch.float32 else 1e-3, rtol=2e-2)
    for m in (2, 15, 64, 257, 1024):
        x = torch.randn(m, 2048, generator=gen, device="cuda").to(dtype)
        x[m // 2] = row[0]
        assert torch.equal(matmul_triton.invariant_linear(x, w)[m // 2], alone[0]), m
