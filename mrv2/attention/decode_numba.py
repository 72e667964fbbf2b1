"""Decode attention over the paged KV cache, read in place: the CPU kernel (float32 queries;
a float32, float16 or bfloat16 cache, widened to float32 as it is read: kv_numba.py).

The torch formulation gathers every decode row's blocks into a padded [rows, max_len] copy per
layer per step (and einsum copies it again into a contiguous layout); at 32 rows that copy cost
more than the attention itself. This kernel walks each row's block table and reads keys and
values where they lie, once, block by block. Work items (`work_split`): one row with all its kv
heads when there are at least two rows per thread and the step's K/V comes from DRAM (larger
than the last-level cache: each key/value row is then read as one contiguous run) on AVX2 CPUs
(`WHOLE_ROW_ITEMS`); otherwise one (row, kv head); and when even those are fewer than two per
thread, each row's context is split as well (flash-decoding: each split's max, exp-sum and
unnormalised output, merged after). The query heads of a kv head's group (GQA) share each
loaded key/value row, and scores and values are computed in the loops of decode_vector_ir.py
(LLVM vector IR: a position's row widened once, the heads' sums in registers) where the head
size is whole vectors, else four positions per pass in numba (`_block_scores`,
`_block_values`). The blocks two ahead are prefetched while one is computed
(prefetch_numba.py): a whole block before the vector loops, each token's rows with the token in
the numba loops, into L2 rather than L1 (`prefetch_to_l2_at`: with L1 as the target the K/V
stream from DRAM barely overlapped the compute, measured in bench/README.md).

Numerics: fp32 accumulation in another order than torch's, and the softmax's exp is
`numba_exp.exp32` (vectorised, 2.5 ulp): results agree with the reference to ~1e-6 relative.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from mrv2 import batch_invariant, platform
from mrv2.attention.decode_vector_ir import block_scores, block_values, vector_width
from mrv2.attention.kv_numba import NUMBA_KV_DTYPES, numpy_view, widen
from mrv2.attention.prefetch_numba import CACHE_LINE_BYTES, prefetch_to_l2_at
from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.vector_ir import row_sum
from mrv2.utils.kernel_flags import FASTMATH

# Blocks prefetched ahead of the one being computed (measured best among 1, 2 and 4).
PREFETCH_DISTANCE = 2
# Head sizes of whole vectors take decode_vector_ir's block loops
# (`decode_vector_ir.takes_head_dim`), others the numba loops below (a global: numba compiles
# it in as a constant).
VECTOR_WIDTH = vector_width()
# Whether `work_split` makes whole-row items where the step's K/V comes from DRAM: only where
# vectors are 8 floats (AVX2), where they were faster (Zen 3); with AVX-512 (Zen 4) (row, kv
# head) items were faster or level there too (bench/README.md has both). The AVX2 choice was
# measured with the prefetches into L1 and not since they go to L2 (no AVX2 machine at hand).
WHOLE_ROW_ITEMS = VECTOR_WIDTH == 8
# Fewest positions in a context split: below it a split's fixed costs (its scratch, its share
# of the merge) outweigh a second thread's help.
MIN_SPLIT_POSITIONS = 64


def step_kv_bytes(seq_lens: np.ndarray, num_kv_heads: int, head_dim: int, itemsize: int,
                  layers: int) -> int:
    """Bytes of K and V that decode rows of these lengths read in a step of `layers` layers."""
    return int(seq_lens.sum()) * 2 * num_kv_heads * head_dim * itemsize * layers


def planned_threads() -> int:
    """The thread count a step's `work_split` is planned for: numba's pool size, not the count
    running now (utils/free_cores.py fits that to the machine's load, and a caller may set
    fewer), so the split, and with it the attention's sums, never depends on either."""
    return numba.config.NUMBA_NUM_THREADS


