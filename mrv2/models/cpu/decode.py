"""Every Llama decoder layer and the final norm for a decode step of a few rows, as one numba
call (float32 activations, CPU; float32 weights, or GGUF blocks or 16-bit weights kept as
stored).

Why: a decode step of 1-4 tokens is bound by streaming the weights (the GEMVs run at the
memory bandwidth), and what is left is per-op overhead. Op by op (two norms, four
projections, rotary twice, the KV write, attention, SiLU-and-mul: about fifteen torch / numba
calls per layer) that overhead is a large share of a small model's step, and even one call per
layer pays Python and argument unboxing per layer (bench/README.md has the measurements). Here
the whole stack is one call: the weights and KV caches reach it as numba typed lists of views
built once, and its parallel parts (the projections, attention) are parallel loops inside it.

The arithmetic is the same as the module path (norm_numba, rotary_numba, activation_numba,
cpu_gemv or quantized_numba, decode_numba): RMSNorm in float32 then the weight multiply,
rotate-half rotary, SiLU(gate) * up, attention over the paged cache after this step's K/V are
written. Each projection is a float32 weight (cpu_gemv's kernel) or, for a model loaded with
quantization="gguf", the blocks or 16-bit weight quantized_weights attached to it (the packed
GEMV `gemv_groups` or the 16-bit `gemv_half`, the kernels the module path calls): `_linear`
picks one at compile time from the typed list's item type.

`attach` gives a loaded LlamaModel whose layers `qualify` (each projection float32 CPU or
quantized, the same kind in every layer; one tensor-parallel rank, no biases and no per-head
q/k norm in any layer) a `FusedDecode` as its `forward_layers`; it runs the fused stack for the
steps where `applies` holds (every row a decode row, one token, at most `max_rows` rows) and
the model's own layers otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import numba
from numba import njit, typed, types
from numba.extending import overload

from mrv2 import platform
from mrv2.attention.backend import attention_backend
from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import decode_kernel, step_kv_bytes, work_split
from mrv2.models.cpu.onednn_decode import MAX_ONEDNN_DECODE_ROWS, PROJECTIONS, onednn_decode
from mrv2.models.cpu.quantized_weights import QuantizedLinearForward
from mrv2.models.layers.activation_numba import silu_and_mul_kernel
from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS, gemv_kernel
from mrv2.models.layers.norm_numba import add_rms_norm_kernel
from mrv2.models.layers import quantized
from mrv2.models.layers.quantized import MAX_QUANTIZED_GEMV_ROWS, QuantizedWeight
from mrv2.models.layers.quantized_numba import gemv_groups, gemv_half
from mrv2.models.layers.rotary_numba import rotary_kernel

if TYPE_CHECKING:
    from mrv2.models.cpu.decode_logits import LmHead

# Rows up to which the stack runs a step: float32 weights take the GEMV up to MAX_GEMV_ROWS
# (oneDNN beyond); when every projection is quantized the module path itself runs the packed
# GEMV up to MAX_QUANTIZED_GEMV_ROWS, so the stack does too.
MAX_DECODE_ROWS = MAX_GEMV_ROWS
MAX_QUANTIZED_DECODE_ROWS = MAX_QUANTIZED_GEMV_ROWS


def _linear(x, w, out):
    """out = x @ W^T inside the stack; `w` is a float32 weight view, a 16-bit weight's
    (q int16, bfloat16) or GGUF blocks' (q as bytes, scales, mins, packed, group size,
    x format) tuple
    (numba only: see the overload)."""
    raise NotImplementedError("compiled into the decode stack only")


@overload(_linear, jit_options={"fastmath": True})
def _linear_overload(x, w, out):
    if isinstance(w, types.NoneType):  # no LM head in the stack
        return lambda x, w, out: None
    if isinstance(w, types.Array):
        return lambda x, w, out: gemv_kernel(x, w, out)
    if len(w) == 2:
        return lambda x, w, out: gemv_half(x, w[0], w[1], out)
    return lambda x, w, out: gemv_groups(x, w[0], w[1], w[2], w[3], w[4], w[5], out)


@njit(fastmath=True, error_model="numpy", cache=True)
def _decode_layer(hidden, residual, ln1, ln2, eps, w_qkv, w_o, w_gate_up, w_down, cos, sin,
                  k_cache, v_cache, block_tables, seq_lens, slots, num_heads, num_kv_heads,
                  head_dim, intermediate, scale, kv_per_item, splits, out, residual_out):
    rows, hidden_size = hidden.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    normed = np.empty((rows, hidden_size), dtype=np.float32)
    add_rms_norm_kernel(hidden, residual, ln1, eps, normed, residual_out)
    if residual.shape[0] == 0:  # first layer: the residual stream starts as the input
        residual_out[:] = hidden
    qkv = np.empty((rows, q_size + 2 * kv_size), dtype=np.float32)
    _linear(normed, w_qkv, qkv)
    q = np.empty((rows, q_size), dtype=np.float32)
    k = np.empty((rows, kv_size), dtype=np.float32)
    rotary_kernel(qkv[:, :q_size], cos, sin, head_dim, q)
    rotary_kernel(qkv[:, q_size:q_size + kv_size], cos, sin, head_dim, k)
    kv_numba.write_kv_kernel(k, qkv[:, q_size + kv_size:], k_cache, v_cache, slots)
    attn = np.empty((rows, num_heads, head_dim), dtype=np.float32)
    decode_kernel(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, block_tables,
                   seq_lens, scale, attn, kv_per_item, splits)
    o = np.empty((rows, hidden_size), dtype=np.float32)
    _linear(attn.reshape(rows, q_size), w_o, o)
    summed = np.empty((rows, hidden_size), dtype=np.float32)
    add_rms_norm_kernel(o, residual_out.copy(), ln2, eps, normed, summed)
    residual_out[:] = summed
    gate_up = np.empty((rows, 2 * intermediate), dtype=np.float32)
    _linear(normed, w_gate_up, gate_up)
    act = np.empty((rows, intermediate), dtype=np.float32)
    silu_and_mul_kernel(gate_up, intermediate, act)
    _linear(act, w_down, out)


@njit(fastmath=True, error_model="numpy", cache=True)
def _decode_model(hidden, ln1s, ln2s, eps, w_qkvs, w_os, w_gate_ups, w_downs, final_norm,
                  final_eps, cos, sin, kv_caches, block_tables, seq_lens, slots, num_heads,
                  num_kv_heads, head_dim, intermediate, scale, kv_per_item, splits, out,
                  w_head, logits):
    rows, hidden_size = hidden.shape
    x = hidden
    residual = np.empty((0, 0), dtype=np.float32)  # the first layer starts the stream
    for i in range(len(w_qkvs)):
        layer_out = np.empty((rows, hidden_size), dtype=np.float32)
        residual_out = np.empty((rows, hidden_size), dtype=np.float32)
        kv = kv_caches[i]
        _decode_layer(x, residual, ln1s[i], ln2s[i], eps, w_qkvs[i], w_os[i], w_gate_ups[i],
                      w_downs[i], cos, sin, kv[0], kv[1], block_tables, seq_lens, slots,
                      num_heads, num_kv_heads, head_dim, intermediate, scale, kv_per_item,
                      splits, layer_out, residual_out)
        x, residual = layer_out, residual_out
    summed = np.empty((rows, hidden_size), dtype=np.float32)
    add_rms_norm_kernel(x, residual, final_norm, final_eps, out, summed)
    if logits.shape[0] == rows:  # the LM head's rows: every decode row is sampled
        _linear(out, w_head, logits)


def _quantized(module) -> QuantizedWeight | None:
    """The GGUF weight `module` computes on as stored (quantized_weights attached it), or
    None."""
    forward = module.__dict__.get("forward")
    return forward.weight if isinstance(forward, QuantizedLinearForward) else None


def _float32(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous()


def _kind(module) -> str:
    """What a projection computes on: "float32", "blocks" (GGUF integer blocks) or "half" (a
    16-bit float weight): one typed list holds one kind."""
    weight = _quantized(module)
    return "float32" if weight is None else "half" if weight.is_half else "blocks"


def _kinds(layer) -> tuple[str, ...]:
    """Per projection of `layer`: its `_kind`."""
    return tuple(_kind(layer.get_submodule(name)) for name in PROJECTIONS)


def _layer_qualifies(layer) -> bool:
    """The parts that never change: float32 CPU norms, each projection quantized or float32
    CPU, tp 1, no biases, no q/k norm."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [layer.get_submodule(name) for name in PROJECTIONS]
    return (attn.q_norm is None and attn.o_proj.tp_size == 1 and mlp.down_proj.tp_size == 1
            and all(p.bias is None for p in projections)
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
            and _float32(layer.input_layernorm.weight)
            and _float32(layer.post_attention_layernorm.weight)
            and all(_quantized(p) is not None or _float32(p.weight) for p in projections))


