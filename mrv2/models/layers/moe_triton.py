"""The Triton twin of moe.py's experts, for CUDA tensors: a fused MoE in two grouped GEMMs.

Align (`align_pairs`): the T * k token-expert pairs (pair p = token p // k, slot p % k) sorted
by expert (one stable argsort) and each expert's run padded to a multiple of BLOCK_M with the
sentinel T * k, so every M-block of `sorted_pairs` holds pairs of one expert only;
`block_experts` names it (-1: a block past the padded total). All torch ops on the device:
no host sync, no Python loop over experts; the number of blocks is a bound known from the
shapes (T * k + min(T * k, E) * (BLOCK_M - 1) padded pairs at most).

GEMM (`_grouped_gemm_kernel`, launched once per projection): one program per (M-block,
N-block) loads its block's rows of the input (row pair // TOP_K: x's token for gate/up, the
pair itself for down), walks K in BLOCK_K steps against its expert's weight tile, sums in
float32, optionally scales each row by its pair's routing weight, and stores row `pair` of the
output. Padding rows are masked out; every real pair's row is written by exactly one program
per N-block, so the outputs need no zeroing.

`fused_moe`: gate/up GEMM [T * k, 2I] (x's dtype, as F.linear rounds) -> the gated activation
(activation.py's, so its Triton twin) -> down GEMM scaled by the routing weights, kept in
float32 [T * k, H] -> summed over each token's k pairs in float32 -> x's dtype. Under expert
parallelism (`expert_start`) the pairs routed to another rank's experts go to a sentinel
expert E past the local ones, whose blocks no program computes, and their rows count 0 in the
sum. Kernels use only `tl` builtins (mrv2/platform.py), so the tests run them under the
interpreter (float32 there: the interpreter's bf16 `tl.dot` is wrong).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

# (BLOCK_M, BLOCK_N, BLOCK_K) when experts get few pairs each (decode: a 64-row block would
# be mostly padding), and when they get many (prefill).
FEW_PAIRS_BLOCKS = (16, 32, 64)
MANY_PAIRS_BLOCKS = (64, 64, 32)


def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, pair_weights_ptr, sorted_pairs_ptr,
                         block_experts_ptr, num_pairs, N, K,
                         stride_am, stride_we, stride_wn, stride_om,
                         TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the padded total: no pairs here
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs  # the sentinel (num_pairs) pads
    rows = pairs // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[:, None] * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if MUL_WEIGHT:
        scale = tl.load(pair_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [B * block_m] int32, block_experts [B] int32,
    num_padded [] int64).

    Invariants: each pair index 0..T*k-1 appears once in sorted_pairs[:num_padded], every
    other entry is the sentinel T * k; pairs are grouped by expert in ascending expert order
    (each expert's in ascending pair order), each expert's run starting on a block boundary
    and padded to a multiple of block_m; block b holds pairs of expert block_experts[b] only,
    -1 for the blocks at or past num_padded. B depends on the shapes only (no host sync)."""
    flat = ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    num_blocks = (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))  # no bincount sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = (torch.arange(num_pairs, device=device)
            - (counts.cumsum(0) - counts)[sorted_experts])  # place within its expert's run
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=device)
    sorted_pairs[(padded_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_experts = torch.searchsorted(padded_ends, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts.to(torch.int32), padded_ends[-1]


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor,
                 block_experts: torch.Tensor, top_k: int, num_pairs: int,
                 pair_weights: torch.Tensor | None, out_dtype: torch.dtype,
                 blocks: tuple[int, int, int]) -> torch.Tensor:
    """Row p of the result [num_pairs, N] = a[p // top_k] @ w[expert of p]^T (times
    pair_weights[p] when given), summed in float32; w is [E, N, K], a [*, K] with unit
    stride along K; sorted_pairs / block_experts from `align_pairs` with BLOCK_M blocks[0]."""
    block_m, block_n, block_k = blocks
    n, k = w.shape[1], w.shape[2]
    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    if num_pairs and n:
        grid = (block_experts.shape[0], triton.cdiv(n, block_n))
        triton_kernel(_grouped_gemm_kernel, do_not_specialize=("num_pairs",))[grid](
            a, w, out, pair_weights if pair_weights is not None else a, sorted_pairs,
            block_experts, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
            out.stride(0), TOP_K=top_k, MUL_WEIGHT=pair_weights is not None,
            PRECISION="ieee" if a.dtype == torch.float32 else None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def default_blocks(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the small M-block while experts average 16 pairs or
    fewer."""
    return FEW_PAIRS_BLOCKS if num_pairs <= 16 * num_experts else MANY_PAIRS_BLOCKS


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor,
              act_and_mul: Callable[[torch.Tensor], torch.Tensor],
              blocks: tuple[int, int, int] | None = None, *,
              expert_start: int | None = None) -> torch.Tensor:
    """x [T, H], experts gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj
    [E, H, I], routing weights and expert ids [T, k] -> sum over each token's k experts of
    weight * down(act_and_mul(gate_up(x))), [T, H] in x's dtype (FusedMoE.forward's result
    before the all-reduce). One dtype for x and the experts; `blocks` (BLOCK_M, BLOCK_N,
    BLOCK_K), each a power of two >= 16, default `default_blocks`. `expert_start`: the experts
    are global ids [expert_start, expert_start + E) and `ids` global (expert parallelism):
    pairs routed elsewhere add nothing; None: every id is one of these experts."""
    if x.dtype != gate_up_proj.dtype or x.dtype != down_proj.dtype:
        raise ValueError(f"x is {x.dtype}, the experts {gate_up_proj.dtype} and "
                         f"{down_proj.dtype}: one dtype expected")
    tokens, hidden = x.shape
    num_experts, top_k = gate_up_proj.shape[0], ids.shape[1]
    if gate_up_proj.shape[2] != hidden or down_proj.shape[:2] != (num_experts, hidden):
        raise ValueError(f"experts {tuple(gate_up_proj.shape)} / {tuple(down_proj.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    num_pairs = tokens * top_k
    blocks = blocks or default_blocks(num_pairs, num_experts)
    mine = None  # expert parallelism: which pairs are this rank's
    if expert_start is not None:
        local = ids - expert_start
        mine = (local >= 0) & (local < num_experts)
        ids = torch.where(mine, local, num_experts)  # the sentinel expert E: not here
    sorted_pairs, block_experts, _ = align_pairs(ids, num_experts + (mine is not None),
                                                 blocks[0])
    if mine is not None:  # the sentinel's blocks: skipped by the kernel, as past the total
        block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    gate_up = grouped_gemm(x, gate_up_proj, sorted_pairs, block_experts, top_k, num_pairs,
                           None, x.dtype, blocks)
    hidden_pairs = act_and_mul(gate_up)
    pair_weights = weights.reshape(-1)
    if not pair_weights.is_contiguous():
        pair_weights = pair_weights.contiguous()
    down = grouped_gemm(hidden_pairs, down_proj, sorted_pairs, block_experts, 1, num_pairs,
                        pair_weights, torch.float32, blocks)
    if mine is not None:  # skipped pairs' rows were never written
        down = torch.where(mine.reshape(-1, 1), down, 0.0)
    return down.view(tokens, top_k, hidden).sum(1).to(x.dtype)
