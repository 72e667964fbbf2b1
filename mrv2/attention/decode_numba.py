"""Decode attention over the paged KV cache, read in place: the CPU kernel (float32 queries;
a float32, float16 or bfloat16 cache, widened to float32 as it is read: kv_numba.py).

The torch formulation gathers every decode row's blocks into a padded [rows, max_len] copy per
layer per step (and einsum copies it again into a contiguous layout); at 32 rows that copy cost
more than the attention itself. This kernel walks each row's block table and reads keys and
values where they lie, once, block by block. A work item is one row (all its heads: each
key/value row is read as one contiguous run, which matters once the cache is larger than the
L3) or, with fewer rows than 2 per thread, one (row, kv head) so both threads have work. The
query heads of a kv head's group (GQA) share each loaded key/value row. The blocks two ahead
are prefetched while one is computed (prefetch_numba.py), a token's share of the lines per
token computed: spread out like this rather than a whole block's 256 lines at once, 32 rows of
256 tokens over 8 layers (from DRAM) take 3.1-3.8 ms instead of 5.4-5.7 ms.

Numerics: fp32 accumulation in a different order than torch (fastmath lets the compiler
vectorise the head_dim reductions), and the softmax's exp is `numba_exp.exp32` (vectorised,
2.5 ulp) instead of libm's scalar expf; results agree with the reference to ~1e-6 relative.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from mrv2.attention.kv_numba import NUMBA_KV_DTYPES, numpy_view, widen
from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, prefetch_at
from mrv2.models.layers.numba_exp import exp32

# Blocks prefetched ahead of the one being computed (measured best among 1, 2 and 4).
PREFETCH_DISTANCE = 2


@njit(inline="always", cache=True)
def _prefetch_range(cache, block, start, stop):
    for offset in range(start, stop, CACHE_LINE_BYTES):
        prefetch_at(cache, block, offset)


@njit(parallel=True, fastmath=True, error_model="numpy", cache=True)
def decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, out, kv_per_item):
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # One K or V block: [block_size, num_kv_heads, head_dim], contiguous.
    block_bytes = block_size * num_kv_heads * head_dim * k_cache.itemsize
    line_bytes_per_token = block_bytes // block_size
    items_per_row = num_kv_heads // kv_per_item
    nh = kv_per_item * group
    for item in prange(rows * items_per_row):
        row = item // items_per_row
        kv0 = (item % items_per_row) * kv_per_item
        h0 = kv0 * group
        seq_len = seq_lens[row]
        if seq_len == 0:
            for h in range(nh):
                for d in range(head_dim):
                    out[row, h0 + h, d] = 0.0
            continue
        qs = np.empty((nh, head_dim), dtype=np.float32)
        for h in range(nh):
            for d in range(head_dim):
                qs[h, d] = q[row, h0 + h, d] * scale
        scores = np.empty((nh, seq_len), dtype=np.float32)
        nblocks = (seq_len + block_size - 1) // block_size
        for b in range(min(PREFETCH_DISTANCE, nblocks)):
            for offset in range(0, block_bytes, CACHE_LINE_BYTES):
                prefetch_at(k_cache, block_tables[row, b], offset)
        for b in range(nblocks):
            # Ahead: the next K blocks, then (near the end) the first V blocks.
            ahead = b + PREFETCH_DISTANCE
            kb = k_cache[block_tables[row, b]]
            t0 = b * block_size
            count = min(block_size, seq_len - t0)
            for o in range(count):
                # A block's share of the prefetches per token (the rest after a short
                # last block): spread out, not in a burst.
                stop = (o + 1) * line_bytes_per_token if o + 1 < count else block_bytes
                if ahead < nblocks:
                    _prefetch_range(k_cache, block_tables[row, ahead],
                                    o * line_bytes_per_token, stop)
                elif ahead - nblocks < nblocks:
                    _prefetch_range(v_cache, block_tables[row, ahead - nblocks],
                                    o * line_bytes_per_token, stop)
                for j in range(kv_per_item):
                    for g in range(group):
                        h = j * group + g
                        acc = np.float32(0.0)
                        for d in range(head_dim):
                            acc += qs[h, d] * widen(kb[o, kv0 + j, d])
                        scores[h, t0 + o] = acc
        for h in range(nh):
            m = scores[h, 0]
            for t in range(1, seq_len):
                m = max(m, scores[h, t])
            total = np.float32(0.0)
            for t in range(seq_len):
                e = exp32(scores[h, t] - m)
                scores[h, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(seq_len):
                scores[h, t] *= inv
        acc_out = np.zeros((nh, head_dim), dtype=np.float32)
        for b in range(nblocks):
            vb = v_cache[block_tables[row, b]]
            t0 = b * block_size
            count = min(block_size, seq_len - t0)
            for o in range(count):
                if b + PREFETCH_DISTANCE < nblocks:
                    stop = (o + 1) * line_bytes_per_token if o + 1 < count else block_bytes
                    _prefetch_range(v_cache, block_tables[row, b + PREFETCH_DISTANCE],
                                    o * line_bytes_per_token, stop)
                for j in range(kv_per_item):
                    for g in range(group):
                        h = j * group + g
                        p = scores[h, t0 + o]
                        for d in range(head_dim):
                            acc_out[h, d] += p * widen(vb[o, kv0 + j, d])
        for h in range(nh):
            for d in range(head_dim):
                out[row, h0 + h, d] = acc_out[h, d]

def supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel handles float32 CPU queries with a contiguous float32 or 16-bit cache."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and kv_cache.dtype in NUMBA_KV_DTYPES and kv_cache.is_contiguous())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: np.ndarray, scale: float) -> torch.Tensor:
    """q [rows, H, D] (one query token per row, the last position of its sequence) ->
    [rows, H, D]. A row with seq_len 0 (padding) returns zeros."""
    rows = q.shape[0]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    k_np = numpy_view(kv_cache[0])
    v_np = numpy_view(kv_cache[1])
    tables = block_tables[:rows].numpy()
    num_kv_heads = kv_cache.shape[3]
    kv_per_item = num_kv_heads if rows >= 2 * numba.get_num_threads() else 1
    decode_kernel(q.contiguous().numpy(), k_np, v_np, tables,
                   np.ascontiguousarray(seq_lens[:rows], dtype=np.int32), np.float32(scale),
                   out.numpy(), kv_per_item)
    return out
