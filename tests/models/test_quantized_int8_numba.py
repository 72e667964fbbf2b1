"""The GEMV on int8 activations (quantized_int8_numba): x's rounding per 32-input block, outputs
within the derived bound for every block type, and the generic integer IR against AVX2's."""

from __future__ import annotations

import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from mrv2.models.layers import quantized_int8_numba, quantized_numba
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quant_formats import FORMATS
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from tests.models.linear_plan_helpers import set_plan

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw, reference  # noqa: E402

BLOCK_TYPES = sorted(name for name, fmt in FORMATS.items() if not fmt.is_16bit)


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[PackedWeight, torch.Tensor]]:
    """Per block type: a [96, 1536] weight and its float32 reference."""
    raws = {t: random_raw(t, 96, 1536, seed=i) for i, t in enumerate(BLOCK_TYPES)}
    return {t: (PackedWeight.from_gguf(raw, t, (96, 1536)), reference(raw, t, 96, 1536))
            for t, raw in raws.items()}


def integer_activation_bound(x: torch.Tensor, ref: torch.Tensor, levels: int = 127
                             ) -> torch.Tensor:
    """[T, N]: sum over 32-input blocks g of d_g / 2 * sum_{k in g} |w_k|, d_g = max |x_g| /
    levels (127: int8, 32767: int16; x rounded so moves each input by at most d_g / 2; the
    integer products are exact)."""
    d = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1) / levels
    return (d / 2) @ ref.double().abs().reshape(ref.shape[0], -1, 32).sum(-1).T


@pytest.mark.parametrize("gguf_type", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_int8_activations_stay_within_the_derived_bound(weights, gguf_type, rows, monkeypatch):
    w, ref = weights[gguf_type]
    set_plan(monkeypatch, w, few=LinearKernel.BLOCK_GEMV, x_format=quantized_numba.X_INT8)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    x[0, 64:96] = 0.0  # an all-zero block quantizes to zeros
    expect = x.double() @ ref.double().T
    error = (quantized_linear(x, w).double() - expect).abs()
    # float32 rounding of d and of the sums, relative to the output's size
    slack = 1e-5 * (x.double().abs() @ ref.double().abs().T)
    assert (error <= integer_activation_bound(x, ref) + slack).all()
    assert error.max() > 10 * slack.max()  # x really went through int8


def test_quantize_rows_rounds_each_block_to_half_a_step():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [1e-3, 1.0, 1e3]).reshape(3, 1)
    x[1, 32:64] = 0.0
    x[2, 70] = -x[2, 64:96].abs().max() * 2  # the block's extreme is negative
    xq, dx = np.empty((3, 96), np.int8), np.empty((3, 3), np.float32)
    quantized_int8_numba.quantize_rows(x.numpy(), xq, dx)
    blocks = x.reshape(3, 3, 32)
    assert torch.equal(torch.from_numpy(dx), blocks.abs().amax(-1) / 127)
    assert np.abs(xq.astype(np.int32)).max() == 127 and xq[2, 70] == -127
    assert not xq[1, 32:64].any() and dx[1, 1] == 0
    back = torch.from_numpy(xq).float().reshape(3, 3, 32) * torch.from_numpy(dx)[..., None]
    assert ((back - blocks).abs() <= torch.from_numpy(dx)[..., None] / 2 * (1 + 1e-5)).all()


def _dots_kernel(dots):
    @numba.njit
    def run(xq, dx, q, scales, mins, xsum, shift, out):
        for r in range(q.shape[0]):
            out[r] = dots(xq, dx, q, scales, mins, xsum, shift, r, 0)[0]
    return run


@pytest.mark.skipif(not quantized_int8_numba.X86_INT8_DOTS, reason="needs AVX2 code generation")
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q6_K"])
def test_generic_integer_ir_equals_the_avx2_intrinsics(weights, gguf_type):
    """The IR a target without AVX2 gets computes the same integer dot products (fast-math may
    order the float scaling differently: equal to float32 rounding)."""
    w, _ = weights[gguf_type]
    packed = w.layout == "u4"
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(5)).numpy()
    xq, dx = np.empty((1, 1536), np.int8), np.empty((1, 48), np.float32)
    quantized_int8_numba.quantize_rows(x, xq, dx)
    q = w.q.view(torch.uint8).numpy() if packed else w.q.numpy()
    shift = 5 if w.group_size == 32 else 4
    mins = w.kernel_mins.numpy()
    xsum = x.reshape(1, -1, 32).sum(-1)[:, :mins.shape[1]]
    outs = []
    for x86 in (True, False):
        out = np.empty(w.out_features, np.float32)
        _dots_kernel(quantized_int8_numba._make_int8_dots(1, packed, x86))(
            xq, dx, q, w.scales.numpy(), mins, xsum, shift, out)
        outs.append(out)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6 * np.abs(outs[0]).max())
