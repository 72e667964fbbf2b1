"""Triton kernel for staged writes: one program per run copies it into the flat destination.

`meta` holds three int64 vectors of `num_runs`: flat start, length and offset into `values`.
Runs must not overlap (programs run in any order); the caller dedups overlapping runs first.

No recompile per step: `num_runs` is not specialised, and neither is `values_ptr`, whose
alignment follows the run count (`values` starts 24 * num_runs bytes into one upload, so it is
16-byte aligned only for an even count).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mrv2.platform import triton_kernel

RUN_TILE = 256  # elements of a run per loop iteration
_PER_STEP_RUN_ARGS = ("values_ptr", "num_runs")


def _apply_runs_kernel(dst_ptr, meta_ptr, values_ptr, num_runs, BLOCK: tl.constexpr):
    run = tl.program_id(0)
    start = tl.load(meta_ptr + run)
    length = tl.load(meta_ptr + num_runs + run)
    src = tl.load(meta_ptr + 2 * num_runs + run)
    for i in range(0, length, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < length
        values = tl.load(values_ptr + src + offs, mask=mask)
        tl.store(dst_ptr + start + offs, values, mask=mask)


def apply_runs(dst: torch.Tensor, meta: torch.Tensor, values: torch.Tensor,
               num_runs: int) -> None:
    """dst: flat destination; meta: [3 * num_runs] int64; values: same dtype as dst."""
    triton_kernel(_apply_runs_kernel, do_not_specialize=_PER_STEP_RUN_ARGS)[(num_runs,)](
        dst, meta, values, num_runs, BLOCK=RUN_TILE)
