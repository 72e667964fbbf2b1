"""Triton kernel for the logprobs pass (logprobs.py holds the torch reference).

One program per (batch row, vocab block) writes the block's maximum, its sum of
``exp(x - block max)`` and how many of its tokens have a logit >= the sampled token's; torch
combines the blocks (``[B, num_blocks]`` each) into logsumexp and rank, and ``torch.topk``
finds the top-k. Nothing ``[B, V]``-sized is allocated. Ranks are exact (the same float
comparisons as torch); logsumexp agrees within float tolerance (a blockwise sum).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from mrv2.sampler.logprobs import LogprobsTensors
from mrv2.platform import triton_kernel


def _logprobs_kernel(src_ptr, src_stride, sampled_ptr, block_max_ptr, block_sum_ptr,
                     block_count_ptr, num_blocks, vocab_size, BLOCK: tl.constexpr,
                     LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    src_row = src_ptr + row * src_stride
    x = tl.load(src_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    chosen = tl.load(src_row + tl.load(sampled_ptr + row)).to(tl.float32)
    # Trees of public builtins, not tl.max / tl.sum (see noise_triton.py).
    best = tl.reshape(x, [1, BLOCK])
    for _ in tl.static_range(LOG2_BLOCK):
        lo, hi = tl.split(tl.reshape(best, [1, best.shape[1] // 2, 2]))
        best = tl.maximum(lo, hi)
    # A block of -inf only (filtered tokens) has sum 0; subtract 0 instead of -inf.
    shift = tl.where(best == float("-inf"), 0.0, best)
    total = tl.exp(tl.reshape(x, [1, BLOCK]) - shift)
    count = tl.reshape(((x >= chosen) & mask).to(tl.int32), [1, BLOCK])
    for _ in tl.static_range(LOG2_BLOCK):
        lo, hi = tl.split(tl.reshape(total, [1, total.shape[1] // 2, 2]))
        total = lo + hi
        lo_c, hi_c = tl.split(tl.reshape(count, [1, count.shape[1] // 2, 2]))
        count = lo_c + hi_c
    out = row * num_blocks + block + tl.arange(0, 1)
    tl.store(block_max_ptr + out, tl.reshape(best, [1]))
    tl.store(block_sum_ptr + out, tl.reshape(total, [1]))
    tl.store(block_count_ptr + out, tl.reshape(count, [1]))


def compute_logprobs_triton(source: Tensor, sampled: Tensor, num_topk: int, *,
                            as_logits: bool = False, block: int = 4096) -> LogprobsTensors:
    """Same result as ``logprobs.compute_logprobs`` (see there), without [B, V] temporaries."""
    num_rows, vocab_size = source.shape
    assert source.stride(1) == 1, "logprobs source rows must be contiguous"
    sampled = sampled.long()
    num_blocks = (vocab_size + block - 1) // block
    block_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=source.device)
    block_sum = torch.empty_like(block_max)
    block_count = torch.empty(num_rows, num_blocks, dtype=torch.int32, device=source.device)
    if num_rows:
        triton_kernel(_logprobs_kernel, do_not_specialize=("src_stride",))[(num_rows, num_blocks)](
            source, source.stride(0), sampled, block_max, block_sum, block_count, num_blocks,
            vocab_size, BLOCK=block, LOG2_BLOCK=block.bit_length() - 1)
    ranks = block_count.sum(dim=1, dtype=torch.int64)
    chosen = source.gather(1, sampled.unsqueeze(1)).float()
    ids = sampled.unsqueeze(1)
    values = chosen
    if num_topk > 0:
        top_values, top_ids = source.topk(num_topk, dim=-1)
        values = torch.cat([chosen, top_values.float()], dim=1)
        ids = torch.cat([ids, top_ids], dim=1)
    if not as_logits:
        row_max = block_max.amax(dim=1, keepdim=True)
        lse = row_max + (block_sum * (block_max - row_max).exp()).sum(1, keepdim=True).log()
        values = values - lse
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)
