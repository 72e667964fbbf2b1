"""What a decode step's host work costs right after its kernels streamed the weights.

A batch-1 decode step reads every weight once (tens of MB for a small model), which evicts the
interpreter's and torch's own working set from the caches; the step's Python that follows
(logits indexing, sampling, state updates) then runs from DRAM. This bench times one small
torch op (an index and an add on a [1, 512] tensor, as the runner does for the sampled rows)
with the caches warm, and right after a kernel read `STREAM_MB` of weights (the setup, not
timed): same run, same op, compare the two.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba import njit, prange

# About W1's Q8_0 weights (bench/README.md): the bytes a batch-1 step streams.
STREAM_MB = 25
ROUNDS = 200


@njit(parallel=True, fastmath=True, cache=True)
def _stream(weights: np.ndarray, threads: int) -> np.ndarray:
    """Read every element once, split across `threads` (a GEMV's access pattern)."""
    sums = np.zeros(threads * 16, np.float32)  # a cache line apart
    n = weights.shape[0]
    for t in prange(threads):
        acc = np.float32(0.0)
        for i in range(n * t // threads, n * (t + 1) // threads):
            acc += weights[i]
        sums[t * 16] = acc
    return sums


@pytest.mark.parametrize("before", ["caches_warm", "after_weight_stream"])
def test_small_torch_op(benchmark, before):
    benchmark.group = "torch-op-after-weight-stream"
    benchmark.extra_info.update(stream_mb=STREAM_MB, threads=numba.get_num_threads())
    hidden = torch.randn(1, 512)
    rows = torch.zeros(1, dtype=torch.int64)
    weights = np.ones(STREAM_MB * 2**20 // 4, np.float32)
    threads = numba.get_num_threads()
    _stream(weights, threads)

    def op() -> None:
        with torch.inference_mode():
            hidden[rows] + 1

    def setup() -> None:
        if before == "after_weight_stream":
            _stream(weights, threads)
        else:
            op()

    benchmark.pedantic(op, setup=setup, rounds=ROUNDS, warmup_rounds=2)
