"""EAGLE-3 draft head for Llama-family targets (speculative_config method "eagle3": the
checkpoints vLLM runs, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

The head reads three of the target's hidden states at position p (the residual stream entering
its layers `aux_layers`: models/llama.py outputs them, concatenated) and the embedding of the
token at p + 1. `fc` maps the three to one feature [hidden]; its first decoder layer takes, as
attention input, [input_layernorm(embedding) | hidden_norm(feature)] (2 x hidden wide), the
feature itself being the residual stream (its norm, with `norm_before_residual`); the rest is
Llama's layer. The stream after the last layer is the feature of the head's next step; its
final norm and LM head, over a draft vocabulary of `draft_vocab_size` tokens, give the draft,
draft id d being target id d + d2t[d].

Checkpoint: `fc.weight`, `midlayer.*` (the first layer; `layers.N.*` too, with or without a
`model.` prefix), `norm.weight`, `lm_head.weight`, `d2t` (where the draft vocabulary is smaller
than the target's; `t2d`, its inverse, is not needed), `embed_tokens.weight` where the head has
its own (else the target's is used). config.json: a Llama config (`architectures`
["LlamaForCausalLMEagle3"]) of the target's vocabulary, with `draft_vocab_size` and optionally
`eagle_config.eagle_aux_hidden_state_layer_ids` and `target_hidden_size`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from mrv2.attention import AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.linear import Linear, QKVLinear, materialize
from mrv2.models.layers.norm import RMSNorm
from mrv2.models.layers.rotary import RotaryEmbedding, RotaryInputs, rope_parameters_from_config
from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                parallel_logits)
from mrv2.models.eagle import head_parts
from mrv2.models.llama import LlamaDecoderLayer, load_checkpoint_tensors


def eagle3_aux_layers(head_hf: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input streams a head reads: its config's
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, n // 2, n - 3)."""
    ids = (getattr(head_hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
    return tuple(int(i) for i in ids)


def _eagle3_name(name: str) -> str:
    """A checkpoint name in the head's own: no `model.` prefix, `midlayer` as layer 0."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer; the first reads [embedding | feature] (2 x hidden) in its attention."""

    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__(model_config, spec, layer)
        hf = model_config.hf_config
        self.first = layer == 0
        if self.first:
            attention = self.self_attn
            attention.qkv_proj = QKVLinear(2 * hf.hidden_size, attention.head_dim,
                                           model_config.num_attention_heads,
                                           model_config.num_kv_heads, bias=spec.qkv_bias)
            self.hidden_norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
            self.norm_before_residual = bool(getattr(hf, "norm_before_residual", False))

    def forward_first(self, rope: RotaryInputs, embeds: torch.Tensor, feature: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer: (its MLP output, the residual stream before adding it)."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        hidden = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Eagle3LlamaForCausalLM(nn.Module):
    # Its features are the target's layers' input streams (LlamaModel.aux_hidden_states).
    reads_layer_streams = True

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        hf, names, spec = head_parts(model_config, _eagle3_name)
        target_hidden = getattr(hf, "target_hidden_size", None) or hf.hidden_size
        self.fc = Linear(3 * target_hidden, hf.hidden_size, bias="fc.bias" in names)
        self.layers = nn.ModuleList(Eagle3DecoderLayer(model_config, spec, i)
                                    for i in range(model_config.num_layers))
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            model_config.head_dim, max(hf.max_position_embeddings, model_config.max_model_len),
            rope_parameters_from_config(hf), model_config.max_model_len)
        self.draft_vocab_size = int(getattr(hf, "draft_vocab_size", None) or hf.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hf.hidden_size)
        # Draft id d is target id d + draft_to_target[d] (the checkpoint's `d2t`).
        self.register_buffer("draft_to_target", torch.zeros(self.draft_vocab_size,
                                                            dtype=torch.long))
        self.embed_tokens = (VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
                             if "embed_tokens.weight" in names else None)
        self._has_d2t = "d2t" in names
        if self.draft_vocab_size != hf.vocab_size and not self._has_d2t:
            raise ValueError(f"an EAGLE-3 head of a {self.draft_vocab_size}-token draft "
                             f"vocabulary needs its `d2t` tensor (the target's is "
                             f"{hf.vocab_size})")

    def target_features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's streams [T, 3 x hidden] -> the head's features [T, hidden]."""
        return self.fc(aux_hidden_states)

    def forward(self, input_embeds: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Embeddings of the tokens at p + 1 and the features at p (each [T, hidden]), at
        positions p -> the head's stream [T, hidden] (the features of its next step)."""
        features = features.to(input_embeds.dtype)
        rope = RotaryInputs(*self.rotary_emb.get_cos_sin(positions, input_embeds.dtype))
        hidden, residual = self.layers[0].forward_first(rope, input_embeds, features,
                                                        kv_caches[0], meta)
        for i, layer in enumerate(self.layers[1:], start=1):
            hidden, residual = layer(rope, hidden, residual, kv_caches[i], meta)
        return hidden + residual

    def next_tokens(self, features: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """The greedy draft after each feature, as target token ids [T] (int64)."""
        logits = parallel_logits(self.norm(features), self.lm_head)
        draft = torch.argmax(logits, dim=-1)
        return draft + self.draft_to_target[draft]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def params():
            for name, tensor in weights:
                name = _eagle3_name(name)
                if name == "d2t":
                    self.draft_to_target.copy_(materialize(tensor).to(torch.long))
                elif name != "t2d":  # the inverse map: derived, not needed
                    yield name, tensor

        return load_checkpoint_tensors(self, params())
