"""Decode steps whose linears run on oneDNN, with one numba call between each pair of them: a
bfloat16 model's on a CPU that multiplies bfloat16 natively, from
the rows its linears' plans move to the matrix units (`LinearPlan.native_from`), and a
float32 model's beyond the fused stack's GEMV rows (`cpu_gemv.MAX_GEMV_ROWS`, where
`cpu_linear.linear` moves to oneDNN); both up to `MAX_ONEDNN_DECODE_ROWS`.

Why: the fused stack (decode.py) cannot call oneDNN, so from these rows the layer path ran
the step op by op: per layer about fifteen torch and numba calls and module dispatch, and for
bfloat16 a float32 round trip of every linear's input and output
(`cpu_linear.native_16bit_linear` rounds x to bfloat16 and widens its output). Here each
numba segment reads the output of the linear before it and writes the input of the linear
after it, both in the model's dtype:

    norm:      residual += previous down output; RMSNorm
    qkv_proj   (oneDNN)
    attention: rotary on q and k; the K/V write; attention
    o_proj     (oneDNN)
    norm:      residual += o; RMSNorm
    gate_up    (oneDNN)
    SiLU-and-mul (activation_numba)
    down_proj  (oneDNN)

then the final norm after the last layer. The residual stream and all arithmetic are float32:
a bfloat16 linear's output widens exactly on entry to a segment and the next linear's input
rounds to bfloat16 on exit (`_linear_output_as_float`, `_store_as_linear_input`); a float32
model's linears read and write the segments' own arrays. The kernels are the layer path's
(norm_numba, rotary_numba, kv_numba, decode_numba, activation_numba) with the same roundings
in the same places: the result is the layer path's bit for bit (its test allows float32
rounding, for a difference the numba cache's state caused there: see the test).

Where the CPU has a few-row kernel (cpu_linear.few_rows_view: AMX tiles, tile_linear.py, or
AVX-512 BF16 dot products, dot_linear.py) a bfloat16 model's linears run on it instead of
oneDNN, reading the same oneDNN-packed weights in place (no second copy), written into the
step's buffers; the layer path takes the same kernel for these row counts
(cpu_linear.half_linear), so the two still agree bit for bit. Where every projection runs on
it, the whole step is one numba call (`_step_in_one_call`: the same segments and kernel in the
same order), so no Python runs between the layers: after a linear has streamed its weight,
each Python operation's objects come back from memory, tens of microseconds apiece.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from mrv2 import batch_invariant
from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import (PLAIN_ATTENTION, decode_kernel, planned_threads,
                                        step_kv_bytes, work_split)
from mrv2.attention.paged_torch import NUMBA_WRITE_MAX_TOKENS
from mrv2.models.cpu.quantized_weights import float32_weight
from mrv2.models.layers.linear import bfloat16_weight
from mrv2.models.layers import activation_numba, cpu_gemv, cpu_linear, quantized
from mrv2.models.layers.quantized import PackedWeight
from mrv2.models.layers.norm_numba import NO_RESIDUAL, add_rms_norm_kernel
from mrv2.models.layers.numba_rows import NUMBA_OPTIONS, SERIAL_MAX_ROWS, typed_list
from mrv2.models.layers.rotary import RotaryInputs
from mrv2.models.layers.rotary_numba import rotary_kernel
from mrv2.models.layers.vector_ir import bf16_bits_to_float, float_to_bf16_bits, half_bits
from mrv2.utils.kernel_flags import FASTMATH

# The most rows this path runs: the layer path's KV write and norms take the same serial
# kernels up to here (beyond, other kernels with their own summation orders).
MAX_ONEDNN_DECODE_ROWS = min(NUMBA_WRITE_MAX_TOKENS, SERIAL_MAX_ROWS)
# Invariant (tested): at most cpu_linear.FEW_ROWS_MAX, so that the layer path's 16-bit
# linears (cpu_linear.half_linear) take the few-row kernel for every row count this path runs,
# as `step_weights` does, and the two agree bit for bit.

# The projections of a Llama layer, in the order the kernels take them (decode.py too).
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _linear_output_as_float(out, scratch):
    """A linear's output `out` as float32 rows: `out` itself, or a bfloat16 output's bit
    patterns widened into `scratch` (numba only: see the overload)."""
    raise NotImplementedError("compiled into the segments only")


@overload(_linear_output_as_float, jit_options={"fastmath": FASTMATH})
def _linear_output_as_float_overload(out, scratch):
    if out.dtype == types.float32:
        return lambda out, scratch: out

    def widen(out, scratch):
        for r in range(out.shape[0]):
            for i in range(out.shape[1]):
                scratch[r, i] = bf16_bits_to_float(out[r, i])
        return scratch
    return widen


def _store_as_linear_input(values, linear_in):
    """float32 `values` as the next linear's input: rounded to bfloat16 bit patterns, or
    copied unless `linear_in` is `values` itself (numba only: see the overload)."""
    raise NotImplementedError("compiled into the segments only")


@overload(_store_as_linear_input, jit_options={"fastmath": FASTMATH})
def _store_as_linear_input_overload(values, linear_in):
    if linear_in.dtype == types.float32:
        def copy(values, linear_in):
            if values.ctypes.data != linear_in.ctypes.data:
                linear_in[:] = values
        return copy

    def narrow(values, linear_in):
        for r in range(values.shape[0]):
            for i in range(values.shape[1]):
                linear_in[r, i] = float_to_bf16_bits(values[r, i])
    return narrow


@njit(**NUMBA_OPTIONS)
def _norm_segment(x, residual, weight, eps, scratch, normed, residual_out, linear_in):
    """residual_out = x + residual (a [0, 0] residual: none, and residual_out unwritten),
    normed = weight * norm(residual_out), stored as `linear_in`; x: a linear's output
    (`_linear_output_as_float`) or the float32 embedding."""
    add_rms_norm_kernel(_linear_output_as_float(x, scratch), residual, weight, eps, normed,
                        residual_out)
    _store_as_linear_input(normed, linear_in)


@njit(**NUMBA_OPTIONS)
def _attention_segment(qkv_out, cos, sin, num_heads, num_kv_heads, head_dim, k_cache,
                       v_cache, slots, block_tables, seq_lens, scale, kv_per_item, splits,
                       plain, scratch, q, k, attn, linear_in):
    """The step's attention from qkv_proj's output: rotary on q and k, this step's K/V into
    the cache, attention over it into `attn` [rows, heads, head_dim], stored as `linear_in`.
    `plain`: decode_numba.PLAIN_ATTENTION, passed in rather than written here, where numba
    would type its 0 as a literal and the array as read-only: a second specialization of
    decode_kernel beside the layer path's, compiled again (~25 s) for nothing."""
    rows = qkv_out.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _linear_output_as_float(qkv_out, scratch)
    rotary_kernel(qkv[:, :q_size], cos, sin, head_dim, q)
    rotary_kernel(qkv[:, q_size:q_size + kv_size], cos, sin, head_dim, k)
    kv_numba.write_kv_kernel(k, qkv[:, q_size + kv_size:], k_cache, v_cache, slots)
    decode_kernel(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, block_tables,
                  seq_lens, scale, attn, kv_per_item, splits, plain[0], plain[1], plain[2])
    _store_as_linear_input(attn.reshape(rows, q_size), linear_in)


