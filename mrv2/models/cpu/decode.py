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

from mrv2 import distributed, platform
from mrv2.attention.backend import attention_backend
from mrv2.attention import kv_numba
from mrv2.attention.decode_numba import planned_threads, step_kv_bytes, work_split
from mrv2.models.cpu.onednn_decode import MAX_ONEDNN_DECODE_ROWS, PROJECTIONS, onednn_decode
from mrv2.models.cpu.decode_logits import LmHead, float32_cpu, lm_head
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.cpu_gemv import MAX_GEMV_ROWS
from mrv2.models.layers.linear_plan import MAX_QUANTIZED_GEMV_ROWS
from mrv2.models.cpu.decode_stack_numba import KV_SHARED, ONE_STEP
from mrv2.models.cpu.stack_delta_net import (LINEAR_PROJECTIONS, attention_sources,
                                             mixer_projections, mixers_qualify, token_mixer)
from mrv2.models.cpu.stack_moe import (layer_projection, moe_qualifies, moe_supported,
                                       sparse_block)
from mrv2.models.cpu.moe_numba import expert_weights
from mrv2.models.layers.quantized import PackedWeight
from mrv2.models.cpu.stack_args import (PER_LAYER_PROJECTIONS, StackArgs, embedding_table,
                                        group_tables, has_per_layer_inputs, kv_mode,
                                        layer_norms, packed_of, request_slots,
                                        rotary_tables)


# Rows up to which the stack runs a step: float32 weights take the GEMV up to MAX_GEMV_ROWS
# (oneDNN beyond); when every projection is quantized the module path itself runs the packed
# GEMV up to MAX_QUANTIZED_GEMV_ROWS, so the stack does too.
MAX_DECODE_ROWS = MAX_GEMV_ROWS
MAX_QUANTIZED_DECODE_ROWS = MAX_QUANTIZED_GEMV_ROWS

# decode_stack's `aux` for a model without EAGLE-3's layer streams.
NO_STREAMS = np.empty((0, 0), np.float32)


def _weight_kind(weight) -> str:
    """What a weight is: "float32", "blocks" (GGUF integer blocks) or "half" (a 16-bit float
    weight): one typed list holds one kind."""
    if not isinstance(weight, PackedWeight):
        return "float32"
    return "half" if weight.is_half else "blocks"


def _kind(module) -> str | None:
    """The kind of weight a projection computes on (None: the layer has no such one)."""
    return None if module is None else _weight_kind(packed_of(module))


def _kinds(layer) -> tuple[str | None, ...]:
    """Per projection of `layer`: its `_kind`."""
    return tuple(_kind(layer_projection(layer, name)) for name in PROJECTIONS)


def _mixer_kinds(layer) -> tuple[str | None, ...]:
    """Per linear-attention projection slot of `layer`: its `_kind` (Nones: an attention
    layer)."""
    mixer = token_mixer(layer)
    if mixer is None:
        return (None,) * len(LINEAR_PROJECTIONS)
    return tuple(map(_kind, mixer_projections(mixer)))


def _model_kinds(model) -> set[str]:
    """Every kind of weight the stack's linears read in `model`, its experts' and its
    linear-attention layers' included."""
    kinds = {kind for layer in model.layers for kind in _kinds(layer) + _mixer_kinds(layer)
             if kind is not None}
    return kinds | {_weight_kind(w) for block in filter(None, map(sparse_block, model.layers))
                    for pair in expert_weights(block.experts) for w in pair}


# Traits only the stack computes, not onednn_decode (Gemma's, Gemma 4's, OLMo 2's,
# Ministral 3's).
_STACK_ONLY_TRAITS = ("sandwich_norms", "norm_unit_offset", "embedding_scale", "local_rope",
                      "attention_softcap", "logit_softcap", "position_query_scale",
                      "norms_after", "qk_norm_over_projection", "value_norm",
                      "per_layer_input_size", "kv_sources", "attention_sinks",
                      "linear_attention", "attention_output_gate")


