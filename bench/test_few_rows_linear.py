"""Bfloat16 linears of decode rows over SmolLM2-135M's 30 layers of weights (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536; 212 MB, distinct per layer, so streamed from DRAM as
in a decode step): this CPU's few-row kernel (cpu_linear.few_rows_view: tile_linear's AMX
kernel, or dot_linear's AVX-512 BF16 one) against oneDNN's inner product on the same packed
weights, in the same run, 2 threads. Skipped on CPUs with neither.

extra_info: the weight bytes a call reads and the effective GB/s at the median. Under
`--benchmark-disable` (CI) each case runs once and checks the kernel against oneDNN.
"""

from __future__ import annotations

import pytest
import torch

from mrv2.models.layers import cpu_linear, dot_linear, tile_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30

pytestmark = [
    pytest.mark.usefixtures("two_threads"),  # bench/conftest.py
    pytest.mark.skipif(not (tile_linear.usable() or dot_linear.runs_here()),
                       reason="this CPU has neither AMX tiles nor AVX-512 BF16"),
]

_PACKED: list = []


def _layers(count: int) -> list[list[torch.Tensor]]:
    if len(_PACKED) < count:
        gen = torch.Generator().manual_seed(0)
        for _ in range(count - len(_PACKED)):
            _PACKED.append([torch.ops.mkldnn._reorder_linear_weight(
                (torch.randn(n, k, generator=gen) * 0.02).bfloat16()) for n, k in SHAPES])
    return _PACKED[:count]


@pytest.mark.parametrize("impl", ["kernel", "onednn"])
@pytest.mark.parametrize("rows", [2, 8, 32, 64])
def test_decode_linears(benchmark, rows, impl):
    layers = _layers(1 if benchmark.disabled else LAYERS)
    xs = [torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
          for _, k in SHAPES]
    if impl == "kernel":
        weights = [[cpu_linear.few_rows_view(p) for p in layer] for layer in layers]

        def run():
            return [cpu_linear.few_rows_linear(x, w) for layer in weights
                    for x, w in zip(xs, layer)]
    else:
        def run():
            return [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                    for layer in layers for x, p in zip(xs, layer)]

    benchmark.group = f"decode-linears-bf16-{rows}-rows"
    outputs = benchmark(run)
    if benchmark.disabled:  # the kernel's result, checked where CI runs it once
        reference = [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                     for x, p in zip(xs, layers[0])]
        for out, ref in zip(outputs, reference):
            assert out.shape == ref.shape
            if tile_linear.usable() and rows <= tile_linear.BLOCK:  # oneDNN's, bit for bit
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
            else:  # another summation order: within a rounding or two of bfloat16
                torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
        return
    weight_bytes = LAYERS * sum(n * k * 2 for n, k in SHAPES)
    benchmark.extra_info["weight_bytes"] = weight_bytes
    benchmark.extra_info["gb_per_s"] = round(weight_bytes / benchmark.stats.stats.median / 1e9, 1)
