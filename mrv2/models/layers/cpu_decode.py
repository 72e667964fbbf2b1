"""One Llama decoder layer for a decode step of a few rows, as one numba call (float32, CPU).

Why: a decode step of 1-4 tokens is bound by streaming the weights (the GEMVs run at the
memory bandwidth), and what is left is per-op overhead: a layer is about fifteen torch /
numba calls (two norms, four projections, rotary twice, the KV write, attention, SiLU-and-mul)
at 3-10 us each, 0.6-1 ms of a 4 ms W3 step. Here the whole layer is one call whose parallel
parts (the projections, attention) are parallel loops inside it.

The arithmetic is the same as the module path (cpu_fused, cpu_gemv, decode_numba): RMSNorm in
float32 then the weight multiply, rotate-half rotary, SiLU(gate) * up, attention over the
paged cache after this step's K/V are written.

Used only where it applies (`applies`): CPU float32, one tensor-parallel rank, no biases, no
per-head q/k norm, every row a decode row (one token), at most MAX_ROWS rows.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from mrv2.attention.backend import TORCH, attention_backend
from mrv2.attention.decode_numba import _decode_kernel
from mrv2.models.layers.cpu_fused import _add_rms_norm, _rotary, _silu_and_mul
from mrv2.models.layers.cpu_gemv import _gemv_kernel

MAX_ROWS = 4


@njit(fastmath=True, error_model="numpy", cache=True)
def _write_kv(k, v, k_cache, v_cache, slots):
    """k/v [T, KV*D] into the flat cache slots (slot < 0: padding, skipped)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    for t in range(k.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        block, offset = slot // block_size, slot % block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                k_cache[block, offset, h, d] = k[t, h * head_dim + d]
                v_cache[block, offset, h, d] = v[t, h * head_dim + d]


@njit(fastmath=True, error_model="numpy", cache=True)
def _decode_layer(hidden, residual, ln1, ln2, eps, w_qkv, w_o, w_gate_up, w_down, cos, sin,
                  k_cache, v_cache, block_tables, seq_lens, slots, num_heads, num_kv_heads,
                  head_dim, scale, kv_per_item, out, residual_out):
    rows, hidden_size = hidden.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    normed = np.empty((rows, hidden_size), dtype=np.float32)
    _add_rms_norm(hidden, residual, ln1, eps, normed, residual_out)
    if residual.shape[0] == 0:  # first layer: the residual stream starts as the input
        residual_out[:] = hidden
    qkv = np.empty((rows, q_size + 2 * kv_size), dtype=np.float32)
    _gemv_kernel(normed, w_qkv, qkv)
    q = np.empty((rows, q_size), dtype=np.float32)
    k = np.empty((rows, kv_size), dtype=np.float32)
    _rotary(qkv[:, :q_size], cos, sin, head_dim, q)
    _rotary(qkv[:, q_size:q_size + kv_size], cos, sin, head_dim, k)
    _write_kv(k, qkv[:, q_size + kv_size:], k_cache, v_cache, slots)
    attn = np.empty((rows, num_heads, head_dim), dtype=np.float32)
    _decode_kernel(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, block_tables,
                   seq_lens, scale, attn, kv_per_item)
    o = np.empty((rows, hidden_size), dtype=np.float32)
    _gemv_kernel(attn.reshape(rows, q_size), w_o, o)
    summed = np.empty((rows, hidden_size), dtype=np.float32)
    _add_rms_norm(o, residual_out.copy(), ln2, eps, normed, summed)
    residual_out[:] = summed
    gate_up = np.empty((rows, w_gate_up.shape[0]), dtype=np.float32)
    _gemv_kernel(normed, w_gate_up, gate_up)
    act = np.empty((rows, w_gate_up.shape[0] // 2), dtype=np.float32)
    _silu_and_mul(gate_up, w_gate_up.shape[0] // 2, act)
    _gemv_kernel(act, w_down, out)


_NO_RESIDUAL = np.empty((0, 0), dtype=np.float32)


def _layer_qualifies(layer) -> bool:
    """The parts that never change: float32 CPU weights, tp 1, no biases, no q/k norm."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
               mlp.down_proj.weight, layer.input_layernorm.weight,
               layer.post_attention_layernorm.weight]
    biases = [attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias]
    return (attn.q_norm is None and attn.o_proj.tp_size == 1 and mlp.down_proj.tp_size == 1
            and all(b is None for b in biases)
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
            and all(w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
                    for w in weights))


def applies(layer, hidden: torch.Tensor, kv_cache: torch.Tensor, meta) -> bool:
    """Whether `decode_layer` computes this step of `layer`: a decode step (every row one
    token) of at most MAX_ROWS rows on the CPU (torch attention backend) in float32."""
    rows = hidden.shape[0]
    if not (0 < rows <= MAX_ROWS and meta.num_decodes == meta.num_reqs == rows
            and meta.num_actual_tokens == rows and hidden.device.type == "cpu"
            and hidden.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and not torch.is_grad_enabled()
            and attention_backend(hidden.device) == TORCH):
        return False
    qualifies = layer.__dict__.get("_cpu_decode_qualifies")
    if qualifies is None:
        qualifies = layer.__dict__["_cpu_decode_qualifies"] = _layer_qualifies(layer)
    return qualifies


def decode_layer(layer, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                 residual: torch.Tensor | None, kv_cache: torch.Tensor, meta
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`LlamaDecoderLayer.forward` for a decode step (`applies` holds): returns (the layer's
    MLP output, the residual stream before adding it)."""
    attn = layer.self_attn
    rows = hidden.shape[0]
    out = torch.empty_like(hidden)
    residual_out = torch.empty_like(hidden)
    cos, sin = cos_sin
    kv_per_item = attn.num_kv_heads if rows >= 4 else 1
    _decode_layer(
        hidden.numpy(), _NO_RESIDUAL if residual is None else residual.numpy(),
        layer.input_layernorm.weight.detach().numpy(),
        layer.post_attention_layernorm.weight.detach().numpy(),
        np.float32(layer.input_layernorm.eps),
        attn.qkv_proj.weight.detach().numpy(), attn.o_proj.weight.detach().numpy(),
        layer.mlp.gate_up_proj.weight.detach().numpy(),
        layer.mlp.down_proj.weight.detach().numpy(), cos.numpy(), sin.numpy(),
        kv_cache[0].numpy(), kv_cache[1].numpy(), meta.block_tables.numpy(),
        np.ascontiguousarray(meta.seq_lens_cpu[:rows], dtype=np.int32),
        meta.slot_mapping[:rows].numpy(), attn.num_heads, attn.num_kv_heads,
        attn.head_dim, np.float32(attn.attn.scale), kv_per_item, out.numpy(),
        residual_out.numpy())
    return out, residual_out