def supports(spec: DecoderSpec | None) -> bool:
    """Whether the stack computes a model that declares `spec`: Llama's, Gemma's or OLMo 2's
    layers, SiLU- or GeLU(tanh)-gated, with any biases, q/k norms per head or over the
    projection, NoPE layers, partial rotary, windows, local rope, soft caps, position-scaled
    queries and Gemma 4's value norms, per-layer inputs and KV-shared layers, attention sinks
    (gpt-oss); routed experts as stack_moe computes them; gated attention and linear-attention
    layers (Qwen3.5: stack_delta_net takes the layers it computes); an EAGLE-3 head's
    target's layer streams (`aux_hidden_layers`)."""
    return (spec is not None and spec.activation in ("silu", "gelu_pytorch_tanh")
            and moe_supported(spec.moe, spec.activation))


def _float32_or_packed(module) -> bool:
    return packed_of(module) is not None or float32_cpu(module.weight)


def _layer_qualifies(layer) -> bool:
    """The parts that never change: float32 CPU norms of one eps (q/k norms: both or none; a
    layer that reads another's keys and values, q alone), each projection packed or float32
    CPU with a float32 CPU bias or none, tp 1; Gemma 4's per-layer modules likewise (a
    linear-attention layer's own parts: stack_delta_net.mixers_qualify)."""
    attn = getattr(layer, "self_attn", None)
    projections = [p for p in (layer_projection(layer, name) for name in PROJECTIONS)
                   if p is not None]
    eps = layer.post_attention_layernorm.eps
    norms = [] if attn is None else [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    paired = len(norms) in (0, 2) or (kv_mode(attn) == KV_SHARED and attn.q_norm is not None)
    per_layer = [getattr(layer, name) for name in PER_LAYER_PROJECTIONS if hasattr(layer, name)]
    per_layer_norm = getattr(layer, "post_per_layer_input_norm", None)
    sinks = None if attn is None else attn.attn.sinks
    return (all(p.tp_size == 1 for p in projections)
            and paired and (sinks is None or float32_cpu(sinks))
            and all(n.eps == eps and float32_cpu(n.weight) for n in norms)
            and all(p.bias is None or float32_cpu(p.bias) for p in projections + per_layer)
            and all(n.eps == eps and float32_cpu(n.weight) for n in layer_norms(layer))
            and all(_float32_or_packed(p) for p in projections + per_layer)
            and (per_layer_norm is None or (per_layer_norm.eps == eps
                                            and float32_cpu(per_layer_norm.weight))))


def _per_layer_inputs_qualify(model, eps: float) -> bool:
    """Gemma 4's per-layer inputs, where the model has them: a table the stack reads, a
    float32 or packed projection and float32 norm of the layers' eps, each layer's gate and
    projection of one kind."""
    if not has_per_layer_inputs(model):
        return True
    norm = model.per_layer_projection_norm
    layers = list(model.layers)
    return (embedding_table(model.embed_tokens_per_layer) is not None
            and _float32_or_packed(model.per_layer_model_projection)
            and norm.eps == eps and float32_cpu(norm.weight)
            and all(len({_kind(getattr(layer, name)) for layer in layers}) == 1
                    for name in PER_LAYER_PROJECTIONS))


def qualifies(model) -> bool:
    """Whether the fused stack can run the weights of `model` (the inner model of a supported
    spec): every layer qualifies, all with one norm eps (the kernel takes one) and each
    projection of one kind (float32, GGUF blocks or 16-bit: one typed list per projection),
    the embedding is one the stack reads, the final norm and rotary tables float32 CPU; the
    MoE layers as stack_moe takes them."""
    layers = list(model.layers)
    tables = rotary_tables(model)
    eps = {layer.post_attention_layernorm.eps for layer in layers}
    kinds = [_kinds(layer) + _mixer_kinds(layer) for layer in layers]
    return (len(layers) > 0 and all(_layer_qualifies(layer) for layer in layers)
            and len(eps) == 1 and _per_layer_inputs_qualify(model, eps.pop())
            and mixers_qualify(model)
            and all(len({k[j] for k in kinds} - {None}) <= 1 for j in range(len(kinds[0])))
            and moe_qualifies(model) and float32_cpu(model.norm.weight)
            and embedding_table(model.embed_tokens) is not None
            and all(float32_cpu(t) for t in tables))


def max_rows(model) -> int:
    """The most decode rows the stack runs for `model` (one that `qualifies`): with 16-bit
    or block projections, their plan's `numba_rows` (as the layer path's linears compute:
    blocks beside a bfloat16 copy take only a few), at most MAX_QUANTIZED_DECODE_ROWS."""
    kinds = _model_kinds(model)
    if "float32" in kinds:
        return MAX_DECODE_ROWS
    attn = model.layers[attention_sources(model)[0]].self_attn
    rows = packed_of(attn.qkv_proj).plan.numba_rows
    if kinds == {"half"}:
        return rows
    if kinds == {"blocks"}:
        return min(rows, MAX_QUANTIZED_DECODE_ROWS)
    return MAX_QUANTIZED_DECODE_ROWS


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


def decode_model(args: StackArgs, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta, aux: np.ndarray = NO_STREAMS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`LlamaModel.forward` for a decode step (`applies` holds), with `args` built for the
    step's caches: the embedding, every layer (writing this step's K/V into the caches), the
    final norm -> [rows, hidden]; with it the rows' logits [rows, vocab] when `args` has an
    LM head that runs this many rows (else None). `aux` [rows, layers * hidden]: the streams
    entering `args.aux_layers` (EAGLE-3's), written too."""
    rows = input_ids.shape[0]
    out = torch.empty(rows, args.hidden_size, dtype=torch.float32)
    head = args.head
    with_logits = head is not None and rows <= head.max_rows
    logits = torch.empty(rows if with_logits else 0, args.vocab_rows, dtype=torch.float32)
    tables = group_tables(meta, rows)
    kv_per_item, splits = _work_split(args, tables[1], meta.decode_sequences)
    args.decode_stack(
        input_ids.contiguous().numpy(), args.w_embed, positions.contiguous().numpy(),
        *args.layer_args, *tables, request_slots(meta, rows), *args.shape_args, kv_per_item,
        splits, out.numpy(), args.w_head, logits.numpy(), 0, *ONE_STEP, args.aux_layers, aux)
    return out, logits if with_logits else None


def _work_split(args: StackArgs, seq_lens: np.ndarray, sequences: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(kv heads per work item, context splits) of each layer's attention this step: one plan
    per kv head count (Gemma 4's global layers have their own), for the step's K/V bytes and
    its `sequences` (the rows' requests: AttentionMetadata.decode_sequences)."""
    kv_bytes = step_kv_bytes(seq_lens, 1, args.kv_width_sum, args.kv_itemsize, 1)
    plans = np.array([work_split(sequences, int(heads), planned_threads(), kv_bytes)
                      for heads in args.kv_head_counts], np.int64)[args.kv_head_count_of_layer]
    return np.ascontiguousarray(plans[:, 0]), np.ascontiguousarray(plans[:, 1])


def decode_model_run(args: StackArgs, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                     num_steps: int, block_size: int, stop_ids: np.ndarray | None = None,
                     aux: np.ndarray = NO_STREAMS
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [rows, num_steps]: `input_ids`, the step before's, then num_steps - 1 decode
    steps' argmax from `decode_model`'s inputs; nan_rows [rows]; the last step's final hidden
    states [rows, hidden]) in one call (`args` with an LM head for the rows; `meta`'s tables
    hold every block written): decode_stack with `tokens` to fill. The call ends after the
    step where every row has sampled one of its `stop_ids` ([rows, k] int64, -1 pads:
    sampler/run_stops.py; None: none, the run goes to its end); each row's later tokens repeat
    its last, and the hidden states (and `aux`'s streams, as decode_model's) are that
    step's."""
    rows = input_ids.shape[0]
    seq_lens = np.array(meta.seq_lens_np[:rows], dtype=np.int32)  # copies: advanced in place
    step_positions = positions.numpy().copy()
    kv_per_item, splits = _work_split(args, seq_lens, rows)
    tokens = torch.empty(rows, num_steps, dtype=torch.int64)
    nan_rows = torch.empty(rows, dtype=torch.bool)
    hidden = torch.empty(rows, args.hidden_size, dtype=torch.float32)
    tables = group_tables(meta, rows)[0]
    args.decode_stack(
        input_ids.contiguous().numpy(), args.w_embed, step_positions, *args.layer_args,
        tables, seq_lens, np.empty((len(tables), rows), np.int64), request_slots(meta, rows),
        *args.shape_args, kv_per_item, splits, hidden.numpy(), args.w_head,
        np.empty((rows, args.vocab_rows), np.float32), block_size, tokens.numpy(),
        nan_rows.numpy(), np.empty((rows, 0), np.int64) if stop_ids is None else stop_ids,
        args.aux_layers, aux)
    return tokens, nan_rows, hidden


class FusedDecode:
    """The fused paths of one model (`fused_decode`): `forward` runs a decode step on the
    stack where `applies` holds, on the layers between oneDNN calls (`onednn_decode`) for the
    rows that path runs, and leaves every other step to the model (None). It keeps the
    kernel's views (`StackArgs`), rebuilt when the caches or any tensor's storage change.
    With an LM head (`decode_logits.lm_head`), the stack's steps compute their rows' logits
    too, returned with the hidden states."""

    def __init__(self, model, head: LmHead | None, spec: DecoderSpec) -> None:
        self.model = model  # the inner (LlamaModel-layout) model
        self.args: StackArgs | None = None
        self.head = head
        self.spec = spec
        self.max_rows = max_rows(model)
        # From the rows where its linears move to oneDNN, a bfloat16 or float32 model's steps
        # run the layers between oneDNN calls instead (onednn_decode.py: Llama's layers only).
        # (It does not output an EAGLE-3 head's layer streams.)
        plain = (spec.activation == "silu" and spec.moe is None and not spec.aux_hidden_layers
                 and not any(getattr(spec, trait) for trait in _STACK_ONLY_TRAITS))
        self.onednn = onednn_decode(model) if plain else None

    @property
    def verify_rows(self) -> int:
        """The most rows one call takes with their logits (speculative decoding keeps a
        step's verify rows within it). Where the stack takes one row (a 16-bit model on a CPU
        whose few-row kernels read the packed weights: it would verify no draft), the rows
        that the layers between oneDNN calls take (an EAGLE-3 target's modules take as many):
        those round as a batch of that many rows does, so a near-tie can fall the other way
        than at one row, as it can between batch sizes (batch-invariant mode is exact)."""
        rows = self.max_rows if self.head is None else min(self.max_rows, self.head.max_rows)
        if rows <= 1 and (self.onednn is not None or self.spec.aux_hidden_layers):
            return MAX_ONEDNN_DECODE_ROWS
        return rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(final hidden states [rows, hidden], their logits [rows, vocab] or None) of a step
        these paths run; None for a step the model runs itself."""
        rows = input_ids.shape[0]
        if self.onednn is not None and self.onednn.runs(rows):
            rope, hidden = self.model.embed(input_ids, positions)
            if not applies(self.model, hidden, kv_caches, meta, MAX_ONEDNN_DECODE_ROWS):
                return self.model.forward_layers(rope, hidden, kv_caches, meta), None
            return self.onednn(rope, hidden, kv_caches, meta), None
        if not applies(self.model, input_ids, kv_caches, meta, self.max_rows):
            return None
        if self.args is None or not self.args.current(kv_caches):
            self.args = StackArgs(self.model, kv_caches, self.head, self.spec)
        return decode_model(self.args, input_ids, positions, meta, self._streams(rows))

    def run_steps(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  kv_caches: list[torch.Tensor], meta, num_steps: int, block_size: int,
                  stop_ids: np.ndarray | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`decode_model_run` for rows that decode by argmax, from this step's inputs; None
        where the stack with its LM head does not take them (the caller steps one by one)."""
        rows = input_ids.shape[0]
        if (self.head is None or rows > self.head.max_rows
                or (self.onednn is not None and self.onednn.runs(rows))
                or not applies(self.model, input_ids, kv_caches, meta, self.max_rows)):
            return None
        if self.args is None or not self.args.current(kv_caches):
            self.args = StackArgs(self.model, kv_caches, self.head, self.spec)
        return decode_model_run(self.args, input_ids, positions, meta, num_steps, block_size,
                                stop_ids, self._streams(rows))

    def _streams(self, rows: int) -> np.ndarray:
        """An EAGLE-3 head's target: a new [rows, layers * hidden] for the step's layer
        streams, which the model then holds as the module path's (aux_hidden_states); else
        NO_STREAMS."""
        layers = self.spec.aux_hidden_layers
        if not layers:
            return NO_STREAMS
        streams = torch.empty(rows, len(layers) * self.args.hidden_size, dtype=torch.float32)
        self.model.aux_hidden_states = streams
        return streams.numpy()

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
    None. A model split into pipeline stages has none: its stages hand over between layers."""
    inner, spec = getattr(model, "model", None), getattr(model, "decoder_spec", None)
    if distributed.get_pp_size() > 1 or not supports(spec) or inner is None \
            or not qualifies(inner):
        return None
    return FusedDecode(inner, lm_head(model), spec)
