"""16-bit GGUF linears (F16) on a CPU without float16 matrix instructions: the panel kernel
(half_panel_linear, quantized_linear's path from 2 rows where it runs) against the path it
replaced, in the same run: the GEMV on the rows up to MAX_QUANTIZED_GEMV_ROWS rows, float32
tiles and torch.mm beyond ("rows": the plan linear_plan.plan_for makes where the panel kernel
does not run).

Shapes of W2 (hidden 1024, kv 512, intermediate 2816: qkv 2048 x 1024, gate/up 5632 x 1024,
down 1024 x 2816) at 2, 8, 32 (batched decode) and 128 (prefill) rows, 2 threads, random
float16 weights (seed 0). extra_info: GFLOP/s at the median. Both paths are checked against the
exact float32 bound (K roundings of the sum of the products' magnitudes) first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mrv2.models.layers import half_panel_linear, quantized
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "models"))
from linear_plan_helpers import replan  # noqa: E402

SHAPES = {"qkv_2048x1024": (2048, 1024), "gate_up_5632x1024": (5632, 1024),
          "down_1024x2816": (1024, 2816)}

pytestmark = [pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
              pytest.mark.skipif(not half_panel_linear.panels_run_here(),
                                 reason="the panel kernel runs where the CPU has AVX-512")]

_WEIGHTS: dict[str, tuple[PackedWeight, torch.Tensor]] = {}


def _weight(shape_name: str) -> tuple[PackedWeight, torch.Tensor]:
    if shape_name not in _WEIGHTS:
        n, k = SHAPES[shape_name]
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).half()
        raw = w.view(torch.int16).numpy().view(np.uint8)
        _WEIGHTS[shape_name] = (PackedWeight.from_gguf(raw, "F16", (n, k)), w)
    return _WEIGHTS[shape_name]


@pytest.mark.parametrize("impl", ["panels", "rows"])
@pytest.mark.parametrize("rows", [2, 8, 32, 128])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_half_panel_linear(benchmark, monkeypatch, shape_name, rows, impl):
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)
    if impl == "rows":
        monkeypatch.setattr(half_panel_linear, "panels_run_here", lambda: False)
    qw, w = _weight(shape_name)
    replan(monkeypatch, qw)  # as made under the patches above (the weights are shared)
    assert (qw.plan.kernel_for(rows) is LinearKernel.HALF_PANELS) == (impl == "panels")
    benchmark.group = f"half-panel-linear-F16-{shape_name}-{rows}rows"
    x = torch.randn(rows, qw.in_features, generator=torch.Generator().manual_seed(1))
    got = quantized_linear(x, qw)
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * qw.in_features * 2.0 ** -24
    assert ((got.double() - exact).abs() <= bound).all()
    benchmark(quantized_linear, x, qw)
    if benchmark.disabled:  # the suite's untimed pass: the check above is all
        return
    n, k = SHAPES[shape_name]
    benchmark.extra_info.update(shape=(n, k), rows=rows, threads=2, seed=0,
                                gflop_s=round(2 * n * k * rows / benchmark.stats.stats.median
                                              / 1e9, 1))
