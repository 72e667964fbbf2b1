"""Q8_0 ("i8") and Q4_0 ("u4") linears with int16 x on AVX-512: the group panel kernel
(quantized_panel_numba, the path `quantized_linear` and the decode stack take for integer
blocks where it runs) against the GEMV on the rows it replaced ("rows": the weight's plan's
few-row kernel set to the GEMV), in the same run; the two types' panel rows side by side say
what a 4-bit weight costs against a byte. `test_q6_k_head_forms`: a Q6_K LM head's "u6" panels
(6.5 bits a weight) against its "i8" ones (a byte and a float32 scale per 16), one row, with the
caches warm and right after a read of 64 MB (as in a decode step, which streams the whole
model).

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

import numpy as np

from mrv2.models.layers import linear_plan, quantized_numba
from mrv2.models.layers import quantized_panel_layout as layout
from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.linear_plan import LinearKernel
from mrv2.models.layers.quantized import PackedWeight, quantized_linear

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "models"))
from test_quantized import random_raw  # noqa: E402
from test_quantized_int8_numba import integer_activation_bound  # noqa: E402
from linear_plan_helpers import replan, set_plan  # noqa: E402

SHAPES = {"qkv_1024x512": (1024, 512), "gate_up_2816x512": (2816, 512),
          "down_512x1408": (512, 1408), "lm_head_16000x512": (16000, 512)}

pytestmark = [pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
              pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                 reason="the group panel kernel runs where the CPU has AVX-512")]

_WEIGHTS: dict[tuple[str, str], tuple[PackedWeight, torch.Tensor]] = {}


def _weight(gguf_type: str, shape_name: str) -> tuple[PackedWeight, torch.Tensor]:
    if (gguf_type, shape_name) not in _WEIGHTS:
        n, k = SHAPES[shape_name]
        w = PackedWeight.from_gguf(random_raw(gguf_type, n, k, seed=0), gguf_type, (n, k))
        _WEIGHTS[gguf_type, shape_name] = (w, w.dequantize_rows(torch.arange(w.out_features)))
    return _WEIGHTS[gguf_type, shape_name]


@pytest.mark.parametrize("impl", ["panels", "rows"])
@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0"])
def test_group_panel_linear(benchmark, monkeypatch, gguf_type, shape_name, rows, impl):
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", quantized_numba.X_INT16)
    qw, w = _weight(gguf_type, shape_name)
    replan(monkeypatch, qw)  # as made with int16 x (the weights are shared)
    assert qw.plan.kernel_for(rows) is LinearKernel.GROUP_PANELS
    if impl == "rows":
        set_plan(monkeypatch, qw, few=LinearKernel.BLOCK_GEMV)
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


@pytest.mark.parametrize("cache", ["warm", "after_64mb_read"])
@pytest.mark.parametrize("form", ["u6", "i8"])
def test_q6_k_head_forms(benchmark, monkeypatch, form, cache):
    n, k = SHAPES["lm_head_16000x512"]
    qw = PackedWeight.from_gguf(random_raw("Q6_K", n, k, seed=0), "Q6_K", (n, k))
    if form == "i8":
        monkeypatch.setattr(layout, "_super_scales", lambda table, per_super: None)
    panels = layout.group_panels_of(qw.q.numpy(), qw.scales.numpy(), None)
    assert panels[0].shape[2] == (layout.U6_PAIR_BYTES if form == "u6" else 128)
    benchmark.group = f"group-panel-q6_k-head-{cache}"
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, n), np.float32)
    other = torch.ones(16 << 20)  # 64 MB

    def setup() -> None:
        if cache == "after_64mb_read":
            other.sum()

    benchmark.pedantic(panel.group_panel_kernel, args=(x, *panels, False, out), setup=setup,
                       rounds=200, warmup_rounds=2)
    benchmark.extra_info.update(form=form, panel_mb=round(sum(p.nbytes for p in panels) / 1e6,
                                                         2), threads=2)