def qualifies(model) -> bool:
    """Whether the fused stack can run `model` (a LlamaModel): every layer qualifies, all with
    one norm eps (the kernel takes one) and each projection of one kind (float32, GGUF blocks
    or 16-bit: one typed list per projection), and the final norm is float32 on the CPU."""
    layers = list(model.layers)
    return (len(layers) > 0 and all(_layer_qualifies(layer) for layer in layers)
            and len({layer.input_layernorm.eps for layer in layers}) == 1
            and len({_kinds(layer) for layer in layers}) == 1 and _float32(model.norm.weight))


def max_rows(model) -> int:
    """The most decode rows the stack runs for `model` (a LlamaModel that `qualifies`): where
    every projection is 16-bit and the CPU computes its dtype natively, fewer rows than the
    layer path's linears switch to the matrix units (quantized.MIN_NATIVE_HALF_ROWS)."""
    layer = model.layers[0]
    kinds = _kinds(layer)
    if all(kind == "half" for kind in kinds) and quantized.computes_natively(
            _quantized(layer.self_attn.qkv_proj).half_dtype):
        return min(MAX_QUANTIZED_DECODE_ROWS, quantized.MIN_NATIVE_HALF_ROWS - 1)
    return MAX_QUANTIZED_DECODE_ROWS if "float32" not in kinds else MAX_DECODE_ROWS


