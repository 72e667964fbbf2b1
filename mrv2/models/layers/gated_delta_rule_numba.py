"""The numba twins of gated_delta_rule.py (float32 CPU tensors): the gating, the causal
depthwise convolution and the gated delta rule over the varlen batch, state in place.

Delta rule algorithm: the recurrent form for every row length, in parallel over (row, value
head). Why not the chunked form: it does as many multiply-adds per token against the memory
(~6 Dk Dv, against ~5 here) and wins only where its products run on matrix units (GPU tensor
cores, BLAS); here every step is a Dv-inner loop over the task's C-contiguous memory S
[Dk, Dv] (in place in the state tensor) that vectorises without reordering any sum, and one
pass over S per token does token t's update and output and token t + 1's decay and read:
    s = S[i, j] + k_t[i] delta_t[j];  out_t[j] += s q_t[i];  s *= exp(g_{t+1});
    read_{t+1}[j] += s k_{t+1}[i];  S[i, j] = s
(delta_t = beta_t (v_t - read_t)); the row's first decay and read take one pass before.
q and k are l2-normalised (q also scaled) once per token and key head, before the tasks.

Numerics: float32; each sum runs in the order written (kernel_flags.FASTMATH allows no
reassociation), a few float32 ulps from torch's. A slot whose request starts from scratch is
zeroed, never read (stale data may hold anything, NaN included).

Few compiled signatures: every array is passed C-contiguous (inputs copied when they are
strided views), index arrays as int32, flags as bools.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from mrv2.models.layers.numba_exp import exp32
from mrv2.models.layers.numba_rows import NUMBA_OPTIONS

_SOFTPLUS_THRESHOLD = np.float32(20.0)  # torch's softplus: x itself above it
_L2NORM_EPS = np.float32(1e-6)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _i32(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().numpy()
    return np.ascontiguousarray(t, dtype=np.int32)


def _flags(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.bool_)


# ---------------------------------------------------------------------------- gating


@njit(**NUMBA_OPTIONS)
def gating_kernel(a, b, A_log, dt_bias, g, beta):
    tokens, heads = a.shape
    for h in range(heads):
        rate = -np.exp(A_log[h])
        for t in range(tokens):
            x = a[t, h] + dt_bias[h]
            softplus = x if x > _SOFTPLUS_THRESHOLD else np.log1p(np.exp(x))
            g[t, h] = rate * softplus
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + exp32(-b[t, h]))


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] -> (g, beta) float32 [T, Hv] (gated_delta_rule.gdn_gating)."""
    g = torch.empty(a.shape, dtype=torch.float32)
    beta = torch.empty(a.shape, dtype=torch.float32)
    gating_kernel(_f32(a), _f32(b), _f32(A_log), _f32(dt_bias), g.numpy(), beta.numpy())
    return g, beta


# ---------------------------------------------------------------------------- convolution


@njit(parallel=True, **NUMBA_OPTIONS)
def conv_kernel(x, weight_t, bias, conv_state, starts, state_index, has_initial_state, silu,
                out):
    """weight_t [K, C] (the weight transposed: every loop runs over contiguous channels);
    a [0] `bias` means none. Outputs in parallel over tokens, then the new windows (serial:
    K - 1 entries a row, and one parallel region compiles faster than two), once every
    output has read the prior windows."""
    tokens, channels = x.shape
    taps = weight_t.shape[0]
    width = taps - 1
    rows = starts.shape[0] - 1
    token_row = np.full(tokens, -1, dtype=np.int64)  # -1: past the last row (left zero)
    for r in range(rows):
        for t in range(starts[r], starts[r + 1]):
            token_row[t] = r
    for t in prange(tokens):
        r = token_row[t]
        o = out[t]
        for c in range(channels):
            o[c] = bias[c] if bias.shape[0] > 0 else np.float32(0.0)
        if r >= 0:
            start = starts[r]
            for j in range(taps):
                pos = t - start - width + j  # < 0: the prior window's entry width + pos
                w = weight_t[j]
                if pos >= 0:
                    xs = x[start + pos]
                    for c in range(channels):
                        o[c] += w[c] * xs[c]
                elif has_initial_state[r]:
                    prior = conv_state[state_index[r]]
                    for c in range(channels):
                        o[c] += w[c] * prior[c, width + pos]
            if silu:
                for c in range(channels):
                    o[c] = o[c] / (np.float32(1.0) + exp32(-o[c]))
    for r in range(rows):
        start = starts[r]
        length = starts[r + 1] - start
        if length > 0:
            window = conv_state[state_index[r]]
            # Entry e in ascending order: it reads entry length + e > e of the prior window,
            # which no earlier write touched.
            for e in range(width):
                pos = length - width + e
                for c in range(channels):
                    if pos >= 0:
                        window[c, e] = x[start + pos, c]
                    elif has_initial_state[r]:
                        window[c, e] = window[c, length + e]
                    else:
                        window[c, e] = np.float32(0.0)


NO_BIAS = np.empty(0, dtype=np.float32)  # a [0] bias: none


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, query_start_loc_np: np.ndarray,
                  state_index: torch.Tensor, has_initial_state: torch.Tensor,
                  activation_silu: bool) -> torch.Tensor:
    """x [T, C] -> out [T, C] float32, conv_state updated (gated_delta_rule.causal_conv1d).
    `conv_state` must be C-contiguous (written through its numpy view)."""
    if not conv_state.is_contiguous():
        raise ValueError("the numba convolution updates a C-contiguous conv_state only")
    out = torch.empty(x.shape, dtype=torch.float32)
    conv_kernel(_f32(x), _f32(weight.t()), NO_BIAS if bias is None else _f32(bias),
                conv_state.detach().numpy(), _i32(query_start_loc_np), _i32(state_index),
                _flags(has_initial_state), bool(activation_silu), out.numpy())
    return out


