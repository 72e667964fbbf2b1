"""A decoder's decode step of a few rows as one numba call (decode_stack_numba.py): token ids
to final hidden states and the LM head's logits (CPU, float32 activations; float32 weights,
or GGUF blocks or 16-bit weights kept as stored), for any model whose DecoderSpec it supports.

Why: a decode step of 1-4 tokens is bound by streaming the weights (the GEMVs run at the
memory bandwidth), and what is left is per-op overhead. Op by op (two norms, four
projections, rotary twice, the KV write, attention, SiLU-and-mul: about fifteen torch / numba
calls per layer) that overhead is a large share of a small model's step, and even one call per
layer pays Python and argument unboxing per layer (bench/README.md has the measurements). Here
the whole step is one call, the embedding lookup and the rotary tables' rows included: the
weights and KV caches reach it as numba typed lists of views built once, and its parallel
parts (the projections, attention) are parallel loops inside it. Each projection is a float32
weight or, for a model loaded with quantization="gguf" or kept in 16 bits, the blocks or
16-bit weight it computes on (`module.packed`), computed by the kernels the module path calls.

`fused_decode` gives a loaded model whose `decoder_spec` the stack `supports` and whose
weights `qualify` (each projection float32 CPU or packed, the same kind in every layer; one
tensor-parallel rank; an embedding the stack can read) a `FusedDecode`, which the runner asks
first for each step: the stack where `applies` holds (every row a decode row, one token, at
most `max_rows` rows), with the rows' logits; the layers between oneDNN calls
(`onednn_decode`) where that path takes the rows; else nothing (the model runs the step).
"""

from __future__ import annotations

import numpy as np
import torch
import numba
from numba import typed

from mrv2 import platform
from mrv2.attention.backend import attention_backend
from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import planned_threads, step_kv_bytes, work_split
from mrv2.models.cpu.decode_stack_numba import decode_stack, decode_stack_run, weight_view
from mrv2.models.cpu.onednn_decode import MAX_ONEDNN_DECODE_ROWS, PROJECTIONS, onednn_decode
from mrv2.models.cpu.decode_logits import LmHead, float32_cpu, lm_head
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS
from mrv2.models.layers.linear_plan import MAX_QUANTIZED_GEMV_ROWS
from mrv2.models.layers.quantized import PackedWeight
from mrv2.models.layers.numba_rows import typed_list


# Rows up to which the stack runs a step: float32 weights take the GEMV up to MAX_GEMV_ROWS
# (oneDNN beyond); when every projection is quantized the module path itself runs the packed
# GEMV up to MAX_QUANTIZED_GEMV_ROWS, so the stack does too.
MAX_DECODE_ROWS = MAX_GEMV_ROWS
MAX_QUANTIZED_DECODE_ROWS = MAX_QUANTIZED_GEMV_ROWS


def _packed(module) -> PackedWeight | None:
    """The GGUF blocks or 16-bit weight `module` computes on (`module.packed`), or None."""
    return module.packed


def _kind(module) -> str:
    """What a projection computes on: "float32", "blocks" (GGUF integer blocks) or "half" (a
    16-bit float weight): one typed list holds one kind."""
    weight = _packed(module)
    return "float32" if weight is None else "half" if weight.is_half else "blocks"


def _kinds(layer) -> tuple[str, ...]:
    """Per projection of `layer`: its `_kind`."""
    return tuple(_kind(layer.get_submodule(name)) for name in PROJECTIONS)


# Traits the stack does not compute (OLMo 2's), and those only it computes, not onednn_decode
# (Gemma's).
_UNSUPPORTED_TRAITS = ("norms_after", "qk_norm_over_projection")
_STACK_ONLY_TRAITS = ("sandwich_norms", "norm_unit_offset", "embedding_scale", "local_rope",
                      "attention_softcap", "logit_softcap")


def supports(spec: DecoderSpec | None) -> bool:
    """Whether the stack computes a model that declares `spec`: Llama's or Gemma's layers,
    SiLU- or GeLU(tanh)-gated, with any biases, per-head q/k norms, NoPE layers, partial
    rotary, windows, local rope and soft caps."""
    return (spec is not None and spec.activation in ("silu", "gelu_pytorch_tanh")
            and not any(getattr(spec, trait) for trait in _UNSUPPORTED_TRAITS))


