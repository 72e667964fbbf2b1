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

MXFP4 checkpoints (`quantization_config = {"quant_method": "mxfp4"}`, the released ones):
each expert tensor as `<name>_blocks` and `<name>_scales` (models/mxfp4.py). On the CPU, on
one rank, in float32, the experts compute on them as stored (ggml's MXFP4 blocks, gate/up's
rows de-interleaved: cpu/quantized_weights.pack_mxfp4_experts); elsewhere they are
dequantized, exactly, into the float experts. Any other quantization method is refused by
name (loader.py, `quantization_methods`).

GGUF files ("gpt-oss", gguf/): the experts come one tensor per expert and projection
(models/gguf/weights.py; MXFP4 blocks computed on as stored under quantization="gguf"), their
biases one [E, out] tensor per projection, joined here into the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from mrv2.models import mxfp4
from mrv2.models.decoder_spec import DecoderSpec, MoESpec
from mrv2.models.layers.linear import materialize
from mrv2.models.llama import LlamaForCausalLM

# Checkpoint name fragment -> the parameter's.
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))


def _parameter_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor


# A GGUF file's expert biases, one per projection ([E, out]).
_GGUF_EXPERT_BIAS = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.bias$")


def _joined_expert_biases(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`weights` with GGUF per-projection expert biases as the checkpoint's: gate's and up's
    interleaved into `gate_up_proj_bias` (its layout), down's as `down_proj_bias`."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _GGUF_EXPERT_BIAS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, projection = match.groups()
        if projection == "down_proj":
            yield f"{prefix}.down_proj_bias", tensor
            continue
        pair = halves.setdefault(prefix, {})
        pair[projection] = materialize(tensor)
        if len(pair) == 2:
            del halves[prefix]
            yield (f"{prefix}.gate_up_proj_bias",
                   torch.stack([pair["gate_proj"], pair["up_proj"]], dim=-1).flatten(1))
    if halves:
        raise ValueError(f"expert biases without their gate / up pair: {sorted(halves)}")


def _computes_as_stored(experts: nn.Module) -> bool:
    """Whether a layer's experts compute on MXFP4 blocks as stored: float32 on the CPU, one
    rank (the packed-weight kernels' conditions)."""
    param = experts.gate_up_proj
    return experts.tp_size == 1 and param.device.type == "cpu" and param.dtype == torch.float32


def _deinterleaved(tensor: torch.Tensor) -> torch.Tensor:
    """gate/up's rows (dim 1) alternating -> gate's, then up's."""
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)


class GptOssForCausalLM(LlamaForCausalLM):
    quantization_methods = ("mxfp4",)  # checkpoint quantization it loads (loader.py)

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
        packed: set[str] = set()
        weights = _joined_expert_biases(_parameter_names(weights))
        loaded = super().load_weights(self._mxfp4_experts(weights, packed))
        return loaded | packed

    def _mxfp4_experts(self, weights: Iterable[tuple[str, Any]], packed: set[str]
                       ) -> Iterator[tuple[str, Any]]:
        """`weights` with each MXFP4 pair (`<param>_blocks`, `<param>_scales`) given to its
        experts as stored (`packed` gets the parameter names, once a layer has both) or
        yielded dequantized as the float checkpoint holds it ([E, in, out])."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        stored: dict[str, dict[str, Any]] = {}  # experts module -> parameter -> blocks
        for name, tensor in weights:
            param, _, kind = name.rpartition("_")
            if kind not in ("blocks", "scales"):
                yield name, tensor
                continue
            pair = halves.setdefault(param, {})
            pair[kind] = materialize(tensor)
            if len(pair) < 2:
                continue
            del halves[param]
            module, _, leaf = param.rpartition(".")
            experts = self.get_submodule(module)
            if not _computes_as_stored(experts):
                yield param, mxfp4.dequantize(pair["blocks"], pair["scales"]).transpose(1, 2)
                continue
            blocks, scales = pair["blocks"], pair["scales"]
            if leaf == "gate_up_proj":
                blocks, scales = _deinterleaved(blocks), _deinterleaved(scales)
            layer = stored.setdefault(module, {})
            layer[leaf] = mxfp4.as_gguf_blocks(blocks, scales)
            if len(layer) == 2:
                from mrv2.models.cpu.quantized_weights import pack_mxfp4_experts  # CPU kernels

                pack_mxfp4_experts(experts, layer["gate_up_proj"], layer["down_proj"])
                packed.update(f"{module}.{p}" for p in layer)
                del stored[module]
        if halves or stored:
            raise ValueError(f"MXFP4 expert tensors without their pair: "
                             f"{sorted(halves) + sorted(stored)}")