# ---------------------------------------------------------------------------- delta rule


@njit(**NUMBA_OPTIONS)
def normalise_qk_kernel(q, k, use_l2norm, scale, q_out, k_out):
    """q_out = scale * l2norm(q), k_out = l2norm(k) (or without the norms), per token and key
    head. Serial: one pass over q and k, next to the delta rule's Dv passes per token."""
    tokens, heads, dim = q.shape
    for task in range(tokens * heads):
        t = task // heads
        h = task % heads
        q_scale = scale
        k_scale = np.float32(1.0)
        if use_l2norm:
            q_sum = np.float32(0.0)
            k_sum = np.float32(0.0)
            for i in range(dim):
                q_sum += q[t, h, i] * q[t, h, i]
                k_sum += k[t, h, i] * k[t, h, i]
            q_scale = scale / np.sqrt(q_sum + _L2NORM_EPS)
            k_scale = np.float32(1.0) / np.sqrt(k_sum + _L2NORM_EPS)
        for i in range(dim):
            q_out[t, h, i] = q[t, h, i] * q_scale
            k_out[t, h, i] = k[t, h, i] * k_scale


@njit(**NUMBA_OPTIONS)
def _token_pass(s, k_t, q_t, k_next, delta, decay, acc, read):
    """One pass over the memory s [Dk, Dv]: token t's update and output (acc = S^T q_t),
    then token t + 1's decay and read (read = S^T k_next). Two rows of s per inner loop: the
    sums still run over i in order, and acc / read are loaded and stored half as often."""
    head_k_dim, head_v_dim = s.shape
    for j in range(head_v_dim):
        acc[j] = np.float32(0.0)
        read[j] = np.float32(0.0)
    i = 0
    while i + 1 < head_k_dim:
        k0, k1, q0, q1 = k_t[i], k_t[i + 1], q_t[i], q_t[i + 1]
        n0, n1 = k_next[i], k_next[i + 1]
        for j in range(head_v_dim):
            x0 = s[i, j] + k0 * delta[j]
            x1 = s[i + 1, j] + k1 * delta[j]
            acc[j] = acc[j] + x0 * q0 + x1 * q1
            x0 *= decay
            x1 *= decay
            read[j] = read[j] + x0 * n0 + x1 * n1
            s[i, j] = x0
            s[i + 1, j] = x1
        i += 2
    if i < head_k_dim:  # odd Dk: the last row alone
        for j in range(head_v_dim):
            x0 = s[i, j] + k_t[i] * delta[j]
            acc[j] += x0 * q_t[i]
            x0 *= decay
            read[j] += x0 * k_next[i]
            s[i, j] = x0


@njit(parallel=True, **NUMBA_OPTIONS)
def delta_rule_kernel(q, k, v, g, beta, state, starts, state_index, has_initial_state, out):
    """q, k: normalised [T, Hk, Dk]; one task per (row, value head)."""
    key_heads, head_k_dim = q.shape[1], q.shape[2]
    value_heads, head_v_dim = v.shape[1], v.shape[2]
    group = value_heads // key_heads
    for task in prange((starts.shape[0] - 1) * value_heads):
        r = task // value_heads
        h = task % value_heads
        start = starts[r]
        end = starts[r + 1]
        if end > start:
            kh = h // group
            s = state[state_index[r], h]  # [Dk, Dv], C-contiguous: the loops vectorise
            read = np.zeros(head_v_dim, dtype=np.float32)
            delta = np.empty(head_v_dim, dtype=np.float32)
            if has_initial_state[r]:  # the first token's decay and read
                decay = np.exp(g[start, h])
                for i in range(head_k_dim):
                    ki = k[start, kh, i]
                    for j in range(head_v_dim):
                        x = s[i, j] * decay
                        s[i, j] = x
                        read[j] += x * ki
            else:  # stale slot: zeros, and the first read is zero
                s[:, :] = np.float32(0.0)
            for t in range(start, end):
                b = beta[t, h]
                for j in range(head_v_dim):
                    delta[j] = (v[t, h, j] - read[j]) * b
                # Token t + 1's decay and read ride along (none after the last token).
                last = t + 1 == end
                nxt = t if last else t + 1
                decay = np.float32(1.0) if last else np.exp(g[nxt, h])
                _token_pass(s, k[t, kh], q[t, kh], k[nxt, kh], delta, decay, out[t, h], read)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, query_start_loc_np: np.ndarray,
                     state_index: torch.Tensor, has_initial_state: torch.Tensor,
                     use_qk_l2norm: bool, scale: float | None) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] -> out [T, Hv, Dv] float32, `state` updated in place
    (gated_delta_rule.gated_delta_rule). `state` must be C-contiguous (written through its
    numpy view)."""
    head_k_dim = q.shape[-1]
    qn = np.empty(q.shape, dtype=np.float32)
    kn = np.empty(k.shape, dtype=np.float32)
    normalise_qk_kernel(_f32(q), _f32(k), bool(use_qk_l2norm),
                        np.float32(head_k_dim ** -0.5 if scale is None else scale), qn, kn)
    out = torch.empty(v.shape, dtype=torch.float32)
    if not state.is_contiguous():
        raise ValueError("the numba delta rule updates a C-contiguous state only")
    delta_rule_kernel(qn, kn, _f32(v), _f32(g), _f32(beta), state.detach().numpy(),
                      _i32(query_start_loc_np), _i32(state_index), _flags(has_initial_state),
                      out.numpy())
    return out