def applies(model, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta,
            rows_limit: int = MAX_DECODE_ROWS) -> bool:
    """Whether `decode_model` computes this step of `model` (a LlamaModel that `qualifies`):
    a decode step (every row one token) of at most `rows_limit` rows on the CPU (torch
    attention backend) in float32, over a float32 or 16-bit cache."""
    rows = hidden.shape[0]
    return (0 < rows <= rows_limit and meta.num_decodes == meta.num_reqs == rows
            and meta.num_actual_tokens == rows and hidden.device.type == "cpu"
            and hidden.dtype == torch.float32 and not torch.is_grad_enabled()
            and attention_backend(hidden.device) == platform.CPU
            and all(c.dtype in kv_numba.NUMBA_KV_DTYPES and c.is_contiguous()
                    for c in kv_caches))


def _projection_parameters(module) -> list[torch.Tensor]:
    """The parameters the kernel reads for one projection: its float32 weight, or none (an
    attached quantized weight is created once, with the model, and never given new storage)."""
    return [module.weight] if _quantized(module) is None else []


def _weight_view(weight: QuantizedWeight | torch.Tensor, float32_tables: bool = False):
    """The kernel's view of one weight: a float32 weight as is, a 16-bit weight as (q int16,
    bfloat16), or GGUF blocks as (q as bytes, scales, mins ([N, 0]: none), packed, group
    size, x format: quantized.GEMV_X_FORMAT when the view is built); with
    `float32_tables`, float32 copies of float16 scale / min tables."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().numpy()
    if weight.is_half:
        return (weight.q.numpy(), weight.layout == "bf16")
    if float32_tables:
        weight = weight._with_float32_tables()
    return (weight.q.view(torch.uint8).numpy(), weight.scales.numpy(), weight.kernel_mins.numpy(),
            weight.layout == "u4", weight.group_size, quantized.GEMV_X_FORMAT)


def _projection_view(module, float32_tables: bool = False):
    """The kernel's view of one projection (`_weight_view`): the GGUF blocks or 16-bit weight
    attached to it, else its float32 weight."""
    weight = _quantized(module)
    return _weight_view(module.weight if weight is None else weight, float32_tables)


def _projection_views(modules) -> typed.List:
    """One projection of every layer as a typed list: its items must share one numba type, so
    where the layers' table dtypes differ (a file mixing K-quants and 32-input types) every
    one gets float32 tables."""
    views = [_projection_view(m) for m in modules]
    if len({numba.typeof(v) for v in views}) > 1:
        views = [_projection_view(m, float32_tables=True) for m in modules]
    return _typed_list(tuple(views))


def _stack_tensors(model, kv_caches: list[torch.Tensor], head: LmHead | None
                   ) -> list[torch.Tensor]:
    """Every tensor the kernel reads through a standing view that may be given new storage:
    the final norm, the caches, a float32 LM head, then each layer's norms and float32
    projections."""
    out = [model.norm.weight, *kv_caches]
    if head is not None and isinstance(head.weight, torch.Tensor):
        out.append(head.weight)
    for layer in model.layers:
        out += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for name in PROJECTIONS:
            out += _projection_parameters(layer.get_submodule(name))
    return out


def _views(tensors) -> typed.List:
    return _typed_list(tuple(t.detach().numpy() for t in tensors))


@njit(cache=True)
def _typed_list(items):
    """A typed list of `items` (a tuple whose items share one numba type). Built in a cached
    function: `typed.List(...)` from Python compiles numba's list helpers for each item type
    in every process (0.4-1 s a type, ~2 s an engine start), and does not cache them."""
    out = typed.List()
    for item in items:
        out.append(item)
    return out


class _StackArgs:
    """The kernel's typed lists of weight and cache views (and its view of the LM head), built
    once per (weights, caches).

    The views share memory with the tensors, so in-place weight changes are seen; `key` is
    the data pointer of every parameter and cache the views read, checked each step, so a
    parameter given new storage (`param.data = ...`) or another cache list rebuilds the lists
    instead of reading stale memory. Parameter objects and attached quantized weights
    themselves are assumed to stay (they are created once, with the model); an attached
    weight's tensors are not in the key (on SmolLM2's 30 layers: 91 pointers a step instead of
    421)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], head: LmHead | None) -> None:
        self.kv_caches_list = kv_caches
        self.tensors = _stack_tensors(model, kv_caches, head)
        self.key = self.current_key()
        layers = list(model.layers)
        self.ln1s = _views(layer.input_layernorm.weight for layer in layers)
        self.ln2s = _views(layer.post_attention_layernorm.weight for layer in layers)
        (self.w_qkvs, self.w_os, self.w_gate_ups, self.w_downs) = (
            _projection_views([layer.get_submodule(name) for layer in layers])
            for name in PROJECTIONS)
        self.kv_caches = _typed_list(tuple(kv_numba.numpy_view(c) for c in kv_caches))
        self.final_norm = model.norm.weight.detach().numpy()
        self.head = head
        self.w_head = None if head is None else _weight_view(head.weight)
        self.vocab_rows = 0 if head is None else (
            head.weight.shape[0] if isinstance(head.weight, torch.Tensor)
            else head.weight.out_features)

    def current_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def current(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether these lists still view `kv_caches` and the model's current storage."""
        return self.kv_caches_list is kv_caches and self.key == self.current_key()


def decode_model(model, args: _StackArgs, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`LlamaModel.forward_layers` for a decode step (`applies` holds), with `args` built for
    `kv_caches`: every layer, writing this step's K/V into `kv_caches`, then the final norm
    -> [rows, hidden]; with it the rows' logits [rows, vocab] when `args` has an LM head
    that runs this many rows (else None)."""
    attn = model.layers[0].self_attn
    rows = hidden.shape[0]
    out = torch.empty_like(hidden)
    head = args.head
    with_logits = head is not None and rows <= head.max_rows
    logits = torch.empty(rows if with_logits else 0, args.vocab_rows, dtype=torch.float32)
    cos, sin = cos_sin
    seq_lens = np.ascontiguousarray(meta.seq_lens_np[:rows], dtype=np.int32)
    kv_bytes = step_kv_bytes(seq_lens, attn.num_kv_heads, attn.head_dim,
                             args.kv_caches[0].itemsize, len(args.kv_caches))
    kv_per_item, splits = work_split(rows, attn.num_kv_heads, numba.get_num_threads(), kv_bytes)
    _decode_model(
        hidden.contiguous().numpy(), args.ln1s, args.ln2s,
        np.float32(model.layers[0].input_layernorm.eps), args.w_qkvs, args.w_os,
        args.w_gate_ups, args.w_downs, args.final_norm, np.float32(model.norm.eps),
        cos.contiguous().numpy(), sin.contiguous().numpy(), args.kv_caches,
        meta.block_tables.numpy(), seq_lens, meta.slot_mapping[:rows].numpy(), attn.num_heads,
        attn.num_kv_heads, attn.head_dim, model.layers[0].mlp.intermediate_size,
        np.float32(attn.attn.scale), kv_per_item, splits, out.numpy(), args.w_head,
        logits.numpy())
    return out, logits if with_logits else None


class FusedDecode:
    """`forward_layers` of one qualifying LlamaModel: the fused stack where `applies` holds,
    the layers between oneDNN calls (`onednn_decode`) for the rows that path runs, the
    model's own layers otherwise. It keeps the kernel's views (`_StackArgs`), rebuilt when
    the caches or any tensor's storage change. With an LM head (`attach_stack_logits`), the
    stack's steps compute their rows' logits too, held for `take_logits`."""

    def __init__(self, model) -> None:
        self.model = model
        self.forward_layers = type(model).forward_layers.__get__(model)  # the module path
        self.args: _StackArgs | None = None
        self.head: LmHead | None = None
        self.max_rows = max_rows(model)
        # From the rows where its linears move to oneDNN, a bfloat16 or float32 model's steps
        # run the layers between oneDNN calls instead (onednn_decode.py).
        self.onednn = onednn_decode(model)
        # (the hidden states the last stack step returned, their logits): until taken or the
        # next step.
        self._logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        model = self.model
        self._logits = None
        onednn = self.onednn is not None and self.onednn.runs(hidden.shape[0])
        rows_limit = MAX_ONEDNN_DECODE_ROWS if onednn else self.max_rows
        if not applies(model, hidden, kv_caches, meta, rows_limit):
            return self.forward_layers(cos_sin, hidden, kv_caches, meta)
        if onednn:
            return self.onednn(cos_sin, hidden, kv_caches, meta)
        if self.args is None or not self.args.current(kv_caches):
            self.args = _StackArgs(model, kv_caches, self.head)
        out, logits = decode_model(model, self.args, cos_sin, hidden, kv_caches, meta)
        if logits is not None:
            self._logits = (out, logits)
        return out

    def take_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits the last step computed, if `hidden` is the very tensor that step
        returned; once (a second call gets None)."""
        pending = self._logits
        if pending is None or pending[0] is not hidden:
            return None
        self._logits = None
        return pending[1]


def attach_fused_decode(model) -> FusedDecode | None:
    """Route `model`'s (a LlamaModel's) decode steps through the fused stack when it
    `qualifies` (checked once, on the loaded weights and the attached quantized blocks);
    returns the attached path, or None."""
    if not qualifies(model):
        return None
    fused = model.forward_layers = FusedDecode(model)
    return fused