@njit(**NUMBA_OPTIONS)
def _step_in_one_call(hidden, ln1s, ln2s, eps, w_qkvs, w_os, w_gate_ups, w_downs, final_norm,
                     final_eps, kv_caches, cos, sin, num_heads, num_kv_heads, head_dim, slots,
                     tables, seq_lens, scale, kv_per_item, splits, plain, threads,
                     linear_views, scratches, out):
    """The step of `OneDnnDecode.__call__`'s loop, every linear on the few-row kernel, as one
    call: hidden [rows, hidden] float32 -> the final norm's output in `out`. linear_views: the
    bfloat16 bits of (x, qkv, attn, o, gate_up, act, down), each linear's input or output;
    scratches: `_StepBuffers`' float32 arrays (residuals, scratch, qkv_scratch, normed, q, k,
    attn_out)."""
    x_in, qkv, attn_in, o, gate_up, act, down = linear_views
    residuals, scratch, qkv_scratch, normed, q, k, attn_out = scratches
    none = np.empty((0, 0), np.float32)  # no residual: the first layer's stream is its input
    _norm_segment(hidden, none, ln1s[0], eps, scratch, normed, none, x_in)
    residual, turn = hidden, 0
    for i in range(len(w_qkvs)):
        if i > 0:  # the previous layer's MLP output joins the residual stream
            _norm_segment(down, residual, ln1s[i], eps, scratch, normed, residuals[turn], x_in)
            residual, turn = residuals[turn], 1 - turn
        cpu_linear.few_rows_kernel(x_in, w_qkvs[i], qkv, threads)
        kv = kv_caches[i]
        _attention_segment(qkv, cos, sin, num_heads, num_kv_heads, head_dim, kv[0], kv[1],
                           slots, tables, seq_lens, scale, kv_per_item, splits, plain,
                           qkv_scratch, q, k, attn_out, attn_in)
        cpu_linear.few_rows_kernel(attn_in, w_os[i], o, threads)
        _norm_segment(o, residual, ln2s[i], eps, scratch, normed, residuals[turn], x_in)
        residual, turn = residuals[turn], 1 - turn
        cpu_linear.few_rows_kernel(x_in, w_gate_ups[i], gate_up, threads)
        activation_numba.silu_and_mul_bf16_kernel(gate_up, act.shape[1], act)
        cpu_linear.few_rows_kernel(act, w_downs[i], down, threads)
    _norm_segment(down, residual, final_norm, final_eps, scratch, out, residuals[turn], out)