def _layer_qualifies(layer) -> bool:
    """The parts that never change: float32 CPU norms of one eps (q/k norms: both or none),
    each projection packed or float32 CPU with a float32 CPU bias or none, tp 1."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [layer.get_submodule(name) for name in PROJECTIONS]
    eps = layer.input_layernorm.eps
    norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    return (attn.o_proj.tp_size == 1 and mlp.down_proj.tp_size == 1
            and len(norms) in (0, 2) and all(n.eps == eps and float32_cpu(n.weight)
                                             for n in norms)
            and all(p.bias is None or float32_cpu(p.bias) for p in projections)
            and all(n.eps == eps and float32_cpu(n.weight) for n in _layer_norms(layer))
            and all(_packed(p) is not None or float32_cpu(p.weight) for p in projections))


def _layer_norms(layer) -> list:
    """The layer's norms around its sublayers (two, or Gemma's four)."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    return [getattr(layer, name) for name in names if hasattr(layer, name)]


def _rotary_tables(model) -> list[torch.Tensor]:
    """cos and sin of the global rotary table, then of the local one where there is one."""
    return [t for rotary in (model.rotary_emb, model.local_rotary_emb) if rotary is not None
            for t in (rotary.cos_cache, rotary.sin_cache)]


def _embedding(model) -> PackedWeight | torch.Tensor | None:
    """The table `model`'s (a LlamaModel's) embedding looks its rows up in, as the stack
    reads it: the GGUF blocks or 16-bit weight it is packed as, or a float32 CPU
    weight on one rank; None otherwise."""
    embed = model.embed_tokens
    if embed.packed is not None:
        return embed.packed
    if embed.tp_size == 1 and float32_cpu(embed.weight):
        return embed.weight
    return None


def qualifies(model) -> bool:
    """Whether the fused stack can run the weights of `model` (the inner model of a supported
    spec): every layer qualifies, all with one norm eps (the kernel takes one) and each
    projection of one kind (float32, GGUF blocks or 16-bit: one typed list per projection),
    the embedding is one the stack reads, the final norm and rotary tables float32 CPU."""
    layers = list(model.layers)
    tables = _rotary_tables(model)
    return (len(layers) > 0 and all(_layer_qualifies(layer) for layer in layers)
            and len({layer.input_layernorm.eps for layer in layers}) == 1
            and len({_kinds(layer) for layer in layers}) == 1 and float32_cpu(model.norm.weight)
            and _embedding(model) is not None and all(float32_cpu(t) for t in tables))


def max_rows(model) -> int:
    """The most decode rows the stack runs for `model` (one that `qualifies`): with 16-bit
    projections, its plan's `numba_rows` (as the layer path's linears compute)."""
    layer = model.layers[0]
    kinds = _kinds(layer)
    if all(kind == "half" for kind in kinds):
        return _packed(layer.self_attn.qkv_proj).plan.numba_rows
    return MAX_QUANTIZED_DECODE_ROWS if "float32" not in kinds else MAX_DECODE_ROWS


def applies(model, x: torch.Tensor, kv_caches: list[torch.Tensor], meta,
            rows_limit: int = MAX_DECODE_ROWS) -> bool:
    """Whether a fused path computes this step of `model` (one that `qualifies`; `x` its ids
    or float32 hidden states): a decode step of at most `rows_limit` rows on the CPU (torch
    attention backend), over a float32 or 16-bit cache."""
    rows = x.shape[0]
    return (0 < rows <= rows_limit and meta.num_decodes == meta.num_reqs == rows
            and meta.num_actual_tokens == rows and x.device.type == "cpu"
            and (x.dtype == torch.float32 or not x.is_floating_point())
            and not torch.is_grad_enabled()
            and attention_backend(x.device) == platform.CPU
            and all(c.dtype in kv_numba.NUMBA_KV_DTYPES and c.is_contiguous()
                    for c in kv_caches))


