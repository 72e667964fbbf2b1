"""EAGLE draft head for Llama-family targets (speculative_config method "eagle": the
EAGLE-1 checkpoints vLLM runs, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B).

The head predicts the target's next tokens from its features: at position p it reads the
target's final (normed) hidden state at p and the embedding of the token at p + 1, fuses
them (`fc`: [embedding | hidden] -> hidden), runs its decoder layers (Llama's; the first has
no input norm, as EAGLE's) and returns the residual stream, unnormed: the target's LM head
turns it into the logits of the token at p + 2. A further draft feeds the head its own output
in place of the target's feature (spec_decode/eagle.py).

Checkpoint: `fc.weight` (and `fc.bias` where it has one), `layers.N.*` in Llama's names, with
or without a `model.` prefix; `embed_tokens.weight` and `lm_head.weight` where the head has its
own, else the target's are used (vLLM shares them the same way). Its config.json is a Llama
config of the head's layers (`num_hidden_layers`), of the target's hidden size and vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from mrv2.attention import AttentionMetadata
from mrv2.config import ModelConfig
from mrv2.models.decoder_spec import DecoderSpec
from mrv2.models.layers.linear import Linear
from mrv2.models.layers.rotary import RotaryEmbedding, RotaryInputs, rope_parameters_from_config
from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                parallel_logits)
from mrv2.models.llama import LlamaDecoderLayer, load_checkpoint_tensors

_PREFIX = "model."


def _head_name(name: str) -> str:
    """A checkpoint name in the head's own (no `model.` prefix)."""
    return name.removeprefix(_PREFIX)


def head_parts(model_config: ModelConfig, name_of: Callable[[str], str]
               ) -> tuple[Any, set[str], DecoderSpec]:
    """An EAGLE head's config, its checkpoint's tensor names (as `name_of` maps them) and the
    spec of its Llama layers (with the biases its config names)."""
    from mrv2.models.loader import checkpoint_weights  # loader -> registry -> llama

    hf = model_config.hf_config
    names = {name_of(name) for name, _ in checkpoint_weights(model_config)}
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return hf, names, DecoderSpec(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False,
                                  mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                                  activation=hf.hidden_act)


class EagleDecoderLayer(LlamaDecoderLayer):
    """Llama's layer; the head's first has no input norm (its input is `fc`'s output)."""

    def __init__(self, model_config: ModelConfig, spec: DecoderSpec, layer: int) -> None:
        super().__init__(model_config, spec, layer)
        if layer == 0:
            self.input_layernorm = nn.Identity()


class EagleLlamaForCausalLM(nn.Module):
    # Its features are the target's final hidden states (EAGLE-3's read layers' input streams).
    reads_layer_streams = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        hf, names, spec = head_parts(model_config, _head_name)
        self.fc = Linear(2 * hf.hidden_size, hf.hidden_size, bias="fc.bias" in names)
        self.layers = nn.ModuleList(EagleDecoderLayer(model_config, spec, i)
                                    for i in range(model_config.num_layers))
        self.rotary_emb = RotaryEmbedding(
            model_config.head_dim, max(hf.max_position_embeddings, model_config.max_model_len),
            rope_parameters_from_config(hf), model_config.max_model_len)
        # The head's own embedding and LM head where its checkpoint has them (else None: the
        # proposer uses the target's).
        self.embed_tokens = (VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
                             if "embed_tokens.weight" in names else None)
        self.lm_head = (ParallelLMHead(hf.vocab_size, hf.hidden_size)
                        if "lm_head.weight" in names else None)

    def forward(self, input_embeds: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Embeddings of the tokens at p + 1 and the features at p (each [T, hidden]), at
        positions p -> the head's hidden states [T, hidden] (the features of its next step)."""
        hidden = self.fc(torch.cat((input_embeds, features.to(input_embeds.dtype)), dim=-1))
        rope = RotaryInputs(*self.rotary_emb.get_cos_sin(positions, hidden.dtype))
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, kv_caches[i], meta)
        return hidden + residual

    def target_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states are the head's features as they are."""
        return hidden_states

    def next_tokens(self, features: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """The greedy draft after each feature [T] (int64): its own LM head's logits where
        the checkpoint has one, else the target's."""
        logits = (target.compute_logits(features) if self.lm_head is None
                  else parallel_logits(features, self.lm_head))
        return torch.argmax(logits, dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_tensors(self, ((_head_name(name), tensor)
                                              for name, tensor in weights))
