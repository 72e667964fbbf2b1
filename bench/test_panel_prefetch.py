"""The group panel kernel's software prefetch (quantized_panel_numba.PREFETCH_AHEAD_BYTES) against
the same kernel compiled without it, in the same run, on weights streamed from DRAM as a decode
step streams a model's: distinct weights of 3072 x 1024 (a fused gate/up of a ~0.3B model) in
each panel form, Q4_1 ("u4"), Q8_0 ("i8"), Q4_K ("u4k") and Q6_K ("u6"), 64 MB or more of panels
in all (past the L3), each multiplied once per timed call, at 1, 2 and 4 rows of x (a pass of
2 or more rows is bound by its multiply-adds, and only such a pass prefetches). Random valid
blocks (tests/models/test_quantized.py's generator). extra_info: microseconds per weight and
GB/s of panels at the median.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.quantized import PackedWeight

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "models"))
from test_quantized import random_raw  # noqa: E402

N, K = 3072, 1024  # K in whole 256-input super-blocks, for the K-quants
STREAM_BYTES = 64 << 20  # past this CPU's L3 (32 MB on the Zen 4 measured)

pytestmark = [pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                 reason="the group panel kernel runs where the CPU has AVX-512")]

_STATE: dict[object, object] = {}


def _weights(gguf_type: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]:
    """Copies of one weight's panels (and its `packed` flag), STREAM_BYTES of them or more."""
    if gguf_type not in _STATE:
        w = PackedWeight.from_gguf(random_raw(gguf_type, N, K, seed=0), gguf_type, (N, K))
        panels, packed = w.group_panels(), w.layout == "u4"
        copies = -(-STREAM_BYTES // panels[0].nbytes)
        _STATE[gguf_type] = [(*(a.copy() for a in panels), packed) for _ in range(copies)]
    return _STATE[gguf_type]


def _kernel_without_prefetch(gguf_type: str):
    """A fresh compile of the kernel with no pass prefetching, for `gguf_type`'s panels (its
    intrinsic reads the module's PREFETCH_MIN_ROWS as it generates code, so each new signature
    is compiled with it patched; uncached, so the cached kernel is untouched)."""
    kernel = _STATE.setdefault("plain", numba.njit(parallel=True, error_model="numpy")(
        panel.group_panel_kernel.py_func))
    if ("plain", gguf_type) not in _STATE:
        saved = panel.PREFETCH_MIN_ROWS
        panel.PREFETCH_MIN_ROWS = panel.GROUP_PANEL_ROWS + 1
        try:
            w, scales, mins, packed = _weights(gguf_type)[0]
            kernel(np.ones((2, K), np.float32), w, scales, mins, packed,
                   np.empty((2, N), np.float32))
        finally:
            panel.PREFETCH_MIN_ROWS = saved
        _STATE["plain", gguf_type] = True
    return kernel


def _stream(kernel, weights, x: np.ndarray, out: np.ndarray) -> None:
    for w, scales, mins, packed in weights:
        kernel(x, w, scales, mins, packed, out)


@pytest.mark.parametrize("impl", ["prefetch", "none"])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_panel_prefetch(benchmark, gguf_type, rows, impl):
    kernel = (panel.group_panel_kernel if impl == "prefetch"
              else _kernel_without_prefetch(gguf_type))
    weights = _weights(gguf_type)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    out, reference = np.empty((rows, N), np.float32), np.empty((rows, N), np.float32)
    w, scales, mins, packed = weights[0]
    kernel(x, w, scales, mins, packed, out)
    panel.group_panel_kernel(x, w, scales, mins, packed, reference)
    assert np.array_equal(out, reference)  # a hint only: the same sums, bit for bit
    benchmark.group = f"panel-prefetch-{gguf_type}-{N}x{K}-{rows}rows"
    benchmark(_stream, kernel, weights, x, out)
    if benchmark.disabled:  # the suite's untimed pass: the check above is all
        return
    per_weight = benchmark.stats.stats.median / len(weights)
    benchmark.extra_info.update(gguf_type=gguf_type, rows=rows, copies=len(weights),
                                threads=numba.get_num_threads(),
                                us_per_weight=round(per_weight * 1e6, 1),
                                gb_s=round(w.nbytes / per_weight / 1e9, 1))
