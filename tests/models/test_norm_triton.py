"""norm_triton (fused residual add + RMSNorm) against norm.py's torch path: interpreted on CPU
tensors (tiny, odd widths, strided rows), compiled on a GPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from mrv2 import platform
from mrv2.models.layers import norm_triton
from mrv2.models.layers.norm import RMSNorm
from tests.models.triton_layer_helpers import (COMPILED_TOL, INTERPRETED_TOL, compiled_variants,
                                               needs_cuda)


def _norm(hidden: int, dtype: torch.dtype, device: str, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(device)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    return norm


def _inputs(rows: int, hidden: int, dtype: torch.dtype, device: str, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x as a strided column slice (rows not contiguous with each other), residual plain."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, hidden + 5, generator=gen).to(device, dtype)
    return wide[:, 2:2 + hidden], torch.randn(rows, hidden, generator=gen).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 24), (3, 37)])
@torch.no_grad()
def test_interpreted_matches_torch(rows: int, hidden: int, dtype: torch.dtype) -> None:
    norm = _norm(hidden, dtype, "cpu", seed=hidden)
    x, residual = _inputs(rows, hidden, dtype, "cpu", seed=rows)
    # The torch path (bf16 on CPU is not numba's; float32 forced off numba by autograd).
    with torch.enable_grad():
        ref_plain, (ref, ref_sum) = norm(x), norm(x, residual)
    with platform.triton_interpreter():
        plain, (out, summed) = norm(x), norm(x, residual)
    tol = INTERPRETED_TOL[dtype]
    assert plain.dtype == out.dtype == summed.dtype == dtype
    torch.testing.assert_close(plain, ref_plain, **tol)
    torch.testing.assert_close(summed, ref_sum, **tol)
    torch.testing.assert_close(out, ref, **tol)
    if dtype == torch.float32:  # no rounding to lose: the sum is exact
        assert torch.equal(summed, ref_sum)


@torch.no_grad()
def test_forward_dispatches_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return norm_triton_rms_norm(*args, **kwargs)

    norm_triton_rms_norm = norm_triton.rms_norm
    monkeypatch.setattr(norm_triton, "rms_norm", spy)
    norm = _norm(8, torch.float32, "cpu", seed=0)
    x, residual = _inputs(2, 8, torch.float32, "cpu", seed=0)
    norm(x, residual)
    assert not calls  # CPU tensors: the numba twin
    with platform.triton_interpreter():
        norm(x, residual)
    assert len(calls) == 1


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_compiled_matches_torch(dtype: torch.dtype) -> None:
    hidden = 576  # SmolLM2-135M: not a power of two
    norm = _norm(hidden, dtype, "cuda", seed=1)
    for rows in (1, 7, 33, 256):
        x, residual = _inputs(rows, hidden, dtype, "cuda", seed=rows)
        with platform.forced_impl(platform.CPU):  # the torch path on CUDA tensors
            ref_plain, (ref, ref_sum) = norm(x), norm(x, residual)
        plain, (out, summed) = norm(x), norm(x, residual)
        assert torch.equal(summed, ref_sum)
        torch.testing.assert_close(plain, ref_plain, **COMPILED_TOL[dtype])
        torch.testing.assert_close(out, ref, **COMPILED_TOL[dtype])
        # The count is process-wide (other tests compile other widths). A single row may get
        # a variant of its own (its view's stride is canonical, so Triton's divisibility
        # specialisation differs: seen on an H200 with Triton 3.6); after that, row counts,
        # which change every step, must not compile new ones.
        if rows == 7:
            first_variants = compiled_variants(norm_triton._add_rms_norm_kernel)
    assert compiled_variants(norm_triton._add_rms_norm_kernel) == first_variants
