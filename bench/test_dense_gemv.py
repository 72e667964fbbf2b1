"""The two GEMVs on a 16-bit weight (layers/dense_gemv_numba.py) over a whole decode step's
weights: gemv_half (a weight row at a time, in memory order) against gemv_half_pairs (pairs of
weight rows by blocks of 4 rows of x), same run, 2 threads.

The weights: the W1 model's shapes (8 layers of qkv 1024x512, o 512x512, gate_up 2816x512,
down 512x1408, and a 16000x512 LM head; float16, 64 MB), more than the caches hold, so each
pass reads them from DRAM as a decode step does; one timed call multiplies every one of them.
linear_plan.MIN_HALF_PAIRS_ROWS is where the pairs start to win (bench/README.md has the
figures); at 1 row they lose to gemv_half's single stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.models.layers.dense_gemv_numba import gemv_half, gemv_half_pairs

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(16000, 512)]
KERNELS = {"gemv_half": gemv_half, "gemv_half_pairs": gemv_half_pairs}

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py

_WEIGHTS: list[np.ndarray] = []


def _weights() -> list[np.ndarray]:
    if not _WEIGHTS:
        g = torch.Generator().manual_seed(0)
        _WEIGHTS.extend((torch.randn(n, k, generator=g) * 0.05).half().view(torch.int16).numpy()
                        for n, k in SHAPES)
    return _WEIGHTS


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("rows", [1, 4, 8, 32])
def test_half_gemv_over_a_decode_steps_weights(benchmark, kernel, rows):
    weights = _weights()
    rng = np.random.default_rng(rows)
    xs = {k: rng.standard_normal((rows, k)).astype(np.float32) for k in {k for _, k in SHAPES}}
    outs = [np.empty((rows, w.shape[0]), np.float32) for w in weights]
    run = KERNELS[kernel]

    def step():
        for w, out in zip(weights, outs):
            run(xs[w.shape[1]], w, False, out)

    step()
    # Both kernels give every output within float32 summation error of the other's.
    other = KERNELS["gemv_half" if kernel != "gemv_half" else "gemv_half_pairs"]
    for w, out in zip(weights[:4], outs[:4]):
        check = np.empty_like(out)
        other(xs[w.shape[1]], w, False, check)
        np.testing.assert_allclose(out, check, rtol=1e-4, atol=1e-4)
    benchmark.group = f"dense-gemv-w1-step-{rows}rows"
    benchmark(step)
    if not benchmark.disabled:
        benchmark.extra_info.update(rows=rows, threads=2, weight_bytes=sum(w.nbytes
                                                                          for w in weights))
