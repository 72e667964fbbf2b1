"""Mixture-of-experts architectures on the Llama family's layers: each declares its attention
as its dense sibling does and its routed feed-forward as a `MoESpec` (decoder_spec.py), which
`layers/moe.feed_forward` builds in each layer.

- Qwen3-MoE: Qwen3's attention (per-head q/k norms); experts in the layers that are not
  `mlp_only_layers` and fall on `decoder_sparse_step`; top-k renormalised where
  `norm_topk_prob`.
- Qwen2-MoE: Qwen2's attention (q/k/v biases); the same layer rule, plus a shared expert every
  token goes through, scaled by sigmoid(shared_expert_gate(x)).
- Mixtral: Mistral's attention; every layer routed, top-k always renormalised; its checkpoint
  names (`block_sparse_moe`, experts' `w1` / `w3` / `w2`) read as the others'.
- OLMoE: Llama's layers with q/k norms over the whole projections (as OLMo 2's, but normed
  before the sublayers); `clip_qkv` is refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

import torch

from mrv2.models.decoder_spec import DecoderSpec, MoESpec
from mrv2.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                               Qwen3ForCausalLM)


def _qwen_sparse_layers(hf: Any) -> tuple[bool, ...]:
    """transformers' Qwen MoE layer rule: experts unless in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    step, dense = int(getattr(hf, "decoder_sparse_step", 1) or 1), set(
        getattr(hf, "mlp_only_layers", None) or ())
    return tuple(i not in dense and hf.num_experts > 0 and (i + 1) % step == 0
                 for i in range(hf.num_hidden_layers))


def qwen_moe(hf: Any, shared: int = 0) -> MoESpec:
    return MoESpec(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                   intermediate_size=hf.moe_intermediate_size,
                   renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                   sparse_layers=_qwen_sparse_layers(hf), shared_intermediate_size=shared)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        return dataclasses.replace(super().declare(hf), moe=qwen_moe(hf))


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        return dataclasses.replace(super().declare(hf), moe=qwen_moe(
            hf, int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)))


# Mixtral's checkpoint names -> the names the other MoE models (and the parameters) use.
_MIXTRAL_NAMES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),
                  (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
                  (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
                  (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."))


def _mixtral_name(name: str) -> str:
    for pattern, replacement in _MIXTRAL_NAMES:
        name = pattern.sub(replacement, name)
    return name


class MixtralForCausalLM(MistralForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        return dataclasses.replace(super().declare(hf), moe=MoESpec(
            num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
            intermediate_size=hf.intermediate_size, renormalize=True,
            sparse_layers=(True,) * hf.num_hidden_layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_mixtral_name(name), w) for name, w in weights)


class OlmoeForCausalLM(LlamaForCausalLM):
    def declare(self, hf: Any) -> DecoderSpec:
        if getattr(hf, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv={hf.clip_qkv!r} is not supported for OlmoeForCausalLM")
        return dataclasses.replace(super().declare(hf), qk_norm_over_projection=True,
                                   moe=MoESpec(num_experts=hf.num_experts,
                                               top_k=hf.num_experts_per_tok,
                                               intermediate_size=hf.intermediate_size,
                                               renormalize=bool(hf.norm_topk_prob),
                                               sparse_layers=(True,) * hf.num_hidden_layers))
