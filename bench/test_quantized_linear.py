"""Linears on GGUF-quantized weights as stored vs float32 F.linear (same run, 2 threads).

SmolLM2-135M shapes (hidden 576, kv 192, intermediate 1536 (gate/up fused: 3072 rows), tied LM
head 49152 x 576) at 1 and 8 (decode: the GEMV) and 32 (batched decode: tiled) rows of x, for
Q4_1 (the built-in file's layers), Q8_0 (its embedding / LM head) and BF16 (a 16-bit GGUF
file's weights; F16 runs the same kernel with another widening). `quantized_linear` runs the
numba GEMV up to MAX_QUANTIZED_GEMV_ROWS rows and the dequantize-tile + torch.mm path beyond (the
weight's plan, linear_plan.py); its GEMV on Q4_1 / Q8_0 blocks runs three times, on float32 x
("quantized_linear"), on x rounded to int16 per 32 inputs ("quantized_linear_int16x", the
default where numba compiles AVX2: the group panels where they run) and to int8
("quantized_linear_int8x", opt-in), each on the plan a weight made with that x format gets,
checked against its derived bound. BF16 from MIN_NATIVE_HALF_ROWS rows on a CPU with bfloat16
matrix units runs on them (cpu_linear.native_16bit_linear, within its rounding bound).
extra_info: the weight bytes each call reads (packed for quantized_linear, float32 for F.linear),
the effective GB/s at the median and the kernel that ran (path).
Random valid blocks (tests/models/test_quantized.py's generator, seed 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mrv2.models.layers import linear_plan, quantized_numba
from mrv2.models.layers.linear_plan import MAX_QUANTIZED_GEMV_ROWS, LinearKernel
from mrv2.models.layers.quantized import PackedWeight, quantized_linear
from mrv2.models.layers.quantized_int8_numba import X86_INT8_DOTS

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "models"))
from test_quantized import random_raw  # noqa: E402
from test_cpu_linear import bf16_matrix_unit_bound  # noqa: E402
from test_quantized_int8_numba import integer_activation_bound  # noqa: E402
from linear_plan_helpers import replan  # noqa: E402

SHAPES = {"q_o_576x576": (576, 576), "k_v_192x576": (192, 576), "gate_up_3072x576": (3072, 576),
          "down_576x1536": (576, 1536), "lm_head_49152x576": (49152, 576)}


pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py


_WEIGHTS: dict[tuple[str, str], tuple[PackedWeight, torch.Tensor]] = {}


def weights(gguf_type: str, shape_name: str) -> tuple[PackedWeight, torch.Tensor]:
    key = (gguf_type, shape_name)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # keep one float32 LM head resident at a time
        n, k = SHAPES[shape_name]
        w = PackedWeight.from_gguf(random_raw(gguf_type, n, k, seed=0), gguf_type, (n, k))
        _WEIGHTS[key] = (w, w.dequantize_rows(torch.arange(w.out_features)))
    return _WEIGHTS[key]


# The kernels other than the GEMVs, as extra_info's path names them.
PATHS = {LinearKernel.NATIVE_16BIT: "native", LinearKernel.BLOCK_TILES: "tiled",
         LinearKernel.HALF_PANELS: "panels", LinearKernel.GROUP_PANELS: "group_panels",
         LinearKernel.HALF_PAIRS: "pairs"}
# impl -> (x format, its levels)
INTEGER_X = {"quantized_linear_int16x": (quantized_numba.X_INT16, 32767),
             "quantized_linear_int8x": (quantized_numba.X_INT8, 127)}


@pytest.mark.parametrize("impl", ["quantized_linear", *INTEGER_X, "f_linear"])
@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "BF16"])
def test_quantized_linear(benchmark, monkeypatch, gguf_type, shape_name, rows, impl):
    integer_x = impl in INTEGER_X
    if integer_x and (gguf_type == "BF16" or rows > MAX_QUANTIZED_GEMV_ROWS):
        pytest.skip("x stays float32 for 16-bit weights and on the tiled path")
    if integer_x and not X86_INT8_DOTS:
        pytest.skip("integer x is taken where numba compiles AVX2")
    x_format, levels = INTEGER_X.get(impl, (quantized_numba.X_FLOAT32, 0))
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", x_format)
    qw, wf = weights(gguf_type, shape_name)
    replan(monkeypatch, qw)  # as made with this x format (the weights are shared)
    benchmark.group = f"quantized-linear-{gguf_type}-{shape_name}-{rows}rows"
    x = torch.randn(rows, qw.in_features, generator=torch.Generator().manual_seed(1))
    expect = F.linear(x, wf)
    got = quantized_linear(x, qw)
    kernel = qw.plan.kernel_for(rows)
    native = kernel is LinearKernel.NATIVE_16BIT
    if native:  # x and the outputs rounded to bfloat16
        assert ((got.double() - expect.double()).abs() <= bf16_matrix_unit_bound(x, wf)).all()
    elif integer_x:
        slack = 1e-5 * (x.abs() @ wf.abs().T)
        assert ((got - expect).abs() <= integer_activation_bound(x, wf, levels) + slack).all()
    else:
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5 * expect.abs().max().item())
    if impl != "f_linear":
        nbytes = qw.nbytes
        benchmark(quantized_linear, x, qw)
    else:
        nbytes = wf.numel() * 4
        benchmark(F.linear, x, wf)
    if benchmark.disabled:  # the suite's untimed pass: the correctness check above is all
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        gguf_type=gguf_type, shape=SHAPES[shape_name], rows=rows, threads=2, seed=0,
        weight_bytes=nbytes, effective_gb_s=round(nbytes / median / 1e9, 2),
        path="torch" if impl == "f_linear" else PATHS.get(kernel, "gemv"))
