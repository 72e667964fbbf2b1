"""The GEMV on int16 activations (quantized_int16_numba, the default x format on AVX2): outputs
within the derived bound for every block type and row count (K with and without a whole number
of 8-group scale blocks), on the GEMV and on the group panels where they run, the bound far below
int8's, and the generic integer IR against AVX2's. The default x format: test_linear_plan.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from mrv2.models.layers import quantized_int8_numba, quantized_int16_numba, quantized_numba
from mrv2.models.layers import quantized_panel_numba
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quant_formats import FORMATS
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from tests.models.linear_plan_helpers import set_plan

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw, reference  # noqa: E402
from test_quantized_int8_numba import integer_activation_bound  # noqa: E402

BLOCK_TYPES = sorted(name for name, fmt in FORMATS.items() if not fmt.is_16bit)
INPUTS = (576, 1536)  # 18 groups (two past the last scale block of 8) and 48 (whole blocks)


@pytest.fixture(scope="module")
def weights() -> dict[tuple[str, int], tuple[PackedWeight, torch.Tensor]]:
    """Per block type and K: a [40, K] weight and its float32 reference (K-quants need K a
    multiple of 256: 1536 only)."""
    out = {}
    for i, t in enumerate(BLOCK_TYPES):
        for k in INPUTS:
            if t.endswith("_K") and k % 256:
                continue
            raw = random_raw(t, 40, k, seed=i)
            out[t, k] = (PackedWeight.from_gguf(raw, t, (40, k)), reference(raw, t, 40, k))
    return out


@pytest.mark.skipif(not quantized_int8_numba.X86_INT8_DOTS, reason="int16 x is taken where "
                    "numba compiles AVX2")
@pytest.mark.parametrize("kernel", [
    LinearKernel.BLOCK_GEMV,
    pytest.param(LinearKernel.GROUP_PANELS, marks=pytest.mark.skipif(
        not quantized_panel_numba.GROUP_PANELS_RUN, reason="needs a host with AVX-512 BW"))])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_int16_activations_stay_within_the_derived_bound(weights, rows, kernel, monkeypatch):
    """The GEMV on the blocks and the group panels (int16 x's kernel where they run)."""
    for (gguf_type, k), (w, ref) in weights.items():
        set_plan(monkeypatch, w, few=kernel, x_format=quantized_numba.X_INT16)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        x[0, 64:96] = 0.0  # an all-zero block quantizes to zeros
        x[-1, 100] = 50.0  # an outlier: its block's other inputs get a coarser step
        expect = x.double() @ ref.double().T
        error = (quantized_linear(x, w).double() - expect).abs()
        slack = 1e-6 * (x.double().abs() @ ref.double().abs().T)  # float32 rounding
        bound = integer_activation_bound(x, ref, 32767)
        assert (error <= bound + slack).all(), (gguf_type, k)
        # 256x below int8's bound, and the rounding is really int16's (not float32 x's)
        assert (bound * 200 < integer_activation_bound(x, ref, 127)).all()
        assert error.max() > 10 * (1e-7 * expect.abs().max()), (gguf_type, k)


def test_quantize_rows_to_int16_rounds_each_block_to_half_a_step():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    x[1, :32] = 0.0
    xq, dx = np.empty((2, 64), np.int16), np.empty((2, 2), np.float32)
    quantized_int8_numba.quantize_rows(x.numpy(), xq, dx)
    blocks = x.reshape(2, 2, 32)
    assert torch.equal(torch.from_numpy(dx), blocks.abs().amax(-1) / 32767)
    assert np.abs(xq.astype(np.int32)).max() == 32767 and not xq[1, :32].any()
    back = torch.from_numpy(xq).float().reshape(2, 2, 32) * torch.from_numpy(dx)[..., None]
    assert ((back - blocks).abs() <= torch.from_numpy(dx)[..., None] / 2 * (1 + 1e-5)).all()


def _dots_kernel(dots):
    @numba.njit
    def run(xq, dx, q, scales, mins, xsum, out):
        for r in range(q.shape[0]):
            out[r] = dots(xq, dx, q, scales, mins, xsum, r, 0)[0]
    return run


@pytest.mark.skipif(not quantized_int8_numba.X86_INT8_DOTS,
                    reason="needs AVX2 code generation")
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q6_K"])
def test_generic_integer_ir_equals_the_avx2_intrinsics(weights, gguf_type):
    """The IR a target without AVX2 gets computes the same integer dot products (fast-math may
    order the float scaling differently: equal to float32 rounding)."""
    w, _ = weights[gguf_type, 1536]
    layout = "u4" if w.layout == "u4" else "i8" if w.group_size == 32 else "i8/16"
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(5)).numpy()
    xq, dx = np.empty((1, 1536), np.int16), np.empty((1, 48), np.float32)
    quantized_int8_numba.quantize_rows(x, xq, dx)
    q = w.q.view(torch.uint8).numpy() if w.layout == "u4" else w.q.numpy()
    mins = w.kernel_mins.numpy()
    xsum = x.reshape(1, -1, 32).sum(-1)[:, :mins.shape[1]]
    outs = []
    for x86 in (True, False):
        out = np.empty(w.out_features, np.float32)
        _dots_kernel(quantized_int16_numba._make_int16_dots(1, layout, x86))(
            xq, dx, q, w.scales.numpy(), mins, xsum, out)
        outs.append(out)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6 * np.abs(outs[0]).max())