def _projection_parameters(module) -> list[torch.Tensor]:
    """The parameters the kernel reads for one projection: its float32 weight, or none (a
    packed weight is created once, with the model, and never given new storage)."""
    return [module.weight] if _packed(module) is None else []


def _projection_view(module, float32_tables: bool = False):
    """The kernel's view of one projection (`weight_view`): the GGUF blocks or 16-bit weight
    it is packed as, else its float32 weight."""
    weight = _packed(module)
    return weight_view(module.weight if weight is None else weight, float32_tables)


def _projection_views(modules) -> typed.List:
    """One projection of every layer as a typed list: its items must share one numba type, so
    where the layers' table dtypes differ (a file mixing K-quants and 32-input types) every
    one gets float32 tables."""
    views = [_projection_view(m) for m in modules]
    if len({numba.typeof(v) for v in views}) > 1:
        views = [_projection_view(m, float32_tables=True) for m in modules]
    return typed_list(tuple(views))


def _stack_tensors(model, kv_caches: list[torch.Tensor], head: LmHead | None
                   ) -> list[torch.Tensor]:
    """Every tensor the kernel reads through a standing view that may be given new storage:
    the final norm, the rotary tables, the caches, a float32 embedding and LM head, then each
    layer's norms and float32 projections."""
    out = [model.norm.weight, *_rotary_tables(model), *kv_caches]
    embedding = _embedding(model)
    out += [w for w in (embedding, None if head is None else head.weight)
            if isinstance(w, torch.Tensor)]
    for layer in model.layers:
        out += [norm.weight for norm in _layer_norms(layer)]
        attn = layer.self_attn
        out += [norm.weight for norm in (attn.q_norm, attn.k_norm) if norm is not None]
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            out += _projection_parameters(module)
            out += [] if module.bias is None else [module.bias]
    return out


def _views(tensors) -> typed.List:
    return typed_list(tuple(t.detach().numpy() for t in tensors))


_NONE = torch.empty(0, dtype=torch.float32)


def _or_none(part: torch.Tensor | torch.nn.Module | None) -> torch.Tensor:
    """A bias, or a norm's weight, as the kernel reads it: a [0] tensor for none."""
    if part is None:
        return _NONE
    return part.weight if isinstance(part, torch.nn.Module) else part


