"""The group panel kernel's software prefetch (quantized_panel_numba.PREFETCH_AHEAD_BYTES) against
the same kernel compiled without it, in the same run, on weights streamed from DRAM as a decode
step streams a model's: 80 distinct Q4_1 ("u4") weights of SmolLM2's fused gate/up shape (3072
x 576, 0.9 MB of panels each, 71 MB in all, past the L3), each multiplied once per timed call,
at 1, 2 and 4 rows of x (a pass of 2 or more rows is bound by its multiply-adds, and only such a
pass prefetches). extra_info: microseconds per weight and GB/s of panels at the median.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mrv2.models.layers import quantized_panel_layout as layout
from mrv2.models.layers import quantized_panel_numba as panel
from mrv2.models.layers.gguf_blocks import pack_u4

N, K, COPIES = 3072, 576, 80

pytestmark = [pytest.mark.skipif(not panel.GROUP_PANELS_RUN,
                                 reason="the group panel kernel runs where the CPU has AVX-512")]

_STATE: dict[str, object] = {}


def _weights() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    if "weights" not in _STATE:
        rng = np.random.default_rng(0)
        values = rng.integers(0, 16, size=(N, K), dtype=np.uint8)
        tables = [rng.random((N, K // 32), dtype=np.float32).astype(np.float16).view(np.int16)
                  for _ in range(2)]
        w = layout.group_panels_of(pack_u4(values), *tables, packed=True)
        _STATE["weights"] = [tuple(a.copy() for a in w) for _ in range(COPIES)]
    return _STATE["weights"]


def _kernel_without_prefetch():
    """A fresh compile of the kernel with no pass prefetching (its intrinsic reads the module's
    PREFETCH_MIN_ROWS as it generates code; uncached, so the cached kernel is untouched)."""
    if "plain" not in _STATE:
        saved = panel.PREFETCH_MIN_ROWS
        panel.PREFETCH_MIN_ROWS = panel.GROUP_PANEL_ROWS + 1
        try:
            kernel = numba.njit(parallel=True, error_model="numpy")(
                panel.group_panel_kernel.py_func)
            x = np.ones((2, K), np.float32)
            kernel(x, *_weights()[0], True, np.empty((2, N), np.float32))
        finally:
            panel.PREFETCH_MIN_ROWS = saved
        _STATE["plain"] = kernel
    return _STATE["plain"]


def _stream(kernel, x: np.ndarray, out: np.ndarray) -> None:
    for w, scales, mins in _weights():
        kernel(x, w, scales, mins, True, out)


@pytest.mark.parametrize("impl", ["prefetch", "none"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_panel_prefetch(benchmark, rows, impl):
    kernel = panel.group_panel_kernel if impl == "prefetch" else _kernel_without_prefetch()
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    out, reference = np.empty((rows, N), np.float32), np.empty((rows, N), np.float32)
    w = _weights()[0]
    kernel(x, *w, True, out)
    panel.group_panel_kernel(x, *w, True, reference)
    assert np.array_equal(out, reference)  # a hint only: the same sums, bit for bit
    benchmark.group = f"panel-prefetch-q4_1-{N}x{K}-{rows}rows"
    benchmark(_stream, kernel, x, out)
    if benchmark.disabled:  # the suite's untimed pass: the check above is all
        return
    per_weight = benchmark.stats.stats.median / COPIES
    benchmark.extra_info.update(rows=rows, copies=COPIES, threads=numba.get_num_threads(),
                                us_per_weight=round(per_weight * 1e6, 1),
                                gb_s=round(_weights()[0][0].nbytes / per_weight / 1e9, 1))
