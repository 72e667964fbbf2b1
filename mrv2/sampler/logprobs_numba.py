"""Each row's logsumexp in one fixed order (CPU, float32 logits): the batch-invariant mode's
twin of logprobs.py's `torch.logsumexp`, whose reduction splits a row over the threads when
there are fewer rows than threads (so one request's logprobs moved in the last bit with its
batch). One thread computes a whole row: max, then exp(x - max) summed in float64 in index
order, then max + log(sum) rounded once to float32. IEEE arithmetic (no fast-math flags):
-inf logits (masked tokens) contribute exactly 0, and a row of -inf gives -inf, as torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange


@njit(parallel=True, cache=True)
def _row_logsumexp(x, out):
    for r in prange(x.shape[0]):
        m = -np.inf
        for i in range(x.shape[1]):
            if x[r, i] > m or math.isnan(x[r, i]):
                m = x[r, i]
        if math.isnan(m) or m == -np.inf or m == np.inf:
            out[r] = m
            continue
        total = 0.0
        for i in range(x.shape[1]):
            total += math.exp(np.float64(x[r, i]) - np.float64(m))
        out[r] = np.float32(np.float64(m) + math.log(total))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x float32 CPU [rows, vocab] -> [rows, 1]: each row's logsumexp, the same bits whatever
    the other rows and the thread count."""
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _row_logsumexp(x.detach().contiguous().numpy(), out.numpy())
    return out.unsqueeze(1)
