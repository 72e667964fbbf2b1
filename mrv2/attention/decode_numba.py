"""Decode attention over the paged KV cache, read in place: the CPU kernel (float32).

The torch formulation gathers every decode row's blocks into a padded [rows, max_len] copy per
layer per step (and einsum copies it again into a contiguous layout); at 32 rows that copy cost
more than the attention itself. This kernel walks each row's block table and reads keys and
values where they lie, once: one work item per (row, kv head), all the query heads of that kv
head's group (GQA) sharing each loaded key/value row.

Numerics: fp32 accumulation in a different order than torch (fastmath lets the compiler
vectorise the head_dim reductions); results agree with the reference to ~1e-6 relative.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, out):
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for item in prange(rows * num_kv_heads):
        row = item // num_kv_heads
        kv_head = item % num_kv_heads
        seq_len = seq_lens[row]
        head0 = kv_head * group
        scores = np.empty((group, max(seq_len, 1)), dtype=np.float32)
        for t in range(seq_len):
            block = block_tables[row, t // block_size]
            offset = t % block_size
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += q[row, head0 + g, d] * k_cache[block, offset, kv_head, d]
                scores[g, t] = acc * scale
        for g in range(group):
            m = np.float32(-np.inf)
            for t in range(seq_len):
                m = max(m, scores[g, t])
            total = np.float32(0.0)
            for t in range(seq_len):
                e = np.exp(scores[g, t] - m)
                scores[g, t] = e
                total += e
            inv = np.float32(1.0) / total if seq_len > 0 else np.float32(0.0)
            for t in range(seq_len):
                scores[g, t] *= inv
        acc_out = np.zeros((group, head_dim), dtype=np.float32)
        for t in range(seq_len):
            block = block_tables[row, t // block_size]
            offset = t % block_size
            for g in range(group):
                p = scores[g, t]
                for d in range(head_dim):
                    acc_out[g, d] += p * v_cache[block, offset, kv_head, d]
        for g in range(group):
            for d in range(head_dim):
                out[row, head0 + g, d] = acc_out[g, d]


def supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel handles float32 CPU tensors with a contiguous cache."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: np.ndarray, scale: float) -> torch.Tensor:
    """q [rows, H, D] (one query token per row, the last position of its sequence) ->
    [rows, H, D]. A row with seq_len 0 (padding) returns zeros."""
    rows = q.shape[0]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    k_np = kv_cache[0].numpy()
    v_np = kv_cache[1].numpy()
    tables = block_tables[:rows].numpy()
    _decode_kernel(q.contiguous().numpy(), k_np, v_np, tables,
                   np.ascontiguousarray(seq_lens[:rows], dtype=np.int32), np.float32(scale),
                   out.numpy())
    return out
