"""The Triton twins of gated_delta_rule.py, for CUDA tensors: the gating, the causal depthwise
convolution and the fused recurrent gated delta rule over the varlen batch, state in place.

Every launch's grid comes from host shapes (rows, heads, channels) and every per-row value
(start, length, slot, has_initial_state) is read on the device, so no launch reads a device
tensor back and all are CUDA-graph safe. A row of length 0 (graph padding) returns at once.
Tile sizes come from head dims and channel counts (model constants), so batches never
recompile; the one per-step integer (the gating's element count) is not specialised.

- `_gating_kernel`: elementwise over the [T, Hv] gates.
- `_conv_kernel`, grid (rows, channel blocks): the row's tokens in BLOCK_T-token tiles, each
  tap a load from the row's tokens or (before its first token) the stored window; then the new
  window. Its loads of the stored window precede a barrier, its store follows it: threads of
  one program may run ahead of each other, and the window is read and written in place.
- `_delta_rule_kernel`, grid (rows, value heads, Dv blocks): the memory block [BV, Dk]
  (transposed: the sums over Dk run along the last axis) stays in registers for the whole row;
  per token: l2-normalise q and k, decay, read, delta update, output. Prefill rows run the same
  recurrence token by token (no chunked form here).

Sums are trees of public builtins (`tl.reshape`, `tl.split`, `+`), as in norm_triton.py:
`tl.sum` is a jitted helper the interpreter cannot call once Triton was imported compiled.

Numerics: float32 throughout, outputs rounded once to the output dtype; sums run in tree
order and `rsqrt` / `exp` may differ from torch's by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import triton_kernel

CONV_BLOCK_T = 8  # tokens per convolution tile
CONV_BLOCK_C = 128  # channels per convolution program
DELTA_BLOCK_V = 32  # value columns per delta-rule program
GATING_BLOCK = 256


def _gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_elements,
                   heads, a_stride, b_stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    t = offs // heads
    h = offs % heads
    x = (tl.load(a_ptr + t * a_stride + h, mask=mask, other=0.0).to(tl.float32)
         + tl.load(dt_bias_ptr + h, mask=mask, other=0.0).to(tl.float32))
    # softplus = log1p(exp(x)) (x itself above 20, as torch); log1p(u) as
    # log(1 + u) * u / ((1 + u) - 1), exact to an ulp where 1 + u rounds (Goldberg)
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * u / tl.where(w == 1.0, 1.0, w - 1.0))
    softplus = tl.where(x > 20.0, x, log1p)
    rate = -tl.exp(tl.load(a_log_ptr + h, mask=mask, other=0.0).to(tl.float32))
    tl.store(g_ptr + offs, rate * softplus, mask=mask)
    b = tl.load(b_ptr + t * b_stride + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + offs, 1.0 / (1.0 + tl.exp(-b)), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] -> (g, beta) float32 [T, Hv] (gated_delta_rule.gdn_gating)."""
    a, b = _last_dim_contiguous(a), _last_dim_contiguous(b)
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if tokens:
        kernel = triton_kernel(_gating_kernel, do_not_specialize=("num_elements",))
        kernel[(triton.cdiv(tokens * heads, GATING_BLOCK),)](
            a, b, A_log, dt_bias, g, beta, tokens * heads, heads, a.stride(0), b.stride(0),
            BLOCK=GATING_BLOCK)
    return g, beta


def _conv_kernel(x_ptr, w_ptr, bias_ptr, cs_ptr, out_ptr, qsl_ptr, idx_ptr, init_ptr,
                 channels, x_stride, out_stride, cs_slot, cs_channel, cs_pos, w_stride,
                 TAPS: tl.constexpr, WINDOW_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(qsl_ptr + row)
    length = tl.load(qsl_ptr + row + 1) - start
    if length > 0:
        width = TAPS - 1
        slot = tl.load(idx_ptr + row).to(tl.int64)
        # Entries [0, prior_end) of the stored window are read: all of them, or none for a
        # fresh request (integer masks: a scalar flag does not broadcast in the interpreter).
        prior_end = width * (tl.load(init_ptr + row) != 0).to(tl.int32)
        cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
        c_mask = cc < channels
        x_row = x_ptr + start.to(tl.int64) * x_stride + cc
        window = cs_ptr + slot * cs_slot + cc * cs_channel
        bias = tl.full([1, BLOCK_C], 0.0, dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cc, mask=c_mask, other=0.0).to(tl.float32)
        for t0 in range(0, length, BLOCK_T):
            p = t0 + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
            p_mask = (p < length) & c_mask
            acc = tl.full([BLOCK_T, BLOCK_C], 0.0, dtype=tl.float32) + bias
            for j in tl.static_range(TAPS):
                pos = (p - width + j).to(tl.int64)  # < 0: the stored window's entry width + pos
                xv = tl.load(x_row + pos * x_stride, mask=p_mask & (pos >= 0), other=0.0)
                sv = tl.load(window + (width + pos) * cs_pos,
                             mask=p_mask & (width + pos < prior_end), other=0.0)
                w = tl.load(w_ptr + cc * w_stride + j, mask=c_mask, other=0.0)
                acc += (xv.to(tl.float32) + sv) * w.to(tl.float32)
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + (start + p).to(tl.int64) * out_stride + cc,
                     acc.to(out_ptr.dtype.element_ty), mask=p_mask)
        # The new window: entry e is position length - width + e of the row's inputs.
        e = tl.arange(0, WINDOW_BLOCK)[:, None]
        pos = (length - width + e).to(tl.int64)
        e_mask = (e < width) & c_mask
        xv = tl.load(x_row + pos * x_stride, mask=e_mask & (pos >= 0), other=0.0)
        sv = tl.load(window + (width + pos) * cs_pos, mask=e_mask & (width + pos < prior_end),
                     other=0.0)
        tl.debug_barrier()  # every read of the stored window happens before it is written
        tl.store(window + e * cs_pos, xv.to(tl.float32) + sv, mask=e_mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  state_index: torch.Tensor, has_initial_state: torch.Tensor,
                  activation_silu: bool) -> torch.Tensor:
    """x [T, C] -> out [T, C] in x's dtype, conv_state updated
    (gated_delta_rule.causal_conv1d)."""
    x, weight = _last_dim_contiguous(x), _last_dim_contiguous(weight)
    channels, taps = weight.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = state_index.shape[0]
    if rows:
        triton_kernel(_conv_kernel)[(rows, triton.cdiv(channels, CONV_BLOCK_C))](
            x, weight, weight if bias is None else bias, conv_state, out, query_start_loc,
            state_index, has_initial_state, channels, x.stride(0), out.stride(0),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), weight.stride(0),
            TAPS=taps, WINDOW_BLOCK=triton.next_power_of_2(max(taps - 1, 1)),
            BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C, HAS_BIAS=bias is not None,
            SILU=activation_silu)
    return out


