"""Split-KV (flash-decoding) Triton attention for decode batches: the CUDA decode path.

`paged_triton.paged_attention` runs one program per (query block, kv head): at batch 1 on a long
context that is a handful of programs on a GPU with a hundred-odd SMs. Here each decode row's
context is cut into NUM_SPLITS chunks, each a whole number of TILE-key tiles:

- `_split_kv_kernel`, grid (rows, kv heads, NUM_SPLITS): online softmax over one chunk for
  every query head of one kv head; writes the unnormalised output `acc`, the running max `m`
  (base 2, scaled scores) and sum of exponentials `l` to the scratch buffers.
- `_merge_splits_kernel`, grid (rows, query heads): the exact log-sum-exp merge
  out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s.

Chunks are `ceil(ceil(seq_len / TILE) / NUM_SPLITS)` tiles long, so short rows leave their
trailing splits empty (m = -1e38, l = 0, acc = 0: weight 0 in the merge) and a row never
depends on another. NUM_SPLITS is a constexpr fixed by the configuration and the device
(`num_kv_splits`), never by the batch; seq_lens and the row count are read from device tensors
and the grid's shape, so one compiled kernel serves every decode step and CUDA-graph capture.

Every row must have one query token (or none: graph padding rows, query_start_loc entries =
num_tokens, exit at once and leave their output untouched).

Reductions: Triton's `tl.max` / `tl.sum` are jitted helpers the interpreter cannot call once
triton was imported in compiled mode, and a combine function of our own makes the interpreter
reduce element by element in Python. The kernels therefore reduce the last axis as a
log2(n)-step tree of public builtins (`tl.reshape`, `tl.split`, `tl.maximum` / `+`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mrv2.attention.paged_triton import LOG2E, _check_q_and_cache, attend_tile
from mrv2.platform import triton_kernel

# Keys per step of the split kernel; a chunk is a whole number of tiles.
DEFAULT_TILE = 64
# Programs per SM the split count aims for at batch 1 (more hides load latency).
PROGRAMS_PER_SM = 2


def _split_kv_kernel(q_ptr, cache_ptr, acc_ptr, ml_ptr, query_start_loc_ptr, seq_lens_ptr,
                     block_tables_ptr, qk_scale, max_blocks, window,
                     stride_qt, stride_qh, stride_bt,
                     stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                     stride_acc_row, stride_acc_head, stride_ml_kind, stride_ml_row,
                     stride_ml_head,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, LOG2_TILE: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                     SOFTCAP: tl.constexpr, ATTEND_TILE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if q_len > 0:
        seq_len = tl.load(seq_lens_ptr + row)
        # The keys seen: all, or the last `window` (sliding window); split from the tile of
        # the first one.
        key_lo = seq_len * 0
        if window > 0:
            key_lo = tl.maximum(seq_len - window, 0)
        first_tile = key_lo // TILE
        tiles_per_split = ((seq_len + TILE - 1) // TILE - first_tile + NUM_SPLITS - 1) \
            // NUM_SPLITS
        key_start = (first_tile + split * tiles_per_split) * TILE
        key_end = tl.minimum(key_start + tiles_per_split * TILE, seq_len)

        # BLOCK_M >= 16 rows for tl.dot; rows past GROUP are padding.
        offs_m = tl.arange(0, BLOCK_M)
        m_valid = offs_m < GROUP
        head = kv_head * GROUP + offs_m
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=m_valid[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        table_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        k_base = cache_ptr + kv_head * stride_c_head
        for start in range(key_start, key_end, TILE):
            key_pos = start + tl.arange(0, TILE)
            key_valid = (key_pos < key_end) & (key_pos >= key_lo)
            m_i, l_i, acc = ATTEND_TILE(q, m_i, l_i, acc, k_base, table_row, key_pos, key_valid,
                                        key_valid[None, :], max_blocks, qk_scale, stride_c_kv,
                                        stride_c_block, stride_c_slot, BLOCK_M, HEAD_DIM,
                                        BLOCK_SIZE, LOG2_TILE, PRECISION, SOFTCAP)

        acc_row = acc_ptr + row.to(tl.int64) * stride_acc_row + split * HEAD_DIM
        tl.store(acc_row + head[:, None] * stride_acc_head + dims[None, :], acc,
                 mask=m_valid[:, None])
        ml_at = ml_ptr + row.to(tl.int64) * stride_ml_row + head * stride_ml_head + split
        tl.store(ml_at, m_i, mask=m_valid)
        tl.store(ml_at + stride_ml_kind, l_i, mask=m_valid)


def _merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, query_start_loc_ptr, sinks_ptr,
                         stride_acc_row, stride_acc_head, stride_ml_kind, stride_ml_row,
                         stride_ml_head, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         LOG2_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if q_len > 0:
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        ml_at = ml_ptr + row.to(tl.int64) * stride_ml_row + head * stride_ml_head + splits
        m = tl.reshape(tl.load(ml_at), [1, NUM_SPLITS])
        l = tl.reshape(tl.load(ml_at + stride_ml_kind), [1, NUM_SPLITS])
        acc = tl.load(acc_ptr + row.to(tl.int64) * stride_acc_row + head * stride_acc_head
                      + splits[None, :] * HEAD_DIM + dims[:, None])  # [HEAD_DIM, NUM_SPLITS]
        m_max = m
        for _ in tl.static_range(LOG2_SPLITS):
            m_lo, m_hi = tl.split(tl.reshape(m_max, [1, m_max.shape[1] // 2, 2]))
            m_max = tl.maximum(m_lo, m_hi)
        # Split 0 always holds keys, so m_max is finite and empty splits weigh 0.
        if HAS_SINKS:  # the head's sink logit joins once, here (log2 domain)
            sink = tl.load(sinks_ptr + head) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        weight = tl.exp2(m - m_max)
        l_sum = l * weight
        o_sum = acc * weight
        for _ in tl.static_range(LOG2_SPLITS):
            l_lo, l_hi = tl.split(tl.reshape(l_sum, [1, l_sum.shape[1] // 2, 2]))
            l_sum = l_lo + l_hi
            o_lo, o_hi = tl.split(tl.reshape(o_sum, [HEAD_DIM, o_sum.shape[1] // 2, 2]))
            o_sum = o_lo + o_hi
        if HAS_SINKS:
            l_sum = l_sum + tl.exp2(sink - tl.reshape(m_max, [1, 1]))
        out = tl.reshape(o_sum, [HEAD_DIM]) / tl.reshape(l_sum, [1])
        tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty))


def num_kv_splits(num_kv_heads: int, max_model_len: int, device: torch.device,
                  tile: int = DEFAULT_TILE) -> int:
    """Splits per decode row: enough programs to fill the device at batch 1
    (PROGRAMS_PER_SM per SM over the kv heads), at most one tile each of the longest context,
    a power of two. A configuration constant: it never changes with the batch."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1
    wanted = -(-PROGRAMS_PER_SM * sms // num_kv_heads)
    cap = max(1, max_model_len // tile)
    return triton.next_power_of_2(max(1, min(wanted, cap)))


@dataclass(frozen=True)
class SplitKVScratch:
    """Partial results of the split kernel, allocated once (before any CUDA-graph capture) and
    reused by every layer and step: decode steps run layer after layer on one stream."""

    acc: torch.Tensor  # [max_rows, num_heads, num_splits, head_dim] fp32, unnormalised
    ml: torch.Tensor  # [2, max_rows, num_heads, num_splits] fp32: running max, sum of exp

    @classmethod
    def allocate(cls, max_rows: int, num_heads: int, num_splits: int, head_dim: int,
                 device: torch.device) -> SplitKVScratch:
        if num_splits & (num_splits - 1):
            raise ValueError(f"num_splits={num_splits} must be a power of two")
        return cls(torch.empty(max_rows, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=device),
                   torch.empty(2, max_rows, num_heads, num_splits, dtype=torch.float32,
                               device=device))

    @property
    def num_splits(self) -> int:
        return self.acc.shape[2]

    def fits(self, num_rows: int, num_heads: int, head_dim: int) -> bool:
        rows, heads, _, dim = self.acc.shape
        return num_rows <= rows and heads == num_heads and dim == head_dim


def split_kv_decode(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    scratch: SplitKVScratch, *, out: torch.Tensor | None = None,
                    tile: int = DEFAULT_TILE, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, q [T, H, D] -> out [T, H, D], every row one query token (or none:
    padding). Same inputs and output contract as `paged_triton.paged_attention`; `scratch`
    must hold at least `len(seq_lens)` rows. `tile` (keys per step, a power of two >= 16 on
    CUDA) is a configuration constant; `window` > 0: the last `window` keys only; `softcap`
    > 0: scores soft-capped; `sinks` [H] float32: per-head sink logits, added at the merge."""
    block_size, num_kv_heads, head_dim = _check_q_and_cache(q, kv_cache)
    num_tokens, num_heads, _ = q.shape
    num_rows = query_start_loc.shape[0] - 1
    if not scratch.fits(num_rows, num_heads, head_dim):
        raise ValueError(f"scratch {tuple(scratch.acc.shape)} does not hold {num_rows} rows "
                         f"of {num_heads} heads of dim {head_dim}")
    if tile & (tile - 1):
        raise ValueError(f"tile={tile} must be a power of two")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_rows <= 0:
        return out
    group = num_heads // num_kv_heads
    num_splits = scratch.num_splits
    acc, ml = scratch.acc, scratch.ml
    triton_kernel(_split_kv_kernel, do_not_specialize=("max_blocks", "window"))[
        (num_rows, num_kv_heads, num_splits)](
        q, kv_cache, acc, ml, query_start_loc, seq_lens, block_tables, scale * LOG2E,
        block_tables.shape[1], window, q.stride(0), q.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        acc.stride(0), acc.stride(1), ml.stride(0), ml.stride(1), ml.stride(2),
        GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=tile, LOG2_TILE=tile.bit_length() - 1,
        NUM_SPLITS=num_splits, PRECISION="ieee" if q.dtype == torch.float32 else None,
        SOFTCAP=float(softcap), ATTEND_TILE=attend_tile())
    triton_kernel(_merge_splits_kernel)[(num_rows, num_heads)](
        acc, ml, out, query_start_loc, acc if sinks is None else sinks, acc.stride(0),
        acc.stride(1), ml.stride(0), ml.stride(1), ml.stride(2), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, LOG2_SPLITS=num_splits.bit_length() - 1,
        HAS_SINKS=sinks is not None)
    return out
