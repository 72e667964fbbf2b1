"""half_panel_linear: the panel layout against its definition, the kernel against the exact sum
of the same 16-bit weights (float16 and bfloat16, every pass size and a panel cut short), and
quantized_linear's routing of a 16-bit GGUF weight's batched rows to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.models.layers import cpu_linear, half_panel_linear
from mrv2.models.layers.half_panel_linear import PANEL_OUTPUTS, panels_of
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

panel = pytest.mark.skipif(not half_panel_linear.panels_run_here(),
                           reason="the panel kernel runs where the CPU has AVX-512")


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1).to(dtype)


def _assert_float32_sum(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Each output within K float32 roundings of the exact sum of the exact products (each
    rounding bounded by the sum of the products' magnitudes); the widening adds none."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    assert ((out.double() - exact).abs() <= magnitude * x.shape[1] * 2.0 ** -24).all()


def test_panels_hold_64_outputs_per_input_zero_past_the_last():
    n, k = 100, 3
    q = torch.arange(n * k, dtype=torch.int16).reshape(n, k)
    panels = panels_of(q)
    assert panels.shape == (2, k, PANEL_OUTPUTS) and panels.dtype == np.int16
    for block, i, col in [(0, 0, 0), (0, 2, 63), (1, 1, 35), (1, 0, 0)]:
        assert panels[block, i, col] == q[block * 64 + col, i]
    assert not panels[1, :, n - 64:].any()


@panel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])
@pytest.mark.parametrize("n, k", [(128, 64), (100, 96), (576, 1536)])
def test_kernel_is_the_float32_sum(dtype, rows, n, k):
    """Every pass size (1 to 6 rows, and their tails), panels cut short (N = 100)."""
    w = _weight(n, k, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    out = half_panel_linear.half_panel_linear(x, panels_of(w.view(torch.int16)),
                                              dtype == torch.bfloat16, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    _assert_float32_sum(out, x, w)


@panel
def test_fewer_panels_than_threads_and_no_rows():
    w = _weight(64, 32, torch.float16)
    x = torch.randn(3, 32)
    out = np.empty((3, 64), np.float32)
    half_panel_linear.half_panel_kernel(x.numpy(), panels_of(w.view(torch.int16)), False, out)
    _assert_float32_sum(torch.from_numpy(out), x, w)
    empty = half_panel_linear.half_panel_linear(torch.empty(0, 32), panels_of(w.view(torch.int16)),
                                                False, 64)
    assert empty.shape == (0, 64)


@panel
def test_inf_and_nan_weights_propagate():
    w = _weight(64, 16, torch.float16)
    w[3, 5], w[7, 0] = float("inf"), float("nan")
    out = half_panel_linear.half_panel_linear(torch.ones(2, 16), panels_of(w.view(torch.int16)),
                                              False, 64)
    assert torch.isinf(out[:, 3]).all() and torch.isnan(out[:, 7]).all()
    assert torch.isfinite(out[:, [0, 1, 2, 4, 5, 6]]).all()


@pytest.mark.parametrize("gguf_type", ["F16", "BF16"])
def test_quantized_linear_takes_the_panels_where_they_run(gguf_type, monkeypatch):
    """A 16-bit weight without matrix instructions for its dtype: the panels at every row
    count (made once), float32 sums; elsewhere (the dtype on matrix units,
    which round x, or a CPU without AVX-512) the panels are never made."""
    dtype = torch.float16 if gguf_type == "F16" else torch.bfloat16
    w = _weight(96, 64, dtype)
    qw = PackedWeight.from_gguf(w.view(torch.int16).numpy().view(np.uint8), gguf_type,
                                   (96, 64))
    calls = []
    real = half_panel_linear.half_panel_kernel
    monkeypatch.setattr(half_panel_linear, "half_panel_kernel",
                        lambda *args: calls.append(args[0].shape[0]) or real(*args))
    on_panels = qw.plan.on_panels
    assert on_panels == (not cpu_linear.computes_natively(dtype)
                         and half_panel_linear.panels_run_here())
    for rows in (1, 2, 9, 40):
        x = torch.randn(rows, 64)
        out = quantized_linear(x, qw)
        if qw.plan.kernel_for(rows) in (LinearKernel.HALF_PANELS, LinearKernel.HALF_GEMV):
            _assert_float32_sum(out, x, w)
    if on_panels:
        assert {qw.plan.kernel_for(rows) for rows in (1, 40)} == {LinearKernel.HALF_PANELS}
        assert calls == [1, 2, 9, 40] and qw.panels() is qw.panels()
    else:
        assert calls == [] and qw._panels is None
