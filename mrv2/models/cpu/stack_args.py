"""The fused decode stack's arguments (decode_stack_numba.py): numba views of a loaded model's
weights and KV caches, built once per (weights, caches) and rebuilt when any storage changes,
and the per-step block tables of each KV cache group. decode.py decides when the stack runs.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import typed

from mrv2.attention import kv_numba
from mrv2.models.cpu.decode_logits import LmHead, float32_cpu
from mrv2.models.cpu.decode_stack_numba import decode_stack
from mrv2.models.cpu.stack_delta_net import attention_sources, mixer_parameters, recurrent_args
from mrv2.models.cpu.stack_moe import dense_mlp, layer_projection, moe_args, moe_parameters
from mrv2.models.cpu.stack_views_numba import (NO_MATRIX, projection_view, projection_views,
                                                weight_view)
from mrv2.models.cpu.decode_stack_numba import KV_FROM_KEYS, KV_OWN, KV_SHARED
from mrv2.models.cpu.onednn_decode import PROJECTIONS
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.numba_rows import typed_list
from mrv2.models.layers.quantized import PackedWeight
from mrv2.utils.numba_call import TypedCall


def packed_of(module) -> PackedWeight | None:
    """The GGUF blocks or 16-bit weight `module` computes on (`module.packed`), or None."""
    return module.packed


def layer_norms(layer) -> list:
    """The layer's norms around its sublayers (two, or Gemma's four)."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    return [getattr(layer, name) for name in names if hasattr(layer, name)]


def rotary_tables(model) -> list[torch.Tensor]:
    """cos and sin of the global rotary table, then of the local one where there is one."""
    return [t for rotary in (model.rotary_emb, model.local_rotary_emb) if rotary is not None
            for t in (rotary.cos_cache, rotary.sin_cache)]


def embedding_table(embed) -> PackedWeight | torch.Tensor | None:
    """The table an embedding (a VocabParallelEmbedding: the token embedding, Gemma 4's
    per-layer one) looks its rows up in, as the stack reads it: the GGUF blocks or 16-bit
    weight it is packed as, or a float32 CPU weight on one rank; None otherwise."""
    if embed.packed is not None:
        return embed.packed
    if embed.tp_size == 1 and float32_cpu(embed.weight):
        return embed.weight
    return None


def kv_mode(attn) -> int:
    """A layer's keys and values as the kernel computes them (decode_stack_numba's KV_OWN,
    KV_FROM_KEYS, KV_SHARED): from which projections its qkv_proj computes."""
    return {"qkv": KV_OWN, "qk": KV_FROM_KEYS, "q": KV_SHARED}[attn.qkv_proj.projections]


# Gemma 4's per-layer input modules, per layer (gate, projection) and of the model.
PER_LAYER_PROJECTIONS = ("per_layer_input_gate", "per_layer_projection")


def has_per_layer_inputs(model) -> bool:
    return getattr(model, "per_layer_input_size", 0) > 0


def _projection_parameters(module) -> list[torch.Tensor]:
    """The parameters the kernel reads for one projection: its float32 weight, or none (a
    packed weight is created once, with the model, and never given new storage)."""
    return [module.weight] if packed_of(module) is None else []


def _stack_tensors(model, kv_caches: list[torch.Tensor], head: LmHead | None
                   ) -> list[torch.Tensor]:
    """Every tensor the kernel reads through a standing view that may be given new storage:
    the final norm, the rotary tables, the caches, a float32 embedding and LM head, then each
    layer's norms and float32 projections."""
    out = [model.norm.weight, *rotary_tables(model), *kv_caches]
    tables = [embedding_table(model.embed_tokens), None if head is None else head.weight]
    per_layer = has_per_layer_inputs(model)
    if per_layer:
        tables.append(embedding_table(model.embed_tokens_per_layer))
        out += _projection_parameters(model.per_layer_model_projection)
        out.append(model.per_layer_projection_norm.weight)
    out += [w for w in tables if isinstance(w, torch.Tensor)] + moe_parameters(model)
    out += mixer_parameters(model)
    layers = list(model.layers)
    for layer, source in zip(layers, attention_sources(model)):
        out += [norm.weight for norm in layer_norms(layer)]
        attn = layers[source].self_attn
        out += [t for t in (getattr(attn.q_norm, "weight", None),
                            getattr(attn.k_norm, "weight", None), attn.attn.sinks)
                if t is not None]
        for module in filter(None, (layer_projection(layer, name) for name in PROJECTIONS)):
            out += _projection_parameters(module)
            out += [] if module.bias is None else [module.bias]
        if hasattr(layer, "layer_scalar"):
            out.append(layer.layer_scalar)
        if per_layer:
            for name in PER_LAYER_PROJECTIONS:
                out += _projection_parameters(getattr(layer, name))
            out.append(layer.post_per_layer_input_norm.weight)
    return out