class _StackArgs:
    """The kernel's typed lists of weight and cache views (and its view of the LM head), built
    once per (weights, caches).

    The views share memory with the tensors, so in-place weight changes are seen; `key` is
    the data pointer of every parameter and cache the views read, checked each step, so a
    parameter given new storage (`param.data = ...`) or another cache list rebuilds the lists
    instead of reading stale memory. Parameter objects and packed weights
    themselves are assumed to stay (they are created once, with the model); a packed
    weight's tensors are not in the key (on SmolLM2's 30 layers: 91 pointers a step instead of
    421)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], head: LmHead | None,
                 spec: DecoderSpec) -> None:
        self.kv_caches_list = kv_caches
        self.tensors = _stack_tensors(model, kv_caches, head)
        self.key = self.current_key()
        layers = list(model.layers)
        attn, mlp = layers[0].self_attn, layers[0].mlp
        self.kv_itemsize = kv_caches[0].element_size()  # a typed list's item costs us to read
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.w_embed = weight_view(_embedding(model), linear=False)
        # The kernel's arguments between a step's own (both kernels take them in this order),
        # read once (module attributes cost microseconds a step), in decode_stack's order;
        # rotary tables per layer: 0 NoPE, 1 global, 2 local; windows: 0 every key.
        sandwich = spec.sandwich_norms
        local = model.local_rotary_emb
        no_table = np.empty((0, model.rotary_emb.cos_cache.shape[1]), np.float32)
        self.layer_args = (
            model.rotary_emb.cos_cache.numpy(), model.rotary_emb.sin_cache.numpy(),
            _views(layer.input_layernorm.weight for layer in layers),
            _views((layer.pre_feedforward_layernorm if sandwich
                    else layer.post_attention_layernorm).weight for layer in layers),
            np.float32(layers[0].input_layernorm.eps),
            *(_projection_views([layer.get_submodule(name) for layer in layers])
              for name in PROJECTIONS),
            tuple(_views(_or_none(layer.get_submodule(name).bias) for layer in layers)
                  for name in PROJECTIONS),
            tuple(_views(_or_none(getattr(layer.self_attn, norm)) for layer in layers)
                  for norm in ("q_norm", "k_norm")),
            tuple(_views(_or_none(getattr(layer, norm) if sandwich else None) for layer in layers)
                  for norm in ("post_attention_layernorm", "post_feedforward_layernorm")),
            (np.float32(spec.embedding_scale or 1.0), np.float32(spec.attention_softcap or 0.0),
             np.float32(spec.logit_softcap or 0.0), spec.activation == "gelu_pytorch_tanh"),
            np.array([0 if not layer.self_attn.use_rope else 1 + (layer.self_attn.rope_table or 0)
                      for layer in layers], np.int64),
            *((no_table, no_table) if local is None
              else (local.cos_cache.numpy(), local.sin_cache.numpy())),
            np.array([layer.self_attn.attn.sliding_window for layer in layers], np.int64),
            model.norm.weight.detach().numpy(), np.float32(model.norm.eps),
            typed_list(tuple(kv_numba.numpy_view(c) for c in kv_caches)))
        # and the shapes: heads, kv heads, head size, intermediate size, attention's scale.
        self.shape_args = (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           mlp.intermediate_size, np.float32(attn.attn.scale))
        self.hidden_size = model.norm.weight.shape[0]
        self.head = head
        self.w_head = None if head is None else weight_view(head.weight)
        self.vocab_rows = 0 if head is None else (
            head.weight.shape[0] if isinstance(head.weight, torch.Tensor)
            else head.weight.out_features)

    def current_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def current(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether these lists still view `kv_caches` and the model's current storage."""
        return self.kv_caches_list is kv_caches and self.key == self.current_key()


def decode_model(args: _StackArgs, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`LlamaModel.forward` for a decode step (`applies` holds), with `args` built for the
    step's caches: the embedding, every layer (writing this step's K/V into the caches), the
    final norm -> [rows, hidden]; with it the rows' logits [rows, vocab] when `args` has an
    LM head that runs this many rows (else None)."""
    rows = input_ids.shape[0]
    out = torch.empty(rows, args.hidden_size, dtype=torch.float32)
    head = args.head
    with_logits = head is not None and rows <= head.max_rows
    logits = torch.empty(rows if with_logits else 0, args.vocab_rows, dtype=torch.float32)
    seq_lens = np.ascontiguousarray(meta.seq_lens_np[:rows], dtype=np.int32)
    kv_per_item, splits = _work_split(args, seq_lens)
    decode_stack(
        input_ids.contiguous().numpy(), args.w_embed, positions.contiguous().numpy(),
        *args.layer_args, meta.block_tables.numpy(), seq_lens, meta.slot_mapping[:rows].numpy(),
        *args.shape_args, kv_per_item, splits, out.numpy(), args.w_head, logits.numpy())
    return out, logits if with_logits else None


def _work_split(args: _StackArgs, seq_lens: np.ndarray) -> tuple[int, int]:
    kv_bytes = step_kv_bytes(seq_lens, args.num_kv_heads, args.head_dim, args.kv_itemsize,
                             len(args.kv_caches_list))
    return work_split(len(seq_lens), args.num_kv_heads, planned_threads(), kv_bytes)


def decode_model_run(args: _StackArgs, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                     num_steps: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [rows, num_steps]: `input_ids`, the step before's, then num_steps - 1 decode
    steps' argmax from `decode_model`'s inputs; nan_rows [rows]) in one call (`args` with an LM
    head for the rows; `meta`'s tables hold every block written): decode_stack_run."""
    rows = input_ids.shape[0]
    seq_lens = np.array(meta.seq_lens_np[:rows], dtype=np.int32)  # copies: advanced in place
    step_positions = positions.numpy().copy()
    kv_per_item, splits = _work_split(args, seq_lens)
    tokens = torch.empty(rows, num_steps, dtype=torch.int64)
    nan_rows = torch.empty(rows, dtype=torch.bool)
    decode_stack_run(
        input_ids.contiguous().numpy(), args.w_embed, step_positions, *args.layer_args,
        meta.block_tables.numpy(), seq_lens, block_size, *args.shape_args, kv_per_item, splits,
        np.empty((rows, args.hidden_size), np.float32), args.w_head,
        np.empty((rows, args.vocab_rows), np.float32), tokens.numpy(), nan_rows.numpy())
    return tokens, nan_rows


