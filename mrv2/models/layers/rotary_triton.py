"""The Triton twin of rotary.py's `apply_rotary_qk`, for CUDA tensors: rotary (rotate-half
layout) on q and k in one launch, optionally after a per-head RMSNorm of each (Qwen3's q_norm
and k_norm).

Grid (T, 2): program (t, 0) rotates token t's q heads, (t, 1) its k heads, each as one
[heads, head_dim / 2] tile per half. q and k may be strided views (the fused qkv output): rows
are read through their row strides, heads are contiguous within a row. Tile sizes come from the
head counts and head_dim (model constants), the token count from the grid, so batches never
recompile.

Numerics: the torch path's order, every intermediate the torch ops round rounded to the
activation dtype (normalised head, weight product, x * cos, rotate_half(x) * sin, their sum);
the sum of squares runs in another order and `rsqrt` may differ from torch's by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel


def _rotary_qk_kernel(q_ptr, q_stride, k_ptr, k_stride, q_out_ptr, k_out_ptr, cos_ptr,
                      cos_stride, sin_ptr, sin_stride, q_weight_ptr, k_weight_ptr,
                      num_q_heads, num_k_heads, eps,
                      HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
                      HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
                      LOG2_HALF_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        src, stride, dst, weight_ptr, num_heads = q_ptr, q_stride, q_out_ptr, q_weight_ptr, \
            num_q_heads
    else:
        src, stride, dst, weight_ptr, num_heads = k_ptr, k_stride, k_out_ptr, k_weight_ptr, \
            num_k_heads
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    col_mask = cols < HALF
    mask = (heads < num_heads) & col_mask
    offs = heads * HEAD_DIM + cols
    dtype = dst.dtype.element_ty
    x1 = tl.load(src + token * stride + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + token * stride + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        total = x1 * x1 + x2 * x2  # a tree sum, as in norm_triton.py
        for _ in tl.static_range(LOG2_HALF_BLOCK):
            lo, hi = tl.split(tl.reshape(total, [HEADS_BLOCK, total.shape[1] // 2, 2]))
            total = lo + hi
        inv = tl.rsqrt(tl.reshape(total, [HEADS_BLOCK, 1]) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + cols + HALF, mask=col_mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * cos_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * cos_stride + cols + HALF, mask=col_mask,
                   other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * sin_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * sin_stride + cols + HALF, mask=col_mask,
                   other=0.0).to(tl.float32)
    out1 = ((x1 * cos1).to(dtype).to(tl.float32)
            - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32)
            + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    out_row = dst + token * num_heads * HEAD_DIM
    tl.store(out_row + offs, out1, mask=mask)
    tl.store(out_row + offs + HALF, out2, mask=mask)


def _contiguous_heads(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    head_dim: int, q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H*D], k [T, KV*D], cos/sin [T, R] -> rotated (q, k), contiguous, in q's dtype:
    each head's first R dims rotated, the rest passed through (partial rotary); with norm
    weights [D] (R = D only), each head is RMS-normalised (eps) before rotary."""
    q, k = _contiguous_heads(q), _contiguous_heads(k)
    cos, sin = _contiguous_heads(cos), _contiguous_heads(sin)
    num_tokens = q.shape[0]
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    rot = cos.shape[-1]
    has_norm = q_norm_weight is not None
    if has_norm and rot != head_dim:
        raise ValueError("the fused q/k norm needs full rotary: normalise first "
                         "(rotary.apply_rotary_qk does)")
    # The kernel writes the rotary dims: the pass-through ones start as copies.
    q_out = (torch.empty(q.shape, dtype=q.dtype, device=q.device) if rot == head_dim
             else q.clone(memory_format=torch.contiguous_format))
    k_out = (torch.empty(k.shape, dtype=q.dtype, device=q.device) if rot == head_dim
             else k.to(q.dtype, copy=True).contiguous())
    if num_tokens:
        heads_block = triton.next_power_of_2(max(num_q_heads, num_k_heads))
        half_block = triton.next_power_of_2(rot // 2)
        # Head counts are model constants, but a count of 1 (one kv head per rank) would be
        # specialised to a constexpr and no longer share a type with the other branch's count.
        kernel = triton_kernel(_rotary_qk_kernel, do_not_specialize=("num_q_heads",
                                                                     "num_k_heads"))
        kernel[(num_tokens, 2)](
            q, q.stride(0), k, k.stride(0), q_out, k_out, cos, cos.stride(0), sin,
            sin.stride(0), q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
            num_q_heads, num_k_heads, eps, HALF=rot // 2, HEAD_DIM=head_dim, HAS_NORM=has_norm,
            HEADS_BLOCK=heads_block, HALF_BLOCK=half_block,
            LOG2_HALF_BLOCK=half_block.bit_length() - 1,
            num_warps=min(max(heads_block * half_block // 512, 1), 8))
    return q_out, k_out