def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr,
                       idx_ptr, init_ptr, scale, q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st,
                       beta_st, s_slot, s_head, s_k, s_v, o_st, o_sh,
                       GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, LOG2_BK: tl.constexpr, BV: tl.constexpr,
                       L2NORM: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    if end > start:
        kh = h // GROUP
        slot = tl.load(idx_ptr + row).to(tl.int64)
        # Rows of the memory read: all, or none for a fresh request (its slot may hold
        # anything; an integer bound, as a scalar flag does not broadcast in the interpreter).
        k_read = DK * (tl.load(init_ptr + row) != 0).to(tl.int32)
        kk = tl.arange(0, BK)[None, :]  # [1, BK]
        vv = tl.program_id(2) * BV + tl.arange(0, BV)[:, None]  # [BV, 1]
        k_mask = kk < DK
        v_mask = vv < DV
        s_ptrs = state_ptr + slot * s_slot + h * s_head + kk * s_k + vv * s_v
        s = tl.load(s_ptrs, mask=(kk < k_read) & v_mask, other=0.0)  # [BV, BK]
        for i in range(0, end - start):
            t64 = start.to(tl.int64) + i  # (the interpreter's loop index is a Python int)
            qt = tl.load(q_ptr + t64 * q_st + kh * q_sh + kk, mask=k_mask, other=0.0)
            kt = tl.load(k_ptr + t64 * k_st + kh * k_sh + kk, mask=k_mask, other=0.0)
            qt, kt = qt.to(tl.float32), kt.to(tl.float32)
            if L2NORM:
                qq = qt * qt
                kq = kt * kt
                for _ in tl.static_range(LOG2_BK):
                    q_lo, q_hi = tl.split(tl.reshape(qq, [1, qq.shape[1] // 2, 2]))
                    k_lo, k_hi = tl.split(tl.reshape(kq, [1, kq.shape[1] // 2, 2]))
                    qq, kq = q_lo + q_hi, k_lo + k_hi
                qt = qt * tl.rsqrt(qq + 1e-6)
                kt = kt * tl.rsqrt(kq + 1e-6)
            qt = qt * scale
            vt = tl.load(v_ptr + t64 * v_st + h * v_sh + vv, mask=v_mask, other=0.0)
            decay = tl.exp(tl.load(g_ptr + t64 * g_st + h).to(tl.float32))
            b = tl.load(beta_ptr + t64 * beta_st + h).to(tl.float32)
            s = s * decay
            read = s * kt
            for _ in tl.static_range(LOG2_BK):
                r_lo, r_hi = tl.split(tl.reshape(read, [BV, read.shape[1] // 2, 2]))
                read = r_lo + r_hi
            delta = (vt.to(tl.float32) - tl.reshape(read, [BV, 1])) * b
            s = s + delta * kt
            o = s * qt
            for _ in tl.static_range(LOG2_BK):
                o_lo, o_hi = tl.split(tl.reshape(o, [BV, o.shape[1] // 2, 2]))
                o = o_lo + o_hi
            tl.store(out_ptr + t64 * o_st + h * o_sh + vv,
                     tl.reshape(o, [BV, 1]).to(out_ptr.dtype.element_ty), mask=v_mask)
        tl.debug_barrier()  # the memory was read before any thread writes it back
        tl.store(s_ptrs, s, mask=k_mask & v_mask)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                     state_index: torch.Tensor, has_initial_state: torch.Tensor,
                     use_qk_l2norm: bool, scale: float | None) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] -> out [T, Hv, Dv] in v's dtype, `state` updated in
    place (gated_delta_rule.gated_delta_rule)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    g, beta = _last_dim_contiguous(g), _last_dim_contiguous(beta)
    key_heads, head_k_dim = q.shape[1:]
    value_heads, head_v_dim = v.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    rows = state_index.shape[0]
    if rows:
        bk = triton.next_power_of_2(head_k_dim)
        bv = min(triton.next_power_of_2(head_v_dim), DELTA_BLOCK_V)
        grid = (rows, value_heads, triton.cdiv(head_v_dim, bv))
        triton_kernel(_delta_rule_kernel)[grid](
            q, k, v, g, beta, state, out, query_start_loc, state_index, has_initial_state,
            float(head_k_dim ** -0.5 if scale is None else scale), q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            *state.stride(), out.stride(0), out.stride(1),
            GROUP=value_heads // key_heads, DK=head_k_dim, DV=head_v_dim, BK=bk,
            LOG2_BK=bk.bit_length() - 1, BV=bv, L2NORM=bool(use_qk_l2norm),
            num_warps=4 if bk * bv >= 4096 else 2)
    return out


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