class FusedDecode:
    """The fused paths of one model (`fused_decode`): `forward` runs a decode step on the
    stack where `applies` holds, on the layers between oneDNN calls (`onednn_decode`) for the
    rows that path runs, and leaves every other step to the model (None). It keeps the
    kernel's views (`_StackArgs`), rebuilt when the caches or any tensor's storage change.
    With an LM head (`decode_logits.lm_head`), the stack's steps compute their rows' logits
    too, returned with the hidden states."""

    def __init__(self, model, head: LmHead | None, spec: DecoderSpec) -> None:
        self.model = model  # the inner (LlamaModel-layout) model
        self.args: _StackArgs | None = None
        self.head = head
        self.spec = spec
        self.max_rows = max_rows(model)
        # From the rows where its linears move to oneDNN, a bfloat16 or float32 model's steps
        # run the layers between oneDNN calls instead (onednn_decode.py: Llama's layers only).
        plain = spec.activation == "silu" and not any(getattr(spec, trait)
                                                      for trait in _STACK_ONLY_TRAITS)
        self.onednn = onednn_decode(model) if plain else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(final hidden states [rows, hidden], their logits [rows, vocab] or None) of a step
        these paths run; None for a step the model runs itself."""
        rows = input_ids.shape[0]
        if self.onednn is not None and self.onednn.runs(rows):
            cos_sin, hidden = self.model.embed(input_ids, positions)
            if not applies(self.model, hidden, kv_caches, meta, MAX_ONEDNN_DECODE_ROWS):
                return self.model.forward_layers(cos_sin, hidden, kv_caches, meta), None
            return self.onednn(cos_sin, hidden, kv_caches, meta), None
        if not applies(self.model, input_ids, kv_caches, meta, self.max_rows):
            return None
        if self.args is None or not self.args.current(kv_caches):
            self.args = _StackArgs(self.model, kv_caches, self.head, self.spec)
        return decode_model(self.args, input_ids, positions, meta)

    def run_steps(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  kv_caches: list[torch.Tensor], meta, num_steps: int, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`decode_model_run` for rows that decode by argmax, from this step's inputs; None
        where the stack with its LM head does not take them (the caller steps one by one)."""
        rows = input_ids.shape[0]
        if (self.head is None or rows > self.head.max_rows
                or (self.onednn is not None and self.onednn.runs(rows))
                or not applies(self.model, input_ids, kv_caches, meta, self.max_rows)):
            return None
        if self.args is None or not self.args.current(kv_caches):
            self.args = _StackArgs(self.model, kv_caches, self.head, self.spec)
        return decode_model_run(self.args, input_ids, positions, meta, num_steps, block_size)

    def release_kv_views(self) -> None:
        """Drop the cached views of the KV cache (they keep its memory alive), so the cache
        can be freed (Worker.sleep); the next step builds them again."""
        self.args = None
        if self.onednn is not None:
            self.onednn.release_kv_views()


def fused_decode(model) -> FusedDecode | None:
    """The fused paths of `model` (a causal LM whose `decoder_spec` the stack `supports`, its
    weights loaded and packed) when its inner model `qualifies` (checked once, on the loaded
    weights), with its LM head in the stack where `decode_logits.lm_head` takes it; else
    None."""
    inner, spec = getattr(model, "model", None), getattr(model, "decoder_spec", None)
    if not supports(spec) or inner is None or not qualifies(inner):
        return None
    return FusedDecode(inner, lm_head(model), spec)
