"""Greedy sampling's argmax on the CPU: the numba twin of noise_triton.greedy_argmax for
float32 logits (sampler_torch.py calls it; other dtypes keep torch's `max`).

Why: torch's `max(dim=-1)` on the CPU walks a row comparing values and carrying indices, several
times slower than a plain maximum, and a NaN row must then be redone (bench/README.md has the
kernel against it). Here each row is read once as integers: every float32's bit pattern maps to
an int32 key in the floats' order (`_order_key`), so the row's maximum is an integer max over
runs of `_RUN` elements that the compiler vectorises, with the largest magnitude (above +inf's
where a NaN is) taken in the same pass; only the run that first reached the maximum is read
again, for the first index holding it.

Semantics (those of torch.argmax on the row with NaN read as -inf, and of the Triton twin):
ties go to the lowest index, -0.0 equals 0.0, a row of NaN and -inf only gives token 0, and
`nan_rows` says which rows held a NaN.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

# Elements per run: the max of a run is one vectorised pass; a run is the most a row's
# second look reads.
_RUN = 512
_SIGN = np.int32(-2147483648)  # 0x80000000: -0.0's bit pattern
_MAGNITUDE = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)
_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000


@njit(inline="always", cache=True)
def _order_key(bits):
    """A float32's bit pattern -> an int32 that orders as the floats do, with -0.0 equal to
    0.0 and a NaN equal to -inf (negative floats' magnitude bits flipped so that larger
    magnitudes come lower)."""
    # np.int32 around every step: numba widens int32 arithmetic to int64 otherwise, which
    # halves the lanes of the vectorised loop.
    if np.int32(bits & _MAGNITUDE) > _INF_BITS:
        bits = _NEG_INF_BITS
    if bits == _SIGN:
        bits = np.int32(0)
    return np.int32(bits ^ np.int32(np.int32(bits >> np.int32(31)) & _MAGNITUDE))


# Rows up to which one thread takes the whole batch: a row is a few microseconds of work, less
# than waking the other threads for a parallel region costs.
MAX_SERIAL_ROWS = 4


@njit(inline="always", cache=True)
def _row_argmax(bits, r, sampled, nan_rows):
    """Row r of `greedy_argmax_kernel`."""
    vocab = bits.shape[1]
    row = bits[r]
    best = np.int32(-2147483648)
    best_run = 0
    # The largest magnitude bits: above +inf's where the row holds a NaN.
    magnitude = np.int32(0)
    for start in range(0, vocab, _RUN):
        run = row[start:start + _RUN]  # sliced: a loop from 0 vectorises
        run_max = np.int32(-2147483648)
        for i in range(run.shape[0]):
            b = run[i]
            m = np.int32(b & _MAGNITUDE)
            magnitude = m if m > magnitude else magnitude
            key = _order_key(b)
            run_max = key if key > run_max else run_max
        if run_max > best:
            best, best_run = run_max, start
    index = best_run
    while _order_key(row[index]) != best:
        index += 1
    sampled[r] = index
    nan_rows[r] = magnitude > _INF_BITS


@njit(parallel=True, cache=True)
def greedy_argmax_kernel(bits, sampled, nan_rows):
    """sampled[r] = the first index of row r's maximum of `bits` [B, V] (float32 logits
    viewed as int32), NaN read as -inf; nan_rows[r] = whether row r held a NaN."""
    for r in prange(bits.shape[0]):
        _row_argmax(bits, r, sampled, nan_rows)


@njit(cache=True)
def greedy_argmax_serial(bits, sampled, nan_rows):
    """`greedy_argmax_kernel` on the calling thread (up to MAX_SERIAL_ROWS rows)."""
    for r in range(bits.shape[0]):
        _row_argmax(bits, r, sampled, nan_rows)


def takes_logits(logits: torch.Tensor) -> bool:
    """The kernel takes contiguous float32 CPU logits with at least one column."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.is_contiguous())


def greedy_argmax_float32(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled [B] int64, nan_rows [B] bool) of float32 `logits` [B, V] (`takes_logits`)."""
    rows = logits.shape[0]
    sampled = torch.empty(rows, dtype=torch.int64)
    nan_rows = torch.empty(rows, dtype=torch.bool)
    if rows:
        kernel = greedy_argmax_serial if rows <= MAX_SERIAL_ROWS else greedy_argmax_kernel
        kernel(logits.numpy().view(np.int32), sampled.numpy(), nan_rows.numpy())
    return sampled, nan_rows
