"""Q8_0 ("i8") and Q4_0 ("u4") linears with int16 x on AVX-512: the group panel kernel
(quantized_panel_numba, the path `quantized_linear` and the decode stack take for integer
blocks where it runs) against the GEMV on the rows it replaced ("rows": `takes_group_panels`
turned off), in the same run; the two types' panel rows side by side say what a 4-bit weight
costs against a byte.

Shapes of W1 (bench/e2e_workload.py: hidden 512, kv 256, intermediate 1408, vocab 16000: qkv
1024 x 512, gate/up 2816 x 512, down 512 x 1408, LM head 16000 x 512) at 1 (decode), 8 and 32
(batched decode) rows, 2 threads, random valid blocks (tests/models/test_quantized.py's
generator, seed 0). Both paths are checked against the int16 format's bound first (the same
integer sums; float32 order). extra_info: GMAC/s at the median.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mrv2.models.layers import quantized, quantized_numba
from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.quantized import QuantizedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "models"))
from test_quantized import random_raw  # noqa: E402
from test_quantized_int8_numba import integer_activation_bound  # noqa: E402

SHAPES = {"qkv_1024x512": (1024, 512), "gate_up_2816x512": (2816, 512),
          "down_512x1408": (512, 1408), "lm_head_16000x512": (16000, 512)}

pytestmark = [pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
              pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                 reason="the group panel kernel runs where the CPU has AVX-512")]

_WEIGHTS: dict[tuple[str, str], tuple[QuantizedWeight, torch.Tensor]] = {}


def _weight(gguf_type: str, shape_name: str) -> tuple[QuantizedWeight, torch.Tensor]:
    if (gguf_type, shape_name) not in _WEIGHTS:
        n, k = SHAPES[shape_name]
        w = QuantizedWeight.from_gguf(random_raw(gguf_type, n, k, seed=0), gguf_type, (n, k))
        _WEIGHTS[gguf_type, shape_name] = (w, w.dequantize())
    return _WEIGHTS[gguf_type, shape_name]


@pytest.mark.parametrize("impl", ["panels", "rows"])
@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0"])
def test_group_panel_linear(benchmark, monkeypatch, gguf_type, shape_name, rows, impl):
    monkeypatch.setattr(quantized, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    if impl == "rows":
        monkeypatch.setattr(quantized, "takes_group_panels", lambda weight: False)
    qw, w = _weight(gguf_type, shape_name)
    assert impl == "rows" or quantized.takes_group_panels(qw)
    benchmark.group = f"group-panel-linear-{gguf_type}-{shape_name}-{rows}rows"
    x = torch.randn(rows, qw.in_features, generator=torch.Generator().manual_seed(1))
    got = quantized_linear(x, qw)
    exact = x.double() @ w.double().T
    slack = 1e-5 * (x.double().abs() @ w.double().abs().T)  # float32 sums
    bound = integer_activation_bound(x, w, 32767) + slack
    assert ((got.double() - exact).abs() <= bound).all()
    benchmark(quantized_linear, x, qw)
    if benchmark.disabled:  # the suite's untimed pass: the check above is all
        return
    n, k = SHAPES[shape_name]
    benchmark.extra_info.update(gguf_type=gguf_type, shape=(n, k), rows=rows, threads=2, seed=0,
                                gmac_s=round(n * k * rows / benchmark.stats.stats.median / 1e9,
                                             1))
