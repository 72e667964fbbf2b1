"""The fused decode stack's kernel: a decode step of a few rows through a whole Llama-, Gemma- (2,
3, 4), OLMo 2- or Qwen3.5-layout model, token ids to final hidden states (and the LM head's
logits), as one numba call (CPU, float32 activations). decode.py decides when it runs and builds
the views it reads.

The arithmetic is the same as the module path's (norm_numba, rotary_numba, activation_numba,
cpu_gemv or quantized_numba, decode_numba): the embedding row looked up (widened or dequantized
exactly, Gemma's scaled), RMSNorm in float32 then the weight multiply (Gemma's norms hold 1 + w:
the same float32 product), rotate-half rotary (per layer: none, the global or the local table),
SiLU(gate) * up or GeLU(tanh), attention over the paged cache after this step's K/V are written
(windows, soft caps), Gemma's and OLMo 2's norms after the sublayers (OLMo 2: none before them, q/k
norms over the whole projections), Ministral 3's queries scaled by position, Gemma's capped logits;
Gemma 4's per-layer shapes (kv heads, head size, MLP width), values that are the keys (k = v) and
RMS-normalised, layers reading an earlier layer's cache (no K/V written), per-layer inputs and
output scale; Qwen3.5's gated attention (the output times sigmoid of each head's gate) and its
linear-attention layers (stack_delta_net_numba.py). Each weight is a view of stack_views_numba.py,
whose `stack_linear` and `stack_embed` compute on it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import decode_kernel
from mrv2.models.layers.activation_numba import gelu_tanh_and_mul_kernel, silu_and_mul_kernel
from mrv2.models.layers.norm_numba import NO_RESIDUAL, add_rms_norm_kernel
from mrv2.models.cpu.moe_numba import moe_block
from mrv2.models.cpu.stack_delta_net_numba import delta_net_mixer, gate_output, split_gated_query
from mrv2.models.cpu.stack_views_numba import rotary_rows, stack_embed, stack_linear
from mrv2.models.layers.rotary_numba import rotary_kernel
from mrv2.sampler.greedy_numba import (MAX_SERIAL_ROWS, greedy_argmax_kernel,
                                       greedy_argmax_serial)
from mrv2.utils.kernel_flags import FASTMATH


@njit(cache=True)
def _add_bias(out, bias):
    """out += bias per row (a [0] bias: none), after the product, as the module path adds it."""
    if bias.shape[0] > 0:
        for r in range(out.shape[0]):
            for i in range(out.shape[1]):
                out[r, i] += bias[i]


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _head_norm(x, weight, eps, rows, num_heads, head_dim):
    """Each head of `x` [rows, num_heads * head_dim] RMS-normalised by `weight` [head_dim]
    (Qwen3's q_norm / k_norm), as norm_numba computes a [rows * heads, head_dim] batch."""
    heads = np.ascontiguousarray(x).reshape(rows * num_heads, head_dim)
    out = np.empty((rows * num_heads, head_dim), dtype=np.float32)
    add_rms_norm_kernel(heads, np.empty((0, 0), dtype=np.float32), weight, eps, out, out)
    return out.reshape(rows, num_heads * head_dim)


@njit(cache=True)
def _add_streams(x, residual, out):
    """out = x + residual (or x where `residual` is [0, 0]: the stream's start), elementwise:
    the residual stream of a model without norms before its sublayers (OLMo 2)."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] + residual[r, i] if residual.shape[0] > 0 else x[r, i]


# A layer's keys and values (`kv_modes`): its own projections; the values are the key
# projection (Gemma 4's attention_k_eq_v); none, the cache read is an earlier layer's (Gemma
# 4's KV-shared layers: their cache views are their sources').
KV_OWN, KV_FROM_KEYS, KV_SHARED = 0, 1, 2


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _attention(normed, eps, w_qkv, w_o, b_qkv, b_o, q_norm, k_norm, traits, rope, window, sinks,
               cos, sin, q_scales, k_cache, v_cache, kv_mode, block_tables, seq_lens, slots,
               num_heads, num_kv_heads, head_dim, scale, kv_per_item, splits):
    """The attention sublayer's output [rows, hidden] (before any norm after it)."""
    rows, hidden_size = normed.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    gated = traits[8]  # Qwen3.5: each head's query then its output gate
    q_width = 2 * q_size if gated else q_size
    projected = q_width + kv_size * (2 if kv_mode == KV_OWN else 1 if kv_mode == KV_FROM_KEYS
                                     else 0)
    qkv = np.empty((rows, projected), dtype=np.float32)
    stack_linear(normed, w_qkv, qkv)
    _add_bias(qkv, b_qkv)
    own_kv = kv_mode != KV_SHARED
    q_in, k_in = qkv[:, :q_width], qkv[:, q_width:q_width + kv_size]
    gate = np.empty((0, 0), dtype=np.float32)
    if gated:
        q_in, gate = split_gated_query(q_in, num_heads, head_dim)
    if q_norm.shape[0] > 0 and traits[6]:  # OLMo 2: q/k norms over the whole projections
        q_in = _head_norm(q_in, q_norm, eps, rows, 1, q_size)
        k_in = _head_norm(k_in, k_norm, eps, rows, 1, kv_size)
    elif q_norm.shape[0] > 0:  # per-head q/k norms before rotary (one eps: the layer norms')
        q_in = _head_norm(q_in, q_norm, eps, rows, num_heads, head_dim)
        if own_kv:
            k_in = _head_norm(k_in, k_norm, eps, rows, num_kv_heads, head_dim)
    q = np.empty((rows, q_size), dtype=np.float32)
    k = np.empty((rows, kv_size if own_kv else 0), dtype=np.float32)
    if rope:  # 0: a NoPE layer; 1, 2: its rows of the global or local table
        rotary_kernel(q_in, cos[rope - 1], sin[rope - 1], head_dim, q)
        if own_kv:
            rotary_kernel(k_in, cos[rope - 1], sin[rope - 1], head_dim, k)
    else:  # a NoPE layer (SmolLM3)
        q[:] = q_in
        k[:] = k_in
    for r in range(q_scales.shape[0]):  # Ministral 3: the rotated queries scaled by position
        for j in range(q_size):
            q[r, j] *= q_scales[r]
    if own_kv:  # values: their projection, or (k = v) the keys' before norm and rotary
        v = qkv[:, projected - kv_size:]
        if traits[7]:  # Gemma 4: each head RMS-normalised without a weight
            v = _head_norm(v, np.ones(head_dim, dtype=np.float32), eps, rows, num_kv_heads,
                           head_dim)
        kv_numba.write_kv_kernel(k, v, k_cache, v_cache, slots)
    attn = np.empty((rows, num_heads, head_dim), dtype=np.float32)
    decode_kernel(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, block_tables,
                   seq_lens, scale, attn, kv_per_item, splits, window, traits[1], sinks)
    if gated:
        gate_output(attn.reshape(rows, q_size), gate)
    o = np.empty((rows, hidden_size), dtype=np.float32)
    stack_linear(attn.reshape(rows, q_size), w_o, o)
    _add_bias(o, b_o)
    return o


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _decode_layer(hidden, residual, ln1, ln2, eps, w_qkv, w_o, w_gate_up, w_down, biases,
                  qk_norms, post_norms, traits, rope, window, sinks, cos, sin, q_scales,
                  k_cache, v_cache, kv_mode, moe, recurrent, layer,
                  block_tables, seq_lens, slots, req_slots, num_heads, num_kv_heads, head_dim,
                  intermediate, scale, kv_per_item, splits, out, residual_out):
    rows, hidden_size = hidden.shape
    b_qkv, b_o, b_gate_up, b_down = biases
    q_norm, k_norm = qk_norms
    normed = np.empty((rows, hidden_size), dtype=np.float32)
    if ln1.shape[0] > 0:
        add_rms_norm_kernel(hidden, residual, ln1, eps, normed, residual_out)
        if residual.shape[0] == 0:  # first layer: the residual stream starts as the input
            residual_out[:] = hidden
    else:  # OLMo 2: no norm before the sublayer, whose input is the stream itself
        _add_streams(hidden, residual, residual_out)
        normed[:] = residual_out
    o = np.empty((0, 0), dtype=np.float32)
    mixes = False
    # None (a model without linear-attention layers): numba prunes the branch at compile
    # time, so such a model's stack does not compile the delta rule in.
    if recurrent is not None:
        if recurrent[0][layer]:  # a linear-attention layer (stack_delta_net_numba.py)
            mixes = True
            o = np.empty((rows, hidden_size), dtype=np.float32)
            delta_net_mixer(normed, recurrent[1][layer], recurrent[2][layer],
                            recurrent[3][layer], recurrent[4][layer], recurrent[5][layer],
                            recurrent[6][layer], recurrent[7][layer], recurrent[8][layer],
                            recurrent[9][layer], eps, recurrent[10][layer],
                            recurrent[11][layer], recurrent[12], req_slots, seq_lens, o)
    if not mixes:
        o = _attention(normed, eps, w_qkv, w_o, b_qkv, b_o, q_norm, k_norm, traits, rope,
                       window, sinks, cos, sin, q_scales, k_cache, v_cache, kv_mode,
                       block_tables, seq_lens, slots, num_heads, num_kv_heads, head_dim, scale,
                       kv_per_item, splits)
    post_attn, post_ff = post_norms
    if post_attn.shape[0] > 0:  # Gemma, OLMo 2: the attention output normalised before it joins
        o_in = o.copy()
        add_rms_norm_kernel(o_in, NO_RESIDUAL, post_attn, eps, o, o_in)
    summed = np.empty((rows, hidden_size), dtype=np.float32)
    if ln2.shape[0] > 0:
        add_rms_norm_kernel(o, residual_out.copy(), ln2, eps, normed, summed)
    else:  # OLMo 2: the MLP reads the stream itself
        _add_streams(o, residual_out, summed)
        normed[:] = summed
    residual_out[:] = summed
    if intermediate > 0:  # the dense slot: the layer's MLP, or a MoE layer's shared expert
        gate_up = np.empty((rows, 2 * intermediate), dtype=np.float32)
        stack_linear(normed, w_gate_up, gate_up)
        _add_bias(gate_up, b_gate_up)
        act = np.empty((rows, intermediate), dtype=np.float32)
        if traits[3]:
            gelu_tanh_and_mul_kernel(gate_up, intermediate, act)
        else:
            silu_and_mul_kernel(gate_up, intermediate, act)
        stack_linear(act, w_down, out)
        _add_bias(out, b_down)
    if moe[0][layer].shape[0] > 0:  # routed experts (moe_numba.py)
        routed = np.empty((rows, hidden_size), dtype=np.float32)
        moe_block(normed, moe[0][layer], moe[1][layer], moe[3][layer], moe[4][layer],
                  moe[5][layer], moe[6][layer], moe[7], moe[8], moe[9], moe[10], routed)
        if intermediate > 0:  # Qwen2-MoE: experts + sigmoid(shared_expert_gate(x)) * shared
            gate = np.empty((rows, 1), dtype=np.float32)
            stack_linear(normed, moe[2][layer], gate)
            for r in range(rows):
                shared_scale = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate[r, 0]))
                for i in range(hidden_size):
                    out[r, i] = routed[r, i] + shared_scale * out[r, i]
        else:
            out[:] = routed
    if post_ff.shape[0] > 0:  # Gemma, OLMo 2: so is the MLP's
        out_in = out.copy()
        add_rms_norm_kernel(out_in, NO_RESIDUAL, post_ff, eps, out, out_in)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _per_layer_inputs(ids, embedded, per_layer, eps, layers):
    """Gemma 4's per-layer inputs of the rows [rows, layers * size] (none: [0, 0]), as
    Gemma4Model.per_layer_inputs: the per-layer table's rows scaled by sqrt(size), plus the
    RMS-normalised projection of the scaled embeddings times hidden ** -0.5, times 2 ** -0.5.
    `per_layer`: (table, projection, its norm [size], the layers' gates, projections and
    norms)."""
    table, w_project, norm = per_layer[0], per_layer[1], per_layer[2]
    size = norm.shape[0]
    if size == 0:
        return np.empty((0, 0), dtype=np.float32)
    rows, hidden_size = embedded.shape
    looked_up = np.empty((rows, layers * size), dtype=np.float32)
    stack_embed(ids, table, looked_up)
    projected = np.empty((rows, layers * size), dtype=np.float32)
    stack_linear(embedded, w_project, projected)
    table_scale, project_scale = np.float32(np.sqrt(size)), np.float32(hidden_size ** -0.5)
    for r in range(rows):
        for j in range(layers * size):
            projected[r, j] *= project_scale
    normed = _head_norm(projected, norm, eps, rows, layers, size)
    mix = np.float32(2.0 ** -0.5)
    for r in range(rows):
        for j in range(layers * size):
            normed[r, j] = (normed[r, j] + looked_up[r, j] * table_scale) * mix
    return normed


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _mix_per_layer(hidden, pl_rows, per_layer, layer, eps):
    """hidden += norm(projection(GeLU(gate(hidden)) * the layer's per-layer input)), in place
    (Gemma4DecoderLayer's per-layer block)."""
    gates, projections, norms = per_layer[3], per_layer[4], per_layer[5]
    rows, size = hidden.shape[0], per_layer[2].shape[0]
    gate = np.empty((rows, size), dtype=np.float32)
    stack_linear(hidden, gates[layer], gate)
    gated = np.empty((rows, 2 * size), dtype=np.float32)  # [gate | input]: GeLU(gate) * input
    gated[:, :size] = gate
    gated[:, size:] = pl_rows[:, layer * size:(layer + 1) * size]
    act = np.empty((rows, size), dtype=np.float32)
    gelu_tanh_and_mul_kernel(gated, size, act)
    projected = np.empty_like(hidden)
    stack_linear(act, projections[layer], projected)
    normed = np.empty_like(hidden)
    add_rms_norm_kernel(projected, NO_RESIDUAL, norms[layer], eps, normed, projected)
    for r in range(rows):
        for j in range(hidden.shape[1]):
            hidden[r, j] += normed[r, j]


