"""Decode steps of a bfloat16 model on a CPU with bfloat16 matrix units, from
`quantized.MIN_NATIVE_HALF_ROWS` rows (where its linears move to oneDNN) up to
`MAX_NATIVE_DECODE_ROWS`: per layer the four projections on oneDNN and one numba call between
each pair, over bfloat16 activations.

Why: the fused stack (decode.py) cannot call oneDNN, so from these rows on the layer path ran
the step, op by op: per layer about fifteen torch and numba calls, module dispatch, and a
float32 round trip of every linear's input and output (`cpu_linear.native_16bit_linear` rounds
x to bfloat16 and widens its output). Here each numba segment reads the bfloat16 output of the
linear before it and writes the bfloat16 input of the linear after it:

    norm:      residual += widen(previous down output); RMSNorm; round to bfloat16
    qkv_proj   (oneDNN)
    attention: widen qkv; rotary on q and k; the K/V write; attention; round to bfloat16
    o_proj     (oneDNN)
    norm:      residual += widen(o); RMSNorm; round to bfloat16
    gate_up    (oneDNN)
    SiLU-and-mul on bfloat16 (activation_numba)
    down_proj  (oneDNN)

then the final norm after the last layer. The arithmetic is the layer path's kernels
(norm_numba, rotary_numba, kv_numba, decode_numba) with the same roundings in the same places:
the result is the layer path's bit for bit (tested).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit

from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import decode_kernel, step_kv_bytes, work_split
from mrv2.attention.paged_torch import NUMBA_WRITE_MAX_TOKENS
from mrv2.models.cpu.quantized_weights import bfloat16_weight
from mrv2.models.layers import activation_numba, cpu_linear, quantized
from mrv2.models.layers.norm_numba import NO_RESIDUAL, add_rms_norm_kernel
from mrv2.models.layers.numba_rows import NUMBA_OPTIONS, SERIAL_MAX_ROWS
from mrv2.models.layers.rotary_numba import rotary_kernel
from mrv2.models.layers.vector_ir import bf16_bits_to_float, float_to_bf16_bits, half_bits

# The most rows this path runs: the layer path's KV write and norms take the same serial
# kernels up to here (beyond, other kernels with their own summation orders).
MAX_NATIVE_DECODE_ROWS = min(NUMBA_WRITE_MAX_TOKENS, SERIAL_MAX_ROWS)


@njit(**NUMBA_OPTIONS)
def _widen_rows(bits, out):
    for r in range(bits.shape[0]):
        for i in range(bits.shape[1]):
            out[r, i] = bf16_bits_to_float(bits[r, i])


@njit(**NUMBA_OPTIONS)
def _narrow_rows(x, bits):
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            bits[r, i] = float_to_bf16_bits(x[r, i])


@njit(**NUMBA_OPTIONS)
def _norm_segment(x, residual, weight, eps, normed, residual_out, x_bits):
    """residual_out = x + residual (a [0, 0] residual: none), normed = weight *
    norm(residual_out) and its bfloat16 bits into x_bits; float32 x [rows, hidden]."""
    add_rms_norm_kernel(x, residual, weight, eps, normed, residual_out)
    _narrow_rows(normed, x_bits)


@njit(**NUMBA_OPTIONS)
def _add_norm_segment(bits, residual, weight, eps, wide, normed, residual_out, x_bits):
    """`_norm_segment` of a linear's bfloat16 output `bits`, widened into `wide`."""
    _widen_rows(bits, wide)
    _norm_segment(wide, residual, weight, eps, normed, residual_out, x_bits)


@njit(**NUMBA_OPTIONS)
def _attention_segment(qkv_bits, cos, sin, num_heads, num_kv_heads, head_dim, k_cache,
                       v_cache, slots, block_tables, seq_lens, scale, kv_per_item, splits,
                       qkv, q, k, attn, attn_bits):
    """The step's attention from qkv_proj's bfloat16 output: rotary on q and k, this step's K/V
    into the cache, attention over it, its output's bfloat16 bits into attn_bits."""
    rows = qkv_bits.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    _widen_rows(qkv_bits, qkv)
    rotary_kernel(qkv[:, :q_size], cos, sin, head_dim, q)
    rotary_kernel(qkv[:, q_size:q_size + kv_size], cos, sin, head_dim, k)
    kv_numba.write_kv_kernel(k, qkv[:, q_size + kv_size:], k_cache, v_cache, slots)
    decode_kernel(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, block_tables,
                  seq_lens, scale, attn, kv_per_item, splits)
    _narrow_rows(attn.reshape(rows, q_size), attn_bits)