def _kernel_view(t: torch.Tensor) -> np.ndarray:
    """A linear's input or output as the segments take it: float32 as is, bfloat16 as bits."""
    return t.numpy() if t.dtype == torch.float32 else half_bits(t)


class _StepBuffers:
    """A step's activations, allocated once per step and reused by every layer: the inputs of
    the linears (torch tensors, and the views the kernels write), the residual stream's two
    buffers (each add writes the one it does not read) and float32 scratch. In float32 the
    norm and attention write the linears' inputs directly and nothing is widened."""

    def __init__(self, rows: int, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, kernel_widths: tuple[int, ...] | None
                 ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Where the step's linears run on the few-row kernel (kernel_widths: the projections'
        # output widths, in PROJECTIONS' order), each one's output and the MLP's activation,
        # with their views: the kernel writes into given memory, oneDNN's calls allocate
        # their own.
        self.outs: list = [None] * len(PROJECTIONS)
        self.act, self.act_in = None, None
        if kernel_widths is not None:
            self.outs = [(out, _kernel_view(out))
                         for out in (torch.empty(rows, n, dtype=dtype) for n in kernel_widths)]
            self.act = torch.empty(rows, kernel_widths[2] // 2, dtype=dtype)
            self.act_in = _kernel_view(self.act)
        self.x = torch.empty(rows, hidden, dtype=dtype)
        self.attn = torch.empty(rows, q_size, dtype=dtype)
        self.x_in, self.attn_in = _kernel_view(self.x), _kernel_view(self.attn)
        self.residuals = (np.empty((rows, hidden), np.float32),
                          np.empty((rows, hidden), np.float32))
        self.q = np.empty((rows, q_size), np.float32)
        self.k = np.empty((rows, kv_size), np.float32)
        if dtype == torch.float32:  # no scratch: an empty [0, 0] array stands in
            self.normed, self.scratch, self.qkv_scratch = self.x_in, NO_RESIDUAL, NO_RESIDUAL
            self.attn_out = self.attn_in.reshape(rows, num_heads, head_dim)
        else:
            self.normed = np.empty((rows, hidden), np.float32)
            self.scratch = np.empty((rows, hidden), np.float32)
            self.qkv_scratch = np.empty((rows, q_size + 2 * kv_size), np.float32)
            self.attn_out = np.empty((rows, num_heads, head_dim), np.float32)


def _step_linear(x: torch.Tensor, x_view: np.ndarray | None,
                 weight: torch.Tensor | np.ndarray,
                 out: tuple[torch.Tensor, np.ndarray] | None, threads: int) -> torch.Tensor:
    """x @ a projection's weight as `OneDnnDecode.step_weights` gives it: a few-row view runs
    its kernel from x's view into `out` (the tensor and its view, from the step's
    buffers) on `threads` threads; a oneDNN-packed tensor, oneDNN."""
    if isinstance(weight, np.ndarray):
        cpu_linear.few_rows_kernel(x_view, weight, out[1], threads)
        return out[0]
    return cpu_linear.onednn_linear(x, weight)


class OneDnnDecode:
    """`forward_layers` of a decode step of one LlamaModel whose projections all compute on
    bfloat16 weights this CPU multiplies natively, or all on float32 weights
    (`onednn_decode` decides); decode.py's FusedDecode calls it for the rows it `runs`."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.layers = list(model.layers)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, np.float32(attn.attn.scale)
        self.eps = np.float32(self.layers[0].input_layernorm.eps)
        self.final_eps = np.float32(model.norm.eps)
        # The rows from which the layer path's linears run on oneDNN: for bfloat16 where
        # every projection's plan has moved to the matrix units (integer blocks beside a
        # bfloat16 copy run a few more rows on the blocks, in the fused stack).
        self.min_rows = (max(layer.get_submodule(name).packed.plan.native_from
                             for layer in self.layers for name in PROJECTIONS)
                         if dtype == torch.bfloat16 else cpu_gemv.MAX_GEMV_ROWS + 1)
        # (gate_up, the step's activation buffer) -> the MLP's activation: bfloat16 into the
        # buffer (whose view the next linear may read), float32 a new tensor.
        self.silu_and_mul = (activation_numba.silu_and_mul_bf16 if dtype == torch.bfloat16
                             else lambda gate_up, out: activation_numba.silu_and_mul(gate_up))
        # Each layer's projection weights, packed for oneDNN each step as the layer path packs
        # them: the same PackedWeight objects (packed once), or the float32 weight (packed
        # once, repacked after an in-place change).
        weight = bfloat16_weight if dtype == torch.bfloat16 else float32_weight
        self.weights = [tuple(weight(layer.get_submodule(name)) for name in PROJECTIONS)
                        for layer in self.layers]
        first = [self.layers[0].get_submodule(name) for name in PROJECTIONS]
        self.widths = tuple(getattr(m, "output_size_per_partition", m.output_size)
                            for m in first)
        self.pack = (PackedWeight.onednn_packed if dtype == torch.bfloat16
                     else cpu_linear.packed_weight)
        # A bfloat16 model's few-row views, made at the first step (packing is lazy) and kept:
        # its packed weights never change (PackedWeight.onednn_packed).
        self._kernel_weights: list[tuple] | None = None
        # Where every projection has a few-row view, `_step_in_one_call`'s typed lists of them and
        # of the norms' weights (views: an in-place change is seen), made with the views.
        self._step_lists: tuple | None = None
        # The KV caches' typed list for `_step_in_one_call` and the data pointers it views.
        self._kv_lists: tuple[tuple[int, ...], object] | None = None

    def step_weights(self) -> list[tuple]:
        """Each layer's four projections as the step's linears take them: a bfloat16 weight's
        few-row view where a kernel reads it (cpu_linear.few_rows_view), else oneDNN-packed."""
        if self._kernel_weights is not None:
            return self._kernel_weights
        packed = [tuple(self.pack(w) for w in weights) for weights in self.weights]
        if self.dtype != torch.bfloat16:
            return packed
        self._kernel_weights = [tuple(p if (t := cpu_linear.few_rows_view(p)) is None else t
                                      for p in layer) for layer in packed]
        if all(isinstance(w, np.ndarray) for layer in self._kernel_weights for w in layer):
            norms = [[layer.get_submodule(name).weight.detach().numpy() for layer in self.layers]
                     for name in ("input_layernorm", "post_attention_layernorm")]
            self._step_lists = (*(typed_list(tuple(view)) for view in norms),
                                *(typed_list(tuple(layer[j] for layer in self._kernel_weights))
                                  for j in range(len(PROJECTIONS))))
        return self._kernel_weights

    @property
    def one_call(self) -> bool:
        """Whether a step runs as one numba call (`_step_in_one_call`): every projection on
        the few-row kernel. Known from the first step on (`step_weights`)."""
        return self._step_lists is not None

    def kv_lists(self, kv_caches: list[torch.Tensor]):
        """The caches as `_step_in_one_call` takes them (a typed list of views), made again
        when a cache has new memory (wake_up)."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._kv_lists is None or self._kv_lists[0] != key:
            self._kv_lists = (key, typed_list(tuple(kv_numba.numpy_view(c) for c in kv_caches)))
        return self._kv_lists[1]

    def release_kv_views(self) -> None:
        """Drop the views of the KV caches (they keep its memory alive: Worker.sleep)."""
        self._kv_lists = None

    def runs(self, rows: int) -> bool:
        return self.min_rows <= rows <= MAX_ONEDNN_DECODE_ROWS

    def __call__(self, rope: RotaryInputs, hidden: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        rows, hidden_size = hidden.shape
        weights = self.step_weights()
        buf = _StepBuffers(rows, hidden_size, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.dtype,
                           None if self._kernel_weights is None else self.widths)
        threads = numba.get_num_threads()
        cos, sin = (t.contiguous().numpy() for t in (rope.cos, rope.sin))
        seq_lens = np.ascontiguousarray(meta.seq_lens_np[:rows], dtype=np.int32)
        kv_bytes = step_kv_bytes(seq_lens, self.num_kv_heads, self.head_dim,
                                 kv_caches[0].element_size(), len(kv_caches))
        kv_per_item, splits = work_split(meta.decode_sequences, self.num_kv_heads,
                                         planned_threads(), kv_bytes)
        tables, slots = meta.block_tables.numpy(), meta.slot_mapping[:rows].numpy()
        if self.one_call:
            out = torch.empty(rows, hidden_size, dtype=torch.float32)
            ln1s, ln2s, w_qkvs, w_os, w_gate_ups, w_downs = self._step_lists
            _step_in_one_call(
                hidden.contiguous().numpy(), ln1s, ln2s, self.eps, w_qkvs, w_os, w_gate_ups,
                w_downs, self.model.norm.weight.numpy(), self.final_eps,
                self.kv_lists(kv_caches), cos, sin, self.num_heads, self.num_kv_heads,
                self.head_dim, slots, tables, seq_lens, self.scale, kv_per_item, splits,
                PLAIN_ATTENTION, threads,
                (buf.x_in, buf.outs[0][1], buf.attn_in, buf.outs[1][1], buf.outs[2][1],
                 buf.act_in, buf.outs[3][1]),
                (buf.residuals, buf.scratch, buf.qkv_scratch, buf.normed, buf.q, buf.k,
                 buf.attn_out), out.numpy())
            return out
        caches = [(kv_numba.numpy_view(c[0]), kv_numba.numpy_view(c[1])) for c in kv_caches]
        # The first layer's residual stream is its input (the norm adds nothing to it).
        residual, turn, down = hidden.contiguous().numpy(), 0, None
        for i, (layer, packed) in enumerate(zip(self.layers, weights)):
            ln1 = layer.input_layernorm.weight.numpy()
            if down is None:
                _norm_segment(residual, NO_RESIDUAL, ln1, self.eps, buf.scratch, buf.normed,
                              NO_RESIDUAL, buf.x_in)
            else:  # the previous layer's MLP output joins the residual stream
                _norm_segment(_kernel_view(down), residual, ln1, self.eps, buf.scratch,
                              buf.normed, buf.residuals[turn], buf.x_in)
                residual, turn = buf.residuals[turn], 1 - turn
            qkv = _step_linear(buf.x, buf.x_in, packed[0], buf.outs[0], threads)
            _attention_segment(_kernel_view(qkv), cos, sin, self.num_heads, self.num_kv_heads,
                               self.head_dim, caches[i][0], caches[i][1], slots, tables,
                               seq_lens, self.scale, kv_per_item, splits, PLAIN_ATTENTION,
                               buf.qkv_scratch, buf.q, buf.k, buf.attn_out, buf.attn_in)
            o = _step_linear(buf.attn, buf.attn_in, packed[1], buf.outs[1], threads)
            _norm_segment(_kernel_view(o), residual,
                          layer.post_attention_layernorm.weight.numpy(), self.eps,
                          buf.scratch, buf.normed, buf.residuals[turn], buf.x_in)
            residual, turn = buf.residuals[turn], 1 - turn
            gate_up = _step_linear(buf.x, buf.x_in, packed[2], buf.outs[2], threads)
            act = self.silu_and_mul(gate_up, buf.act)
            down = _step_linear(act, buf.act_in, packed[3], buf.outs[3], threads)
        out = torch.empty(rows, hidden_size, dtype=torch.float32)
        _norm_segment(_kernel_view(down), residual, self.model.norm.weight.numpy(),
                      self.final_eps, buf.scratch, out.numpy(),
                      buf.residuals[turn], out.numpy())
        return out


def onednn_decode(model) -> OneDnnDecode | None:
    """A `OneDnnDecode` for `model` (a LlamaModel that decode.py's stack `qualifies`) where
    every projection of every layer computes on a bias-free bfloat16 weight and this CPU
    multiplies bfloat16 natively, or on a bias-free float32 weight and oneDNN is built in,
    and no layer has per-head q/k norms; else None."""
    projections = [layer.get_submodule(name) for layer in model.layers for name in PROJECTIONS]
    if batch_invariant.active():
        return None  # oneDNN's blockings follow the rows and threads
    if any(layer.self_attn.q_norm is not None or not layer.self_attn.use_rope
           or layer.self_attn.attn.sliding_window for layer in model.layers):
        # Its attention segment has no q/k norms, rotates every layer, sees every key.
        return None
    if (quantized.computes_natively(torch.bfloat16)
            and all(bfloat16_weight(p) is not None for p in projections)):
        return OneDnnDecode(model, torch.bfloat16)
    if cpu_linear.available() and all(float32_weight(p) is not None for p in projections):
        return OneDnnDecode(model, torch.float32)
    return None
