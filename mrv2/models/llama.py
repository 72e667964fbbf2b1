"""Llama-family decoder: Llama, Mistral, Ministral 3 (Mistral 3's text model), Qwen2, Qwen3,
Phi-3 / Phi-4-mini, SmolLM3 and (with its own layer, olmo2.py) OLMo 2 share this
implementation.

Differences are declared in the model's DecoderSpec (decoder_spec.py), not copied:
- Qwen2 always has q/k/v bias (no o_proj bias); Llama/Qwen3 follow `attention_bias` for
  q/k/v and o_proj; Mistral has no bias.
- Qwen3 applies a per-head RMSNorm to q and k (`q_norm`, `k_norm`) before rotary, and takes
  `head_dim` from the config (it need not be hidden_size / num_heads).
- Phi-3 checkpoints store `qkv_proj` and `gate_up_proj` fused (loaded whole, or split per rank
  under tensor parallelism: layers/linear.py); its LongRoPE and partial rotary are the rotary
  layer's (layers/rotary.py).
- SmolLM3 skips rotary in the layers `no_rope_layers` marks 0 (NoPE layers).
- Ministral 3 scales the rotated queries by 1 + beta * log(1 + floor(position / original))
  (`llama_4_scaling_beta`: exactly 1 within the original context).
- Sliding-window attention in the layers the config gives a window (`layer_windows`).
- `tie_word_embeddings` reuses the embedding matrix as the LM head.

Tensor parallelism (mrv2/models/layers/linear.py): qkv_proj and gate_up_proj are column-
parallel (each rank owns its q heads, its kv heads and its part of the MLP), o_proj and
down_proj row-parallel (all_reduce), the embedding and the LM head vocab-parallel (the logits
are all-gathered, so every rank samples from the same full logits). Norms and rotary tables are
replicated. The rank and size come from `mrv2.distributed` when the model is built.

The step is one flattened token batch [T]; attention reads/writes the paged KV cache.
Parameter names follow the checkpoint except for the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mrv2 import distributed
from mrv2.attention import Attention, AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.core.kv_cache_layout import layer_kv_shape, layer_windows, recurrent_layers
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.linear import (QKVLinear, RowParallelLinear, default_weight_loader,
                                       narrow, set_weight_attrs)
from mrv2.models.layers.moe import expert_shard, feed_forward
from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                parallel_logits)
from mrv2.models.layers.norm import RMSNorm, pre_norm
from mrv2.pipeline import MissingLayer, held_by_stage, receive_stream, send_stream, stage_layers
from mrv2.models.layers.rotary import (RotaryEmbedding, RotaryInputs, apply_rotary_qk,
                                       normalize_heads, position_query_scale,
                                       rope_parameters_from_config)

# (fused param, checkpoint name, shard id)
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint tensors that are derived state, not parameters.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.head_dim = model_config.head_dim
        self.qkv_proj = QKVLinear(hf.hidden_size, self.head_dim,
                                  model_config.num_attention_heads, model_config.num_kv_heads,
                                  bias=spec.qkv_bias)
        # This rank's heads (all of them at tp=1).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(model_config.num_attention_heads * self.head_dim,
                                        hf.hidden_size, bias=spec.o_bias)
        self.use_rope = spec.uses_rope(layer)
        self.qk_norm_over_projection = spec.qk_norm_over_projection
        # Per head (Qwen3) or over every rank's whole projection (OLMo 2: each rank keeps the
        # full weight, and normalises the all-gathered projection).
        q_width, k_width = ((model_config.num_attention_heads * self.head_dim,
                             model_config.num_kv_heads * self.head_dim)
                            if spec.qk_norm_over_projection else (self.head_dim, self.head_dim))
        has_qk_norm = spec.qk_norm or spec.qk_norm_over_projection
        offset = spec.norm_unit_offset
        self.q_norm = RMSNorm(q_width, hf.rms_norm_eps, offset) if has_qk_norm else None
        self.k_norm = RMSNorm(k_width, hf.rms_norm_eps, offset) if has_qk_norm else None
        # Which of the model's rotary tables this layer's positions come from (None: the one).
        self.rope_table = (1 if spec.window(layer) else 0) if spec.local_rope else None
        # A window that covers max_model_len never hides a key: the kernels skip the check.
        window = spec.window(layer)
        scale = spec.attention_scale or self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=scale,
                              sliding_window=window if window < model_config.max_model_len else 0,
                              softcap=spec.attention_softcap or 0.0,
                              sinks=spec.attention_sinks,
                              kv_cache_group=model_config.kv_cache_layout.layer_group[layer])
        if self.attn.sinks is not None:  # the checkpoint's [heads]: this rank's heads' part
            set_weight_attrs(self.attn.sinks, weight_loader=self._sinks_loader, shard_ids=(None,))

    def _sinks_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
                      ) -> None:
        start = self.qkv_proj.tp_rank * self.num_heads
        default_weight_loader(param, narrow(loaded, 0, start, self.num_heads), shard_id)

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        head_norms = (None, None)
        if self.qk_norm_over_projection:
            q, k = _projection_norm(q, self.q_norm), _projection_norm(k, self.k_norm)
        elif self.q_norm is not None:
            head_norms = (self.q_norm, self.k_norm)
        if self.use_rope:
            cos, sin = rope.table(self.rope_table == 1)
            q, k = apply_rotary_qk(q, k, cos, sin, self.head_dim, *head_norms)
        elif head_norms[0] is not None:
            q, k = normalize_heads(q, k, *head_norms, self.head_dim)
        if rope.query_scale is not None:
            q = q * rope.query_scale.to(q.dtype)
        out = self.attn(q, k, v, kv_cache, meta)
        if out.shape[0] < num_tokens:
            # The backend returns only the num_actual_tokens rows; padding rows get zeros
            # so the residual stream keeps its [T, hidden] shape.
            out = F.pad(out, (0, 0, 0, num_tokens - out.shape[0]))
        return self.o_proj(out)


def _projection_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm over a whole projection [T, heads * D] whose heads the ranks share: this rank's
    columns of the normalised all-gathered projection."""
    if distributed.get_tp_size() == 1:
        return norm(x)
    width = x.shape[-1]
    full = norm(distributed.tp_all_gather(x, dim=-1))
    return full[:, distributed.get_tp_rank() * width:][:, :width]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.self_attn = LlamaAttention(model_config, spec, layer)
        self.mlp = feed_forward(hf.hidden_size, hf.intermediate_size, spec, layer)
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, rope: RotaryInputs, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before adding it)."""
        hidden, residual = pre_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, model_config: ModelConfig, spec: DecoderSpec,
                 layer_class: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__()
        hf = model_config.hf_config
        # Under pipeline stages: this stage's layers; the embedding on the first stage (and on
        # the last, whose LM head it is when tied), the final norm on the last.
        self.stage_layers = stage_layers(model_config.num_layers)
        first, last = distributed.is_first_stage(), distributed.is_last_stage()
        self.embed_tokens = (VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
                             if first or (last and spec.tied_embeddings) else None)
        self.layers = nn.ModuleList(
            layer_class(model_config, spec, i) if i in self.stage_layers else MissingLayer()
            for i in range(model_config.num_layers))
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps, spec.norm_unit_offset)
        self.stream_dtype = model_config.dtype  # what passes between stages
        self.embedding_scale = spec.embedding_scale
        self.position_query_scale = spec.position_query_scale
        # One table for all layers: positions can reach max_model_len even when it exceeds
        # max_position_embeddings (transformers computes any position on the fly).
        max_position = max(hf.max_position_embeddings, model_config.max_model_len)
        def rotary(layer_type: str | None) -> RotaryEmbedding:
            # The head dim of the layers of that type (Gemma 4's global heads are wider).
            types = list(getattr(hf, "layer_types", None) or ())
            layer = types.index(layer_type) if layer_type in types else 0
            return RotaryEmbedding(layer_kv_shape(hf, layer)[1], max_position,
                                   rope_parameters_from_config(hf, layer_type),
                                   model_config.max_model_len)

        # One table, or (full attention's, the windowed layers' own) under `local_rope`.
        self.rotary_emb = rotary("full_attention" if spec.local_rope else None)
        self.local_rotary_emb = rotary("sliding_attention") if spec.local_rope else None
        # EAGLE-3's features: the stream entering each of these layers, concatenated in layer
        # order (vLLM's) [T, len * hidden], as of the last forward (None until then, or
        # without layers).
        self.aux_layers = spec.aux_hidden_layers
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        if distributed.get_pp_size() > 1:
            return self.forward_stage(input_ids, positions, kv_caches, meta)
        return self.forward_layers(*self.embed(input_ids, positions), kv_caches, meta)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """This pipeline stage's part of `forward` (mrv2/pipeline.py): the first embeds, the
        others receive the stream; each runs its layers; all but the last send the stream on
        (and return its hidden states, which nothing reads)."""
        residual: torch.Tensor | None = None
        if distributed.is_first_stage():
            rope, hidden = self.embed(input_ids, positions)
        else:
            rope = self.rotary_inputs(positions, self.stream_dtype)
            hidden, residual = receive_stream(input_ids.shape[0], self.norm.weight.shape[0],
                                              self.stream_dtype, input_ids.device)
        for i in self.stage_layers:
            hidden, residual = self.layers[i](rope, hidden, residual, kv_caches[i], meta)
        if not distributed.is_last_stage():
            send_stream(hidden.to(self.stream_dtype), residual)
            return hidden
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[RotaryInputs, torch.Tensor]:
        """(the rotary inputs of the positions, shared by every layer; the embedded ids [T,
        hidden])."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:  # rounded to the activation dtype, as Gemma's
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        return self.rotary_inputs(positions, hidden.dtype), hidden

    def rotary_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryInputs:
        cos, sin = self.rotary_emb.get_cos_sin(positions, dtype)
        local = (None if self.local_rotary_emb is None
                 else self.local_rotary_emb.get_cos_sin(positions, dtype))
        scale = (None if self.position_query_scale is None
                 else position_query_scale(positions, *self.position_query_scale))
        return RotaryInputs(cos, sin, local, scale)

    def forward_layers(self, rope: RotaryInputs, hidden: torch.Tensor,
                       kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Every decoder layer, then the final norm: embedded [T, hidden] -> [T, hidden]."""
        residual: torch.Tensor | None = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(rope, hidden, residual, kv_caches[i], meta)
        if aux:
            self.aux_hidden_states = torch.cat(aux, dim=-1)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # layers that add their outputs into the stream themselves
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Per-architecture switches; the subclasses below override them.
    qkv_bias_always = False  # Qwen2: q/k/v bias regardless of attention_bias
    o_proj_bias_allowed = True  # Qwen2: never an o_proj bias
    qk_norm = False  # Qwen3: per-head RMSNorm on q and k
    layer_class: type[nn.Module] = LlamaDecoderLayer
    model_class: type[LlamaModel] = LlamaModel
    supports_pipeline_parallel = True  # LlamaModel.forward_stage runs its layers
    has_linear_attention = False  # Qwen3-Next / Qwen3.5: layers with a recurrent state

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        hf = model_config.hf_config
        self.model_config = model_config
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.decoder_spec = dataclasses.replace(
            self.declare(hf), aux_hidden_layers=model_config.aux_hidden_state_layers)
        if self.decoder_spec.aux_hidden_layers and (
                self.model_class.forward_layers is not LlamaModel.forward_layers
                or distributed.get_pp_size() > 1):
            raise ValueError(f"{type(self).__name__} does not output its layers' input streams "
                             f"(an EAGLE-3 head's features)")
        self.model = self.model_class(model_config, self.decoder_spec, self.layer_class)
        self.lm_head: ParallelLMHead | None = (
            None if self.tie_word_embeddings or not distributed.is_last_stage()
            else ParallelLMHead(hf.vocab_size, hf.hidden_size))

    def declare(self, hf: Any) -> DecoderSpec:
        """What this architecture is, read from its config (subclasses add their traits)."""
        attention_bias = bool(getattr(hf, "attention_bias", False))
        if recurrent_layers(hf) is not None and not self.has_linear_attention:
            raise ValueError(f"layer_types ['linear_attention'] are not supported for "
                             f"{type(self).__name__}")
        return DecoderSpec(
            qkv_bias=self.qkv_bias_always or attention_bias,
            o_bias=self.o_proj_bias_allowed and attention_bias, qk_norm=self.qk_norm,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            activation=getattr(hf, "hidden_activation", None) or hf.hidden_act,
            tied_embeddings=self.tie_word_embeddings, sliding_windows=layer_windows(hf),
            position_query_scale=self.position_query_scale(hf))

    def position_query_scale(self, hf: Any) -> tuple[float, int] | None:
        """Ministral 3's query scaling; refused for an architecture that does not scale."""
        params = getattr(hf, "rope_parameters", None) or {}
        if params.get("llama_4_scaling_beta"):
            raise ValueError(f"rope parameter llama_4_scaling_beta is not supported for "
                             f"{type(self).__name__}")
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], the full vocabulary on every rank
        (all-gathered under tensor parallelism)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = parallel_logits(hidden_states, head)
        cap = self.decoder_spec.logit_softcap
        if cap:  # Gemma 2: tanh(logits / cap) * cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters (`load_checkpoint_tensors`); a tied model
        reads its LM head from embed_tokens."""
        tied = self.tie_word_embeddings
        return load_checkpoint_tensors(self, ((name, tensor) for name, tensor in weights
                                              if not (tied and name == "lm_head.weight")
                                              and held_by_stage(self, name)))


def load_checkpoint_tensors(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters (q/k/v and gate/up into their fused
    ones); returns the names of the parameters whose every shard was loaded. Unknown checkpoint
    names raise (a silently ignored tensor usually means a feature the model does not
    implement)."""
    params = dict(module.named_parameters())
    shards_seen: dict[str, set[Any]] = {}
    for name, tensor in weights:
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        param_name, shard_id = expert_shard(name) or (name, None)
        for fused, ckpt, sid in _STACKED_PARAMS if param_name == name else ():
            if f".{ckpt}." in name:
                param_name, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                break
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{type(module).__name__}")
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        shards_seen.setdefault(param_name, set()).add(shard_id)
    # shard None on a fused param = the checkpoint stored the fused tensor whole.
    return {name for name, seen in shards_seen.items()
            if None in seen or seen >= set(params[name].shard_ids)}


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Mistral 3's text model (Ministral 3): Mistral's layers with YaRN, whose rotated queries
    are scaled by position beyond the original context (Llama 4's attention scaling)."""

    def position_query_scale(self, hf: Any) -> tuple[float, int] | None:
        params = rope_parameters_from_config(hf)
        beta = params.get("llama_4_scaling_beta")
        return None if not beta else (float(beta), int(params["original_max_position_embeddings"]))


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True
    o_proj_bias_allowed = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4-mini: Llama's layers on fused checkpoint projections."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        rope_layers = tuple(bool(flag) for flag in hf.no_rope_layers)
        if len(rope_layers) != hf.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(rope_layers)} entries for "
                             f"{hf.num_hidden_layers} layers")
        return dataclasses.replace(super().declare(hf),
                                   rope_layers=None if all(rope_layers) else rope_layers)