@njit(cache=True)
def _ends_run(sampled, stop_ids, stopped, tokens, column) -> bool:
    """Marks in `stopped` the rows whose `sampled` token is one of their `stop_ids`; once all
    have stopped, each row's `tokens` after `column` repeat its token, and True: the run ends."""
    every = True
    for r in range(sampled.shape[0]):
        for j in range(stop_ids.shape[1]):
            if stop_ids[r, j] == sampled[r]:
                stopped[r] = True
        every &= stopped[r]
    if every:
        for r in range(sampled.shape[0]):
            for later in range(column + 1, tokens.shape[1]):
                tokens[r, later] = sampled[r]
    return every


# decode_stack's (tokens, nan_rows, stop_ids) for a single step: no columns to fill.
ONE_STEP = (np.empty((0, 0), np.int64), np.empty(0, np.bool_), np.empty((0, 0), np.int64))


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def decode_stack(ids, w_embed, positions, cos_cache, sin_cache, ln1s, ln2s, eps, w_qkvs, w_os,
                 w_gate_ups, w_downs, biases, qk_norms, post_norms, traits, rope_layers,
                 local_cos_cache, local_sin_cache, windows, sinks, kv_groups, final_norm,
                 final_eps, kv_caches, kv_modes, layer_scalars, per_layer, moe, recurrent,
                 block_tables, seq_lens, slots, req_slots, num_heads, num_kv_heads, head_dim,
                 intermediate, scale, kv_per_item, splits, out, w_head, logits, block_size,
                 tokens, nan_rows, stop_ids, aux_layers, aux):
    """A decode step of every layer or, when `tokens` [rows, steps] has columns, a run of steps of
    the same rows.

    A step: the rows' token ids embedded, rotary tables gathered at their positions, each layer
    (writing this step's K/V into `kv_caches` at `slots` [groups, rows]), the final norm into `out`
    [rows, hidden] and, when `logits` has the rows, the LM head into it. Ids or positions outside
    their tables raise IndexError before anything is written. Layer i reads the block tables and
    slots of its KV cache group `kv_groups[i]`: `block_tables` is a tuple of the groups' [rows,
    blocks] tables. Per layer: its KV mode (`kv_modes`), kv heads, head size, MLP width and
    attention work split (arrays); Gemma 4's output scale (`layer_scalars`: [1] views, [0] for
    none) and per-layer inputs (`per_layer`, `_per_layer_inputs`; a [0] projection norm for none);
    routed experts (`moe`, stack_moe.moe_args: a [0, 0] router for a dense layer, whose MLP width
    may be 0 too); gpt-oss's attention sinks (`sinks`: [heads] per layer, [0] for none); linear-
    attention layers (`recurrent`, stack_delta_net.recurrent_args: a flag per layer, then their
    views; None for a model without them; rows find their state at `req_slots`, their requests'
    slots). EAGLE-3's streams: the stream entering layer aux_layers[j] into the columns j of `aux`
    [rows, len(aux_layers) * hidden] (the last step's in a run).

    A run: tokens[:, 0] = `ids` (the tokens the step before sampled), then for s = 1 .. steps - 1 a
    step with the LM head and the argmax of its logits (greedy_numba's: NaN read as -inf, ties to
    the lowest id) into tokens[:, s], each row's next input; nan_rows[r] = whether row r's logits
    held a NaN at any step. Its first step takes `ids` at `positions` with `seq_lens` (a step's
    prepared inputs), each later one a position further; each step's `slots` are written here from
    the tables (holding every block the run writes: the scheduler allocates them up front,
    `block_size` long); `positions` and `seq_lens` are advanced in place, `out` and `logits` hold
    the last step's. A run ends after the step where every row has sampled one of its `stop_ids`
    [rows, k] (-1 pads; sampler/run_stops.py), or before its first where `ids` are such: each row's
    later columns then repeat its last token (an id, if anything reads them).

    One function for both: a run calling a step's function would compile the stack twice."""
    rows, hidden_size = out.shape
    steps = tokens.shape[1]
    step_ids = ids.copy() if steps > 0 else ids
    run_rows = rows if steps > 0 else 0
    sampled, nans = np.empty(run_rows, np.int64), np.empty(run_rows, np.bool_)  # a run's argmax
    stopped = np.zeros(run_rows, np.bool_)
    bits = logits.view(np.int32)
    if steps > 0:
        for r in range(rows):
            tokens[r, 0], nan_rows[r] = ids[r], False
        if _ends_run(ids, stop_ids, stopped, tokens, 0):  # the step before ended every row
            return
    for s in range(1, max(steps, 2)):  # one pass for a step
        if steps > 0:
            for g in range(len(block_tables)):
                table = block_tables[g]
                for r in range(rows):
                    pos = positions[r]
                    slots[g, r] = table[r, pos // block_size] * block_size + pos % block_size
        hidden = np.empty((rows, hidden_size), dtype=np.float32)
        stack_embed(step_ids, w_embed, hidden)
        if traits[0] != 1.0:  # Gemma: scaled embeddings
            for r in range(rows):
                for j in range(hidden_size):
                    hidden[r, j] *= traits[0]
        # The rows of the global and the local (Gemma 3's windowed layers') rotary tables; a model
        # without a local table passes [0, rotary_dim] ones, and the global rows stand in.
        global_cos = rotary_rows(positions, cos_cache)
        global_sin = rotary_rows(positions, sin_cache)
        if local_cos_cache.shape[0] > 0:
            cos = (global_cos, rotary_rows(positions, local_cos_cache))
            sin = (global_sin, rotary_rows(positions, local_sin_cache))
        else:
            cos, sin = (global_cos, global_cos), (global_sin, global_sin)
        # Ministral 3: 1 + beta * log(1 + floor(position / original)) per row, in float32 as
        # transformers computes it; none (an empty array) for the other models.
        beta, original = traits[4], np.float32(traits[5])
        q_scales = np.empty(rows if beta != 0.0 else 0, dtype=np.float32)
        for r in range(q_scales.shape[0]):
            periods = np.floor(np.float32(positions[r]) / original)
            q_scales[r] = np.float32(1.0) + beta * np.log(np.float32(1.0) + periods)
        pl_rows = _per_layer_inputs(step_ids, hidden, per_layer, eps, len(w_qkvs))
        x = hidden
        residual = np.empty((0, 0), dtype=np.float32)  # the first layer starts the stream
        for i in range(len(w_qkvs)):
            for j in range(aux_layers.shape[0]):
                if aux_layers[j] == i:
                    _add_streams(x, residual, aux[:, j * hidden_size:(j + 1) * hidden_size])
            layer_out = np.empty((rows, hidden_size), dtype=np.float32)
            residual_out = np.empty((rows, hidden_size), dtype=np.float32)
            kv, group = kv_caches[i], kv_groups[i]
            layer_biases = (biases[0][i], biases[1][i], biases[2][i], biases[3][i])
            _decode_layer(x, residual, ln1s[i], ln2s[i], eps, w_qkvs[i], w_os[i], w_gate_ups[i],
                          w_downs[i], layer_biases, (qk_norms[0][i], qk_norms[1][i]),
                          (post_norms[0][i], post_norms[1][i]), traits, rope_layers[i],
                          windows[i], sinks[i], cos, sin, q_scales, kv[0], kv[1], kv_modes[i], moe,
                          recurrent, i, block_tables[group], seq_lens, slots[group], req_slots,
                          num_heads, num_kv_heads[i], head_dim[i], intermediate[i], scale,
                          kv_per_item[i], splits[i], layer_out, residual_out)
            x, residual = layer_out, residual_out
            if layer_scalars[i].shape[0] > 0:  # Gemma 4: the stream itself, mixed and scaled
                _add_streams(layer_out, residual_out, layer_out)
                if pl_rows.shape[0] > 0:
                    _mix_per_layer(layer_out, pl_rows, per_layer, i, eps)
                for r in range(rows):
                    for j in range(hidden_size):
                        layer_out[r, j] *= layer_scalars[i][0]
                residual = np.empty((0, 0), dtype=np.float32)
        summed = np.empty((rows, hidden_size), dtype=np.float32)
        add_rms_norm_kernel(x, residual, final_norm, final_eps, out, summed)
        if logits.shape[0] == rows:  # the LM head's rows: every decode row is sampled
            stack_linear(out, w_head, logits)
            if traits[2] > 0.0:  # Gemma 2: final logits soft-capped
                cap = traits[2]
                for r in range(rows):
                    for j in range(logits.shape[1]):
                        logits[r, j] = np.tanh(logits[r, j] / cap) * cap
        if steps == 0:
            return
        if rows <= MAX_SERIAL_ROWS:
            greedy_argmax_serial(bits, sampled, nans)
        else:
            greedy_argmax_kernel(bits, sampled, nans)
        for r in range(rows):
            tokens[r, s] = step_ids[r] = sampled[r]
            nan_rows[r] |= nans[r]
            positions[r] += 1
            seq_lens[r] += 1
        if _ends_run(sampled, stop_ids, stopped, tokens, s):
            return