def work_split(rows: int, num_kv_heads: int, threads: int, kv_bytes: int) -> tuple[int, int]:
    """(kv heads per work item, context splits per row) for `rows` decode rows on `threads`
    threads reading `kv_bytes` of K/V in the step (`step_kv_bytes`). A work item is one row
    with all its kv heads when there are at least two rows per thread and the step's K/V is
    larger than the last-level cache, on a CPU of `WHOLE_ROW_ITEMS`: read from DRAM, each
    key/value row is then one contiguous run. Otherwise one (row, kv head), which computed
    faster where the cache holds the step's K/V (bench/README.md has both); and when even
    those are fewer than two per thread each row's context is split too, so that every thread
    has work (batch 1, 3 kv heads, 2 threads: 6 items of 3 per thread, where 3 items took two
    rounds). In batch-invariant mode, (1, 1) whatever the batch and the threads."""
    if batch_invariant.active():  # one order for every row: no context splits
        return 1, 1
    if WHOLE_ROW_ITEMS and rows >= 2 * threads and kv_bytes > platform.last_level_cache_bytes():
        return num_kv_heads, 1
    items = rows * num_kv_heads
    splits = 1
    while items * splits < 2 * threads:
        splits += 1
    return 1, splits


@njit(inline="always", cache=True)
def _prefetch_rows(cache, block, first, stop, row_bytes, start, length):
    """Prefetch token rows first..stop-1 of a cache block (none for block -1): `length` bytes
    from byte `start` of each row of `row_bytes`."""
    if block < 0:
        return
    for r in range(first, stop):
        begin = r * row_bytes + start
        line = begin - begin % CACHE_LINE_BYTES
        while line < begin + length:
            prefetch_to_l2_at(cache, block, line)
            line += CACHE_LINE_BYTES


def widen_four(block, o, kv, scratch):
    """A 16-bit cache: kv head `kv` of the block's positions o..o+3 widened into `scratch`
    [4, head_dim] float32, once for all the query heads of the group that read them rather
    than once per head. A float32 cache: nothing (`four_at` reads the block). Numba only."""
    raise NotImplementedError("numba only")


@overload(widen_four, inline="always")
def _widen_four_overload(block, o, kv, scratch):
    if block.dtype == types.float32:
        return lambda block, o, kv, scratch: None

    def widened(block, o, kv, scratch):
        for i in range(4):
            for d in range(scratch.shape[1]):
                scratch[i, d] = widen(block[o + i, kv, d])
    return widened


def four_at(block, o, kv, scratch, i, d):
    """Element d of position o + i's kv head `kv` as float32, after `widen_four`. Numba only."""
    raise NotImplementedError("numba only")


@overload(four_at, inline="always")
def _four_at_overload(block, o, kv, scratch, i, d):
    if block.dtype == types.float32:
        return lambda block, o, kv, scratch, i, d: block[o + i, kv, d]
    return lambda block, o, kv, scratch, i, d: scratch[i, d]


@njit(inline="always", cache=True)
def _block_scores(qs, kb, kv0, kv_per_item, group, count, scores, t, ahead_cache, ahead_block,
                  row_bytes, start, length, scratch):
    """scores[h, t + o] = qs[h] . kb[o, kv head of h] for the block's positions o < count,
    prefetching the same rows of the block ahead as it goes (`_prefetch_rows`' arguments).

    An item of one kv head takes four positions per pass: four independent accumulators per
    head, so the FMA chains overlap (one chain per position, each ending in a horizontal sum,
    left the FMA units idle). An item of all kv heads (many rows, waiting on DRAM) reads the
    block in order, a position's heads after another's, with a row's prefetch per position:
    four-position passes ran slower there (bench/README.md has both measurements)."""
    head_dim = qs.shape[1]
    o = 0
    if kv_per_item == 1:
        while o + 4 <= count:
            _prefetch_rows(ahead_cache, ahead_block, o, o + 4, row_bytes, start, length)
            widen_four(kb, o, kv0, scratch)
            for g in range(group):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qs[g, d]
                    a0 += x * four_at(kb, o, kv0, scratch, 0, d)
                    a1 += x * four_at(kb, o, kv0, scratch, 1, d)
                    a2 += x * four_at(kb, o, kv0, scratch, 2, d)
                    a3 += x * four_at(kb, o, kv0, scratch, 3, d)
                scores[g, t + o] = a0
                scores[g, t + o + 1] = a1
                scores[g, t + o + 2] = a2
                scores[g, t + o + 3] = a3
            o += 4
    while o < count:
        _prefetch_rows(ahead_cache, ahead_block, o, o + 1, row_bytes, start, length)
        for h in range(kv_per_item * group):
            kv = kv0 + h // group
            acc = np.float32(0.0)
            for d in range(head_dim):
                acc += qs[h, d] * widen(kb[o, kv, d])
            scores[h, t + o] = acc
        o += 1
    # The rest of the block ahead, after a short (last) block.
    _prefetch_rows(ahead_cache, ahead_block, count, kb.shape[0], row_bytes, start, length)


