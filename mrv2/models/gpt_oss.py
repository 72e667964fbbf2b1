"""gpt-oss (GptOssForCausalLM) on the Llama family's layers, declared as a `DecoderSpec`:

- attention: q/k/v and o biases (`attention_bias`), one learned sink logit per head
  (`attention_sinks`: attention/backend.Attention's `sinks`), sliding windows on the layers
  `layer_types` marks (every other one, 128 tokens), YaRN rope (layers/rotary.py);
- feed-forward: routed experts in every layer (`MoESpec`): a router with a bias, top-k of its
  logits then a softmax over those k (the renormalised top-k of the softmax: the same
  numbers, `renormalize`), experts with biases on both projections and the clamped SwiGLU
  (layers/activation.swigluoai_and_mul, the config's `swiglu_alpha` and `swiglu_limit`);
  the checkpoint's transposed, gate/up-interleaved 3-D tensors converted at load
  (layers/moe.py, `checkpoint_layout`).

Checkpoint names: the router is `mlp.router` (mrv2's `mlp.gate`), the sinks
`self_attn.sinks` (mrv2's `self_attn.attn.sinks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch

from mrv2.models.decoder_spec import DecoderSpec, MoESpec
from mrv2.models.llama import LlamaForCausalLM

# Checkpoint name fragment -> the parameter's.
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))


def _parameter_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        moe = MoESpec(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                      intermediate_size=hf.intermediate_size, renormalize=True,
                      sparse_layers=(True,) * hf.num_hidden_layers, router_bias=True,
                      expert_bias=True, activation="swigluoai",
                      activation_kwargs=(("alpha", float(hf.swiglu_alpha)),
                                         ("limit", float(hf.swiglu_limit))),
                      checkpoint_layout="interleaved_transposed")
        return dataclasses.replace(super().declare(hf), attention_sinks=True, moe=moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_parameter_names(weights))
