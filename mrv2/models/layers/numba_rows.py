"""How the layers' per-row numba kernels run: what they accept and when they go parallel.

Why numba for the small per-layer ops (RMSNorm with the residual add, rotary, SiLU-and-mul): at
decode sizes (1-32 rows of a few hundred floats) each torch op costs a few microseconds of
dispatch and allocation, and RMSNorm is ~6 ops, rotary ~8 per tensor; at prefill sizes the
same torch ops are memory-bound passes over tensors far larger than the caches (bench/README.md
has the measurements). One numba call per op does the same arithmetic in one pass:
single-threaded up to `SERIAL_MAX_ROWS` rows (starting the thread pool would cost more than the
work), over chunks of `CHUNK_ROWS` rows in parallel beyond. The twins are norm_numba.py,
rotary_numba.py and activation_numba.py; each torch layer calls its twin when
`float32_cpu_inference` holds.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, typed

from mrv2.utils.kernel_flags import FASTMATH

# Compile options of every layer kernel: cached on disk, IEEE corner cases not checked.
NUMBA_OPTIONS = dict(fastmath=FASTMATH, error_model="numpy", cache=True)
SERIAL_MAX_ROWS = 64
CHUNK_ROWS = 16  # rows per parallel task


def float32_cpu_inference(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """The kernels take a 2-D `x` and float32 CPU tensors, outside autograd."""
    return (x.dim() == 2 and not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, *others)))


def rows_view(t: torch.Tensor) -> np.ndarray:
    """A 2-D numpy view whose rows are contiguous (copies only when they are not)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.detach().numpy()


@njit(cache=True)
def typed_list(items):
    """A typed list of `items` (a tuple whose items share one numba type), as the kernels take
    a model's per-layer views. Built in a cached function: `typed.List(...)` from Python
    compiles numba's list helpers for each item type in every process (0.4-1 s a type, ~2 s an
    engine start), and does not cache them."""
    out = typed.List()
    for item in items:
        out.append(item)
    return out