@njit(inline="always", cache=True)
def _block_values(probs, vb, kv0, kv_per_item, group, count, t, acc, ahead_cache, ahead_block,
                  row_bytes, start, length, scratch):
    """acc[h] += sum over the block's positions o < count of probs[h, t + o] * vb[o, kv head
    of h], prefetching and ordered as `_block_scores` (an item of one kv head: four positions
    per pass, one load and store of acc per four multiply-adds)."""
    head_dim = acc.shape[1]
    o = 0
    if kv_per_item == 1:
        while o + 4 <= count:
            _prefetch_rows(ahead_cache, ahead_block, o, o + 4, row_bytes, start, length)
            widen_four(vb, o, kv0, scratch)
            for g in range(group):
                p0 = probs[g, t + o]
                p1 = probs[g, t + o + 1]
                p2 = probs[g, t + o + 2]
                p3 = probs[g, t + o + 3]
                for d in range(head_dim):
                    acc[g, d] += (p0 * four_at(vb, o, kv0, scratch, 0, d)
                                  + p1 * four_at(vb, o, kv0, scratch, 1, d)
                                  + p2 * four_at(vb, o, kv0, scratch, 2, d)
                                  + p3 * four_at(vb, o, kv0, scratch, 3, d))
            o += 4
    while o < count:
        _prefetch_rows(ahead_cache, ahead_block, o, o + 1, row_bytes, start, length)
        for j in range(kv_per_item):
            for g in range(group):
                h = j * group + g
                p = probs[h, t + o]
                for d in range(head_dim):
                    acc[h, d] += p * widen(vb[o, kv0 + j, d])
        o += 1
    _prefetch_rows(ahead_cache, ahead_block, count, vb.shape[0], row_bytes, start, length)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, out, kv_per_item, splits,
                  window, softcap, sinks):
    """Each row's query (the last position of its sequence) over its keys; with `window` > 0
    the last `window` of them only (sliding-window attention: positions seq_len - window ..
    seq_len - 1; the blocks before are not read); with `softcap` > 0 each scaled score s
    soft-capped to softcap * tanh(s / softcap) (Gemma 2); with `sinks` [num_heads] (else
    [0]) each head's sink logit joins the softmax's denominator, exp(sink - max), and no value
    (gpt-oss)."""
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # A block's token row holds every kv head: [num_kv_heads, head_dim], contiguous. An item
    # reads (and prefetches) only its kv heads' run of each row.
    row_bytes = num_kv_heads * head_dim * k_cache.itemsize
    head_bytes = head_dim * k_cache.itemsize
    item_bytes = kv_per_item * head_dim * k_cache.itemsize
    items_per_row = num_kv_heads // kv_per_item
    nh = kv_per_item * group
    min_split_blocks = (MIN_SPLIT_POSITIONS + block_size - 1) // block_size
    vectorised = head_dim % VECTOR_WIDTH == 0
    # Each split's running max, exp-sum and unnormalised output, merged below (splits > 1).
    part_m = np.empty((rows, num_heads, splits), dtype=np.float32)
    part_l = np.empty((rows, num_heads, splits), dtype=np.float32)  # (np.zeros: a parfor)
    part_acc = np.empty((rows, num_heads, splits if splits > 1 else 0, head_dim),
                        dtype=np.float32)
    for item in prange(rows * items_per_row * splits):
        split = item % splits
        row = item // splits // items_per_row
        kv0 = (item // splits % items_per_row) * kv_per_item
        h0 = kv0 * group
        seq_len = seq_lens[row]
        nblocks = (seq_len + block_size - 1) // block_size
        visible = max(0, seq_len - window) if window > 0 else 0  # the first key it sees
        first_block = visible // block_size
        per_split = max(min_split_blocks, (nblocks - first_block + splits - 1) // splits)
        first = first_block + split * per_split
        stop = min(nblocks, first + per_split)
        if first >= stop:
            for h in range(nh):
                part_l[row, h0 + h, split] = 0.0
            if splits == 1:
                for h in range(nh):
                    for d in range(head_dim):
                        out[row, h0 + h, d] = 0.0
            continue
        start = kv0 * head_bytes
        qs = np.empty((nh, head_dim), dtype=np.float32)
        for h in range(nh):
            for d in range(head_dim):
                qs[h, d] = q[row, h0 + h, d] * scale
        base = first * block_size
        n = min(seq_len, stop * block_size) - base
        scores = np.empty((nh, n), dtype=np.float32)
        scratch = np.empty((4, head_dim), dtype=np.float32)
        for b in range(first, min(first + PREFETCH_DISTANCE, stop)):
            _prefetch_rows(k_cache, np.int64(block_tables[row, b]), 0, block_size, row_bytes,
                           start, item_bytes)
        for b in range(first, stop):
            # Ahead: the next K blocks, then (near the end) the first V blocks, spread out
            # rather than in a burst, which waited longer on DRAM (bench/README.md).
            ahead = b + PREFETCH_DISTANCE
            ahead_cache, ahead_block = v_cache, np.int64(-1)
            if ahead < stop:
                ahead_cache, ahead_block = k_cache, np.int64(block_tables[row, ahead])
            elif ahead - stop < stop - first:
                ahead_block = np.int64(block_tables[row, first + ahead - stop])
            t0 = b * block_size
            count = min(block_size, seq_len - t0)
            if vectorised:
                _prefetch_rows(ahead_cache, ahead_block, 0, block_size, row_bytes, start,
                               item_bytes)
                for j in range(kv_per_item):
                    block_scores(qs[j * group:(j + 1) * group], k_cache[block_tables[row, b]],
                                 kv0 + j, count, scores[j * group:(j + 1) * group], t0 - base)
            else:
                _block_scores(qs, k_cache[block_tables[row, b]], kv0, kv_per_item, group,
                              count, scores, t0 - base, ahead_cache, ahead_block, row_bytes,
                              start, item_bytes, scratch)
        acc = np.zeros((nh, head_dim), dtype=np.float32)
        hidden = max(0, visible - base)  # keys of the first block before the window
        if softcap > 0.0:
            for h in range(nh):
                for t in range(hidden, n):
                    scores[h, t] = softcap * np.tanh(scores[h, t] / softcap)
        for h in range(nh):
            m = scores[h, hidden]
            for t in range(hidden + 1, n):
                m = max(m, scores[h, t])
            for t in range(hidden):
                scores[h, t] = 0.0
            for t in range(hidden, n):
                scores[h, t] = exp32(scores[h, t] - m)
            part_m[row, h0 + h, split] = m
            part_l[row, h0 + h, split] = row_sum(scores, h, n)
        for b in range(first, stop):
            v_block = (np.int64(block_tables[row, b + PREFETCH_DISTANCE])
                       if b + PREFETCH_DISTANCE < stop else np.int64(-1))
            t0 = b * block_size
            count = min(block_size, seq_len - t0)
            if vectorised:
                _prefetch_rows(v_cache, v_block, 0, block_size, row_bytes, start, item_bytes)
                for j in range(kv_per_item):
                    block_values(scores[j * group:(j + 1) * group], t0 - base,
                                 v_cache[block_tables[row, b]], kv0 + j, count,
                                 acc[j * group:(j + 1) * group])
            else:
                _block_values(scores, v_cache[block_tables[row, b]], kv0, kv_per_item, group,
                              count, t0 - base, acc, v_cache, v_block, row_bytes, start,
                              item_bytes, scratch)
        if splits == 1:
            for h in range(nh):
                total = part_l[row, h0 + h, 0]
                if sinks.shape[0] > 0:
                    total += exp32(sinks[h0 + h] - part_m[row, h0 + h, 0])
                inv = np.float32(1.0) / total
                for d in range(head_dim):
                    out[row, h0 + h, d] = acc[h, d] * inv
        else:
            for h in range(nh):
                for d in range(head_dim):
                    part_acc[row, h0 + h, split, d] = acc[h, d]
    if splits == 1:
        return
    # The splits of a (row, head): each weighted by exp(its max - the overall max).
    for rh in prange(rows * num_heads):
        row, h = rh // num_heads, rh % num_heads
        m = np.float32(-np.inf)
        for s in range(splits):
            if part_l[row, h, s] > 0.0:
                m = max(m, part_m[row, h, s])
        total = np.float32(0.0)
        if sinks.shape[0] > 0 and m > -np.inf:  # once per (row, head), not per split
            total = exp32(sinks[h] - m)
        for d in range(head_dim):
            out[row, h, d] = 0.0
        for s in range(splits):
            if part_l[row, h, s] > 0.0:
                w = exp32(part_m[row, h, s] - m)
                total += w * part_l[row, h, s]
                for d in range(head_dim):
                    out[row, h, d] += w * part_acc[row, h, s, d]
        if total > 0.0:
            inv = np.float32(1.0) / total
            for d in range(head_dim):
                out[row, h, d] *= inv


NO_SINKS = np.empty(0, dtype=np.float32)  # `sinks` without sink logits
PLAIN_ATTENTION = (0, np.float32(0.0), NO_SINKS)  # (window, softcap, sinks) of plain attention


def supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel handles float32 CPU queries with a contiguous float32 or 16-bit cache."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and kv_cache.dtype in NUMBA_KV_DTYPES and kv_cache.is_contiguous())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: np.ndarray, scale: float, layers: int = 1,
                     window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     sequences: int | None = None) -> torch.Tensor:
    """q [rows, H, D] (one query token per row, the last position of its sequence) ->
    [rows, H, D]; with `window` > 0 over the last `window` keys only; `softcap` > 0 caps
    the scores; `sinks` [H] float32: per-head sink logits (decode_kernel). A row with seq_len
    0 (padding) returns zeros. `layers`: how many layers' caches the step reads (this one's
    among them), and `sequences` (the rows' requests: AttentionMetadata.decode_sequences;
    None: the rows), for the work split."""
    rows = q.shape[0]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    k_np = numpy_view(kv_cache[0])
    v_np = numpy_view(kv_cache[1])
    tables = np.ascontiguousarray(block_tables[:rows].numpy())  # one specialization for all
    lens = np.ascontiguousarray(seq_lens[:rows], dtype=np.int32)
    kv_bytes = step_kv_bytes(lens, kv_cache.shape[3], kv_cache.shape[4], kv_cache.element_size(),
                             layers)
    kv_per_item, splits = work_split(rows if sequences is None else sequences,
                                     kv_cache.shape[3], planned_threads(), kv_bytes)
    decode_kernel(q.contiguous().numpy(), k_np, v_np, tables, lens, np.float32(scale),
                  out.numpy(), kv_per_item, splits, window, np.float32(softcap),
                  NO_SINKS if sinks is None else sinks.detach().float().contiguous().numpy())
    return out