def _views(tensors) -> typed.List:
    return typed_list(tuple(t.detach().numpy() for t in tensors))


_NONE = torch.empty(0, dtype=torch.float32)


def _per_layer_args(model) -> tuple:
    """decode_stack's `per_layer` (Gemma 4's per-layer inputs): the per-layer table, the
    embeddings' projection and its norm, then each layer's gate, projection and norm; for a
    model without them, empty views of the same types as a float32 model's."""
    if not has_per_layer_inputs(model):
        return (NO_MATRIX, NO_MATRIX, _NONE.numpy(), typed_list((NO_MATRIX,)),
                typed_list((NO_MATRIX,)), typed_list((_NONE.numpy(),)))
    layers = list(model.layers)
    return (weight_view(embedding_table(model.embed_tokens_per_layer), linear=False),
            projection_view(model.per_layer_model_projection),
            model.per_layer_projection_norm.weight.detach().numpy(),
            *(projection_views([getattr(layer, name) for layer in layers])
              for name in PER_LAYER_PROJECTIONS),
            _views(layer.post_per_layer_input_norm.weight for layer in layers))


def _bias(module: torch.nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.bias


def _mlp_width(layer) -> int:
    """The width of the layer's dense slot (stack_moe.dense_mlp; 0: none)."""
    mlp = dense_mlp(layer)
    return 0 if mlp is None else mlp.intermediate_size


def _or_none(part: torch.Tensor | torch.nn.Module | None) -> torch.Tensor:
    """A bias, or a norm's weight, as the kernel reads it: a [0] tensor for none."""
    if part is None:
        return _NONE
    return part.weight if isinstance(part, torch.nn.Module) else part


class StackArgs:
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
        # Each layer's attention and KV cache (a linear-attention layer's: another layer's,
        # never computed for it: stack_delta_net.attention_sources).
        sources = attention_sources(model)
        attns = [layers[j].self_attn for j in sources]
        attention_caches = [kv_caches[j] for j in sources]
        attn = attns[0]
        # Each layer's KV cache group (core/kv_cache_layout.py): whose tables it reads.
        self.kv_groups = np.array([a.attn.kv_cache_group for a in attns], np.int64)
        # (A typed list's item costs us to read.)
        self.kv_itemsize = attention_caches[0].element_size()
        # Per layer (Gemma 4's differ): kv heads, head size, MLP width.
        self.num_kv_heads = np.array([a.num_kv_heads for a in attns], np.int64)
        self.head_dim = np.array([a.head_dim for a in attns], np.int64)
        # The distinct kv head counts (one attention work split each) and each layer's.
        self.kv_head_counts, self.kv_head_count_of_layer = np.unique(self.num_kv_heads,
                                                                     return_inverse=True)
        self.kv_width_sum = int((self.num_kv_heads * self.head_dim).sum())
        self.w_embed = weight_view(embedding_table(model.embed_tokens), linear=False)
        # The kernel's arguments between a step's own (both kernels take them in this order),
        # read once (module attributes cost microseconds a step), in decode_stack's order;
        # rotary tables per layer: 0 NoPE, 1 global, 2 local; windows: 0 every key.
        sandwich, after = spec.sandwich_norms, spec.norms_after
        # The norms before attention and before the MLP: Llama's two, Gemma's input and
        # pre-feedforward ones, none for OLMo 2 (norms after the sublayers only: a [0] view).
        before_mlp = ("pre_feedforward_layernorm" if sandwich
                      else None if after else "post_attention_layernorm")
        local = model.local_rotary_emb
        # Attention's: every layer but a linear-attention one has them.
        projections = [projection_views([layer_projection(layer, name) for layer in layers])
                       for name in PROJECTIONS[:2]]
        like = projections[1][0]
        projections += [projection_views([layer_projection(layer, name) for layer in layers],
                                         like) for name in PROJECTIONS[2:]]
        no_table = np.empty((0, model.rotary_emb.cos_cache.shape[1]), np.float32)
        query_scale = spec.position_query_scale or (0.0, 1)  # beta 0: no scaling
        self.layer_args = (
            model.rotary_emb.cos_cache.numpy(), model.rotary_emb.sin_cache.numpy(),
            _views(_or_none(None if after else layer.input_layernorm) for layer in layers),
            _views(_or_none(before_mlp and getattr(layer, before_mlp)) for layer in layers),
            np.float32(layers[0].post_attention_layernorm.eps),
            *projections,
            tuple(_views(_or_none(_bias(layer_projection(layer, name))) for layer in layers)
                  for name in PROJECTIONS),
            tuple(_views(_or_none(getattr(a, norm)) for a in attns)
                  for norm in ("q_norm", "k_norm")),
            tuple(_views(_or_none(getattr(layer, norm) if sandwich or after else None)
                         for layer in layers)
                  for norm in ("post_attention_layernorm", "post_feedforward_layernorm")),
            (np.float32(spec.embedding_scale or 1.0), np.float32(spec.attention_softcap or 0.0),
             np.float32(spec.logit_softcap or 0.0), spec.activation == "gelu_pytorch_tanh",
             np.float32(query_scale[0]), np.int64(query_scale[1]),
             spec.qk_norm_over_projection, spec.value_norm, spec.attention_output_gate),
            np.array([0 if not a.use_rope else 1 + (a.rope_table or 0) for a in attns],
                     np.int64),
            *((no_table, no_table) if local is None
              else (local.cos_cache.numpy(), local.sin_cache.numpy())),
            np.array([a.attn.sliding_window for a in attns], np.int64),
            _views(_or_none(a.attn.sinks) for a in attns),
            self.kv_groups, model.norm.weight.detach().numpy(), np.float32(model.norm.eps),
            typed_list(tuple(kv_numba.numpy_view(c) for c in attention_caches)),
            np.array([kv_mode(a) for a in attns], np.int64),
            _views(getattr(layer, "layer_scalar", _NONE) for layer in layers),
            _per_layer_args(model), moe_args(model, spec, like),
            recurrent_args(model, kv_caches, like))
        # and the shapes: heads, kv heads, head size, MLP width (per layer), attention's scale.
        self.shape_args = (attn.num_heads, self.num_kv_heads, self.head_dim,
                           np.array([_mlp_width(layer) for layer in layers], np.int64),
                           np.float32(attn.attn.scale))
        self.hidden_size = model.norm.weight.shape[0]
        # EAGLE-3's layers whose input streams the stack also outputs (none: empty).
        self.aux_layers = np.array(spec.aux_hidden_layers, np.int64)
        self.head = head
        self.w_head = None if head is None else weight_view(head.weight)
        self.vocab_rows = 0 if head is None else (
            head.weight.shape[0] if isinstance(head.weight, torch.Tensor)
            else head.weight.out_features)
        # The kernel, typing the views above once rather than at every call.
        self.decode_stack = TypedCall(decode_stack)

    def current_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def current(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether these lists still view `kv_caches` and the model's current storage."""
        return self.kv_caches_list is kv_caches and self.key == self.current_key()


def group_tables(meta, rows: int) -> tuple[tuple, np.ndarray, np.ndarray]:
    """(block tables, seq_lens, slots) as the stack takes them: every KV cache group's table,
    and their slots [groups, rows]."""
    groups = [meta, *meta.other_groups]
    slots = (groups[0].slot_mapping[None, :rows].numpy() if len(groups) == 1 else
             np.stack([group.slot_mapping[:rows].numpy() for group in groups]))
    seq_lens = np.ascontiguousarray(meta.seq_lens_np[:rows], dtype=np.int32)
    return tuple(group.block_tables.numpy() for group in groups), seq_lens, slots


def request_slots(meta, rows: int) -> np.ndarray:
    """The rows' request slots [rows] int32 (`AttentionMetadata.slots_np`), where a
    linear-attention layer keeps each row's state; zeros where the metadata has none (a
    model without such layers never reads them)."""
    if meta.slots_np is None:
        return np.zeros(rows, np.int32)
    return np.ascontiguousarray(meta.slots_np[:rows], dtype=np.int32)
