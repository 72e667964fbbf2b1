"""The fused decode stack's linear-attention layers (Gated DeltaNet: Qwen3.5's, Qwen3-Next's)
and their models' gated attention's output gate: what decode_stack_numba.py runs in place of
attention for a layer that mixes tokens with a gated delta rule, on decode rows (one token
each).

The arithmetic is the module path's (models/qwen3_next.py `GatedDeltaNet`): the four input
projections (q, k and v side by side; z; b; a; Qwen3-Next's two grouped ones regrouped so),
the causal convolution with SiLU and the gating, q and k l2-normalised, the delta rule on the
row's slot of the layer's state, each value head RMS-normalised by the norm's weight and gated
by SiLU(z), out_proj; the convolution, gating and delta-rule kernels are
gated_delta_rule_numba's, called on the same arrays. A row continues its slot's state when its
request computed tokens before this step (seq_len > 1 for a one-token row), else it starts
from zeros, as the module path's `rows_with_context`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mrv2.models.cpu.stack_views_numba import stack_linear
from mrv2.models.layers.gated_delta_rule_numba import (NO_BIAS, conv_kernel, delta_rule_kernel,
                                                       gating_kernel, normalise_qk_kernel)
from mrv2.models.layers.norm_numba import NO_RESIDUAL, add_rms_norm_kernel
from mrv2.utils.kernel_flags import FASTMATH

# `dims` of a model's linear-attention layers: key heads, value heads, key head size, value
# head size (this rank's; the stack runs one rank), whether the projections are grouped.
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, GROUPED = 0, 1, 2, 3, 4


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def split_gated_query(q_gate, num_heads, head_dim):
    """(queries, gates) [rows, heads * head_dim] from the gated attention's q projection
    [rows, heads * 2 * head_dim], each head's query then its gate."""
    rows = q_gate.shape[0]
    q = np.empty((rows, num_heads * head_dim), dtype=np.float32)
    gate = np.empty((rows, num_heads * head_dim), dtype=np.float32)
    for r in range(rows):
        for h in range(num_heads):
            for d in range(head_dim):
                q[r, h * head_dim + d] = q_gate[r, h * 2 * head_dim + d]
                gate[r, h * head_dim + d] = q_gate[r, h * 2 * head_dim + head_dim + d]
    return q, gate


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def gate_output(attn, gate):
    """attn *= sigmoid(gate), elementwise over [rows, width] (the gated attention's output
    before o_proj)."""
    for r in range(attn.shape[0]):
        for j in range(attn.shape[1]):
            attn[r, j] *= _sigmoid(gate[r, j])


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _ungroup(qkvz, ba, key_heads, key_dim, group, value_dim, mixed_in, z, b, a):
    """Qwen3-Next's grouped projections (per key head: q, k, its value heads' v, their z;
    then their b, their a) as Qwen3.5's: q, k and v of every head side by side, z, b, a."""
    key, per_v = key_heads * key_dim, group * value_dim
    per_head = 2 * key_dim + 2 * per_v
    for r in range(qkvz.shape[0]):
        for h in range(key_heads):
            at = h * per_head
            for d in range(key_dim):
                mixed_in[r, h * key_dim + d] = qkvz[r, at + d]
                mixed_in[r, key + h * key_dim + d] = qkvz[r, at + key_dim + d]
            for d in range(per_v):
                mixed_in[r, 2 * key + h * per_v + d] = qkvz[r, at + 2 * key_dim + d]
                z[r, h * per_v + d] = qkvz[r, at + 2 * key_dim + per_v + d]
            for g in range(group):
                b[r, h * group + g] = ba[r, 2 * h * group + g]
                a[r, h * group + g] = ba[r, 2 * h * group + group + g]


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def delta_net_mixer(normed, w_qkv, w_z, w_b, w_a, w_out, conv_weight, A_log, dt_bias,
                    norm_weight, eps, conv_state, memory, dims, req_slots, seq_lens, out):
    """out [rows, hidden] = the layer's token mixing of `normed` [rows, hidden] (one token
    per row), the rows' slots (`req_slots`) of `conv_state` [slots, C, K - 1] and `memory`
    [slots, Hv, Dk, Dv] updated in place."""
    rows = normed.shape[0]
    key_heads, value_heads = dims[KEY_HEADS], dims[VALUE_HEADS]
    key_dim, value_dim = dims[KEY_DIM], dims[VALUE_DIM]
    key, value = key_heads * key_dim, value_heads * value_dim
    channels = 2 * key + value
    mixed_in = np.empty((rows, channels), dtype=np.float32)
    z = np.empty((rows, value), dtype=np.float32)
    b = np.empty((rows, value_heads), dtype=np.float32)
    a = np.empty((rows, value_heads), dtype=np.float32)
    if dims[GROUPED]:  # Qwen3-Next: w_qkv is in_proj_qkvz, w_b in_proj_ba (w_z, w_a none)
        qkvz = np.empty((rows, channels + value), dtype=np.float32)
        stack_linear(normed, w_qkv, qkvz)
        ba = np.empty((rows, 2 * value_heads), dtype=np.float32)
        stack_linear(normed, w_b, ba)
        _ungroup(qkvz, ba, key_heads, key_dim, value_heads // key_heads, value_dim, mixed_in,
                 z, b, a)
    else:
        stack_linear(normed, w_qkv, mixed_in)
        stack_linear(normed, w_z, z)
        stack_linear(normed, w_b, b)
        stack_linear(normed, w_a, a)
    starts = np.arange(rows + 1).astype(np.int32)
    state_index = req_slots  # int32, one per row (stack_args.request_slots)
    continues = np.empty(rows, dtype=np.bool_)
    for r in range(rows):
        continues[r] = seq_lens[r] > 1
    mixed = np.empty((rows, channels), dtype=np.float32)
    conv_kernel(mixed_in, np.ascontiguousarray(conv_weight.T), NO_BIAS, conv_state, starts,
                state_index, continues, True, mixed)
    g = np.empty((rows, value_heads), dtype=np.float32)
    beta = np.empty((rows, value_heads), dtype=np.float32)
    gating_kernel(a, b, A_log, dt_bias, g, beta)
    q = np.ascontiguousarray(mixed[:, :key]).reshape(rows, key_heads, key_dim)
    k = np.ascontiguousarray(mixed[:, key:2 * key]).reshape(rows, key_heads, key_dim)
    v = np.ascontiguousarray(mixed[:, 2 * key:]).reshape(rows, value_heads, value_dim)
    qn = np.empty_like(q)
    kn = np.empty_like(k)
    normalise_qk_kernel(q, k, True, np.float32(key_dim ** -0.5), qn, kn)
    core = np.empty((rows, value_heads, value_dim), dtype=np.float32)
    delta_rule_kernel(qn, kn, v, g, beta, memory, starts, state_index, continues, core)
    # The gated norm: weight * norm(head), times SiLU(z) (GatedRMSNorm's order).
    heads = core.reshape(rows * value_heads, value_dim)
    normalised = np.empty((rows * value_heads, value_dim), dtype=np.float32)
    add_rms_norm_kernel(heads, NO_RESIDUAL, norm_weight, eps, normalised, normalised)
    gated = normalised.reshape(rows, value)
    for r in range(rows):
        for j in range(value):
            gated[r, j] *= z[r, j] * _sigmoid(z[r, j])
    stack_linear(gated, w_out, out)