class _StepBuffers:
    """A step's activations, allocated once per step and reused by every layer: the bfloat16
    inputs of the linears (torch tensors, and the bit views the kernels write), the residual
    stream's two buffers (each add writes the one it does not read) and float32 scratch."""

    def __init__(self, rows: int, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.x = torch.empty(rows, hidden, dtype=torch.bfloat16)
        self.attn = torch.empty(rows, q_size, dtype=torch.bfloat16)
        self.x_bits, self.attn_bits = half_bits(self.x), half_bits(self.attn)
        self.residuals = (np.empty((rows, hidden), np.float32),
                          np.empty((rows, hidden), np.float32))
        self.wide = np.empty((rows, hidden), np.float32)
        self.normed = np.empty((rows, hidden), np.float32)
        self.qkv = np.empty((rows, q_size + 2 * kv_size), np.float32)
        self.q = np.empty((rows, q_size), np.float32)
        self.k = np.empty((rows, kv_size), np.float32)
        self.attn_out = np.empty((rows, num_heads, head_dim), np.float32)


# The projections of a Llama layer, in the order the kernels take them (decode.py too).
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class NativeHalfDecode:
    """`forward_layers` of a decode step of one LlamaModel whose projections all compute on
    bfloat16 weights this CPU multiplies natively (`native_half_decode` decides); decode.py's
    FusedDecode calls it for the rows it `runs`."""

    def __init__(self, model) -> None:
        self.model = model
        self.layers = list(model.layers)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, np.float32(attn.attn.scale)
        self.eps = np.float32(self.layers[0].input_layernorm.eps)
        # Each layer's projections packed for oneDNN (the layer path's packing: the same
        # QuantizedWeight objects).
        self.packed = [tuple(bfloat16_weight(layer.get_submodule(name)).onednn_packed()
                             for name in PROJECTIONS) for layer in self.layers]

    @staticmethod
    def runs(rows: int) -> bool:
        return quantized.MIN_NATIVE_HALF_ROWS <= rows <= MAX_NATIVE_DECODE_ROWS

    def __call__(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        rows, hidden_size = hidden.shape
        buf = _StepBuffers(rows, hidden_size, self.num_heads, self.num_kv_heads, self.head_dim)
        cos, sin = (t.contiguous().numpy() for t in cos_sin)
        seq_lens = np.ascontiguousarray(meta.seq_lens_np[:rows], dtype=np.int32)
        caches = [(kv_numba.numpy_view(c[0]), kv_numba.numpy_view(c[1])) for c in kv_caches]
        kv_bytes = step_kv_bytes(seq_lens, self.num_kv_heads, self.head_dim,
                                 caches[0][0].itemsize, len(caches))
        kv_per_item, splits = work_split(rows, self.num_kv_heads, numba.get_num_threads(),
                                         kv_bytes)
        tables, slots = meta.block_tables.numpy(), meta.slot_mapping[:rows].numpy()
        # The first layer's residual stream is its input (the norm adds nothing to it).
        residual, turn = hidden.contiguous().numpy(), 0
        _norm_segment(residual, NO_RESIDUAL, self.layers[0].input_layernorm.weight.numpy(),
                      self.eps, buf.normed, buf.wide, buf.x_bits)
        down = None
        for i, (layer, packed) in enumerate(zip(self.layers, self.packed)):
            if down is not None:  # the previous layer's MLP output joins the residual stream
                _add_norm_segment(half_bits(down), residual,
                                  layer.input_layernorm.weight.numpy(), self.eps, buf.wide,
                                  buf.normed, buf.residuals[turn], buf.x_bits)
                residual, turn = buf.residuals[turn], 1 - turn
            qkv = cpu_linear.onednn_linear(buf.x, packed[0])
            _attention_segment(half_bits(qkv), cos, sin, self.num_heads, self.num_kv_heads,
                               self.head_dim, caches[i][0], caches[i][1], slots, tables,
                               seq_lens, self.scale, kv_per_item, splits, buf.qkv, buf.q,
                               buf.k, buf.attn_out, buf.attn_bits)
            o = cpu_linear.onednn_linear(buf.attn, packed[1])
            _add_norm_segment(half_bits(o), residual,
                              layer.post_attention_layernorm.weight.numpy(), self.eps,
                              buf.wide, buf.normed, buf.residuals[turn], buf.x_bits)
            residual, turn = buf.residuals[turn], 1 - turn
            act = activation_numba.silu_and_mul_bf16(cpu_linear.onednn_linear(buf.x, packed[2]))
            down = cpu_linear.onednn_linear(act, packed[3])
        out = torch.empty(rows, hidden_size, dtype=torch.float32)
        _widen_rows(half_bits(down), buf.wide)
        add_rms_norm_kernel(buf.wide, residual, self.model.norm.weight.numpy(),
                            np.float32(self.model.norm.eps), out.numpy(), buf.residuals[turn])
        return out


def native_half_decode(model) -> NativeHalfDecode | None:
    """A `NativeHalfDecode` for `model` (a LlamaModel that decode.py's stack `qualifies`)
    where every projection of every layer computes on a bias-free bfloat16 weight and this CPU
    multiplies bfloat16 natively; else None."""
    if not quantized.computes_natively(torch.bfloat16):
        return None
    if not all(bfloat16_weight(layer.get_submodule(name)) is not None
               for layer in model.layers for name in PROJECTIONS):
        return None
    return NativeHalfDecode(model)
