"""Triton paged attention: the CUDA backend (DESIGN.md section 5).

Two kernels over one layer's KV cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`:

- `write_kv` (reshape_and_cache): grid (tokens,). Token t stores its K/V at flat slot
  `slot_mapping[t]`; a slot of -1 (graph padding, invariant 6) writes nothing.
- `paged_attention`: one flattened batch mixing decode rows and prefill chunks. Grid
  (query blocks, kv heads). A program owns up to BLOCK_Q query tokens of one row and every
  query head of one kv head (GQA): its tile is BLOCK_M = BLOCK_Q * group rows of
  (token, head). Row r's query blocks are numbered from `query_start_loc[r] // BLOCK_Q + r`,
  so `num_tokens // BLOCK_Q + num_rows` programs cover any batch of that many tokens and rows
  (each row wastes at most one partial block); a program finds its row by counting the rows
  whose first block number is <= its own. It then runs flash-attention style online softmax
  over the row's keys in tiles of TILE keys, each key's block looked up in the block table,
  causal with the cached prefix: query i of a chunk of length q in a sequence of length L sits
  at position L - q + i and sees keys 0 .. L - q + i.

Only device tensors are read, and the grid depends only on the tensors' shapes (padded token
count, padded row count, kv heads): both kernels are CUDA-graph capturable. Rows with no query
tokens (graph padding: query_start_loc entries = num_tokens, seq_lens 0) exit before reading
their seq_len's blocks. Output rows of tokens that belong to no row (padding past
`query_start_loc[-1]`) are left untouched: uninitialised when `out` is not given.

Precision: scores, softmax state and the output accumulate in fp32; fp32 inputs use IEEE
dots (no TF32); fp16/bf16 inputs round the probabilities to their dtype for the P @ V product,
as flash attention does. (Triton's interpreter computes bf16 `tl.dot` wrongly, so bf16 is
checked on CUDA only; fp16 and fp32 run under the interpreter too.)

Kernels are plain functions jitted per mode by `mrv2.platform.triton_kernel`, so tests
run them under the interpreter on CPU tensors. They use only `tl` builtins: no `tl.zeros`,
`tl.cdiv`, `tl.max` or `tl.sum` (Triton's own jitted helpers, which the interpreter cannot call
once triton was imported in compiled mode), and no combine function of our own (the interpreter
would reduce element by element in Python). A row reduction is a log2(TILE)-step tree of
`tl.reshape` + `tl.split` + `tl.maximum` / `+`; the row of a query block is found by binary
search over scalar loads.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

LOG2E = 1.4426950408889634
# Integer arguments of `_paged_attention_kernel` that change with the batch: no recompiles.
_PER_STEP_INTS = ("num_rows", "rows_pad", "log2_rows_pad", "max_blocks", "window")


def _reshape_and_cache_kernel(k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                              NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              KV_HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, KV_HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        mask = (heads < NUM_KV_HEADS)[:, None]
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = (cache_ptr + block * stride_c_block + offset * stride_c_slot
               + heads[:, None] * stride_c_head + dims[None, :])
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                    mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                    mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _attend_tile(q, m_i, l_i, acc, k_base, table_row, key_pos, key_valid, visible, max_blocks,
                 qk_scale, stride_c_kv, stride_c_block, stride_c_slot, BLOCK_M: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, LOG2_TILE: tl.constexpr,
                 PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step over the keys `key_pos` (valid where `key_valid`, seen by a
    query row where `visible`): (m_i, l_i, acc) updated. Kernels receive it as the constexpr
    ATTEND_TILE, jitted for their mode by `attend_tile()` (a global jitted helper would be
    compiled-mode only)."""
    dims = tl.arange(0, HEAD_DIM)
    block_idx = key_pos // BLOCK_SIZE
    block_id = tl.load(table_row + block_idx,
                       mask=key_valid & (block_idx < max_blocks), other=0)
    kv_offset = (block_id.to(tl.int64) * stride_c_block
                 + (key_pos % BLOCK_SIZE) * stride_c_slot)
    k = tl.load(k_base + kv_offset[None, :] + dims[:, None], mask=key_valid[None, :],
                other=0.0)  # [HEAD_DIM, TILE]
    v = tl.load(k_base + stride_c_kv + kv_offset[:, None] + dims[None, :],
                mask=key_valid[:, None], other=0.0)  # [TILE, HEAD_DIM]
    s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale
    if SOFTCAP > 0:
        # softcap * tanh(s' / softcap) of the natural-log score s' = s / LOG2E, back in the
        # exp2 domain; tanh(x) = 2 / (1 + exp(-2x)) - 1 (builtins only).
        capped = s * (1.0 / (SOFTCAP * 1.4426950408889634))
        s = (2.0 / (1.0 + tl.exp(-2.0 * capped)) - 1.0) * (SOFTCAP * 1.4426950408889634)
    s = tl.where(visible, s, float("-inf"))
    s_max = s
    for _ in tl.static_range(LOG2_TILE):
        s_lo, s_hi = tl.split(tl.reshape(s_max, [BLOCK_M, s_max.shape[1] // 2, 2]))
        s_max = tl.maximum(s_lo, s_hi)
    m_new = tl.maximum(m_i, tl.reshape(s_max, [BLOCK_M]))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    p_sum = p
    for _ in tl.static_range(LOG2_TILE):
        p_lo, p_hi = tl.split(tl.reshape(p_sum, [BLOCK_M, p_sum.shape[1] // 2, 2]))
        p_sum = p_lo + p_hi
    l_i = l_i * alpha + tl.reshape(p_sum, [BLOCK_M])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=PRECISION)
    return m_new, l_i, acc


def attend_tile() -> object:
    """`_attend_tile` jitted for the current mode (compiled or interpreted)."""
    return triton_kernel(_attend_tile)


def _paged_attention_kernel(q_ptr, cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
                            block_tables_ptr, sinks_ptr, qk_scale, num_rows, rows_pad,
                            log2_rows_pad, max_blocks, window,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                            stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                            LOG2_TILE: tl.constexpr, PRECISION: tl.constexpr,
                            SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                            ATTEND_TILE: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The row: the last one whose first query block (query_start_loc[r] // BLOCK_Q + r,
    # strictly increasing in r) is <= this one. Row 0 starts at block 0.
    row = q_block * 0
    step = rows_pad
    for _ in range(0, log2_rows_pad):
        step = step // 2
        probe = row + step
        probe_start = tl.load(query_start_loc_ptr + probe, mask=probe < num_rows, other=0)
        take = (probe < num_rows) & (probe_start // BLOCK_Q + probe <= q_block)
        row = tl.where(take, probe, row)

    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    q_first = (q_block - (q_start // BLOCK_Q + row)) * BLOCK_Q  # first query index in the row
    if q_first < q_len:
        seq_len = tl.load(seq_lens_ptr + row)
        context_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q_first + offs_m // GROUP_PAD  # query index within the row
        head_in_group = offs_m % GROUP_PAD
        m_valid = (q_idx < q_len) & (head_in_group < GROUP)
        head = kv_head * GROUP + head_in_group
        token = (q_start + q_idx).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=m_valid[:, None], other=0.0)
        query_pos = context_len + q_idx

        # Keys this block needs: up to the position of its last query token.
        last_q = tl.minimum(q_first + BLOCK_Q, q_len) - 1
        kv_len = context_len + last_q + 1
        num_tiles = (kv_len + TILE - 1) // TILE
        # A sliding window (window > 0): the tiles wholly before the first query's window
        # are skipped (they would be fully masked: an exact no-op of the online softmax).
        first_tile = 0
        if window > 0:
            first_tile = tl.maximum(context_len + q_first - window + 1, 0) // TILE

        m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        if HAS_SINKS:  # the sink's logit starts each row's softmax: exp2(0) = 1, no value
            m_i = tl.load(sinks_ptr + head, mask=m_valid, other=0.0) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        table_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        k_base = cache_ptr + kv_head * stride_c_head
        for j in range(first_tile, num_tiles):
            key_pos = j * TILE + tl.arange(0, TILE)
            key_valid = key_pos < kv_len
            if window > 0:  # not loaded: a block before every query's window may be given back
                key_valid = key_valid & (key_pos > context_len + q_first - window)
            visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
            if window > 0:
                visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
            m_i, l_i, acc = ATTEND_TILE(q, m_i, l_i, acc, k_base, table_row, key_pos, key_valid,
                                        visible, max_blocks, qk_scale, stride_c_kv,
                                        stride_c_block, stride_c_slot, BLOCK_M, HEAD_DIM,
                                        BLOCK_SIZE, LOG2_TILE, PRECISION, SOFTCAP)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows masked out of the tile
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _check(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"Triton paged attention on {x.device} tensors runs only under "
                           f"mrv2.platform.triton_interpreter()")


def _check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, value in (("block_size", block_size), ("head_dim", head_dim)):
        if value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    return block_size, num_kv_heads, head_dim


def _check_q_and_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) once q [T, H, D] and the cache fit each other."""
    _check(q)
    block_size, num_kv_heads, head_dim = _check_cache(kv_cache)
    _, num_heads, q_dim = q.shape
    if q_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {num_kv_heads} kv "
                         f"heads of dim {head_dim}")
    return block_size, num_kv_heads, head_dim


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, KV, D] at flat slots `slot_mapping` [T] (int64); slots < 0 are skipped.

    One program per token; k/v may be strided views (head_dim contiguous), cast to the
    cache's dtype.
    """
    _check(kv_cache)
    block_size, num_kv_heads, head_dim = _check_cache(kv_cache)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    triton_kernel(_reshape_and_cache_kernel)[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=block_size)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None, uniform_decode: bool = False,
                    block_m: int | None = None, tile: int | None = None,
                    window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D]; the step's K/V must already be in the cache.

    query_start_loc [R+1] int32, seq_lens [R] int32, block_tables [R, max_blocks] int32 (rows
    may be padded per invariant 6). Rows of `out` past `query_start_loc[R]` are not written.
    `uniform_decode` (every row has one query token) only picks a smaller query tile;
    `block_m` (query rows per program, a multiple of the padded GQA group) and `tile` (keys
    per step) override the tile sizes. `window` > 0: sliding-window attention (a query at p
    sees keys p - window + 1 .. p); `softcap` > 0: scores soft-capped (Gemma 2); `sinks` [H]
    float32: per-head sink logits (gpt-oss).
    """
    block_size, num_kv_heads, head_dim = _check_q_and_cache(q, kv_cache)
    num_tokens, num_heads, _ = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_rows = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_rows <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(16 if uniform_decode else 64, group_pad)
    if block_m % group_pad:
        raise ValueError(f"block_m={block_m} must be a multiple of {group_pad}")
    block_q = block_m // group_pad
    tile = 32 if tile is None else tile
    if tile & (tile - 1):
        raise ValueError(f"tile={tile} must be a power of two")
    rows_pad = triton.next_power_of_2(num_rows)
    grid = (num_tokens // block_q + num_rows, num_kv_heads)
    triton_kernel(_paged_attention_kernel, do_not_specialize=_PER_STEP_INTS)[grid](
        q, kv_cache, out, query_start_loc, seq_lens, block_tables,
        q if sinks is None else sinks, scale * LOG2E, num_rows,
        rows_pad, rows_pad.bit_length() - 1, block_tables.shape[1], window, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
        LOG2_TILE=tile.bit_length() - 1,
        PRECISION="ieee" if q.dtype == torch.float32 else None, SOFTCAP=float(softcap),
        HAS_SINKS=sinks is not None, ATTEND_TILE=attend_tile())
    return out
