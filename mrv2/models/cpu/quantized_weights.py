"""GGUF weights computed as stored: a CPU fast path attached to a model loaded from a quantized
GGUF file.

Why: at batch 1 a decode step streams every weight once, so bytes per weight decide its speed;
a Q4_1 file holds ~5 bits per weight against float32's 32. Each linear (and the embedding and
the LM head, tied or not) whose file tensors are of a type `QuantizedWeight` takes is given
its blocks, repacked once (models/layers/quantized.py), and computes on them; the float32
weight the loader wrote is released, so resident weight memory follows the file's size. A
linear (the LM head too) that a panel kernel takes is held as its panels alone
(QuantizedWeight.store_as_panels); an untied embedding keeps its blocks.

Fused projections (q/k/v, gate/up) take their shards' blocks concatenated; shards of
different integer layouts (a Q4_K_M file's Q4_K q / k beside a Q6_K v) are first given one,
bytes in the smallest group size among them (gguf_blocks.as_byte_groups: the same values, so
such a layer stays on the blocks and in the decode stack). A projection mixing 16-bit and
integer shards keeps its float32 weight, as does every module under
tensor parallelism (a rank's column slice of a row-parallel weight would cut blocks apart),
and every tensor of a type the kernels do not take (F32 among them). F16 and BF16 tensors
stay 16-bit (half the bytes of float32 per decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from mrv2.config import ModelConfig
from mrv2.models.gguf import is_gguf_path, iterate_gguf_weights, open_gguf
from mrv2.models.gguf.weights import GGUFWeight, unpermute_rows
from mrv2.models.layers.gguf_blocks import as_byte_groups
from mrv2.models.layers.quantized import (QUANTIZED_GGUF_TYPES, QuantizedWeight,
                                          holds_panels, quantized_linear)

# Fused module (relative to a layer) -> the checkpoint modules whose rows it stacks, in order.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


@dataclass
class QuantizedModules:
    """What was attached: module name -> its weight as stored (repacked)."""

    weights: dict[str, QuantizedWeight] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


class QuantizedLinearForward:
    """`forward` of one linear computing on its quantized weight (bias added as stored)."""

    def __init__(self, module: nn.Module, weight: QuantizedWeight) -> None:
        self.module, self.weight = module, weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = quantized_linear(x.reshape(-1, shape[-1]), self.weight, self.module.bias)
        return out.reshape(*shape[:-1], out.shape[-1])


def bfloat16_weight(module: nn.Module) -> QuantizedWeight | None:
    """The bfloat16 weight attached to a bias-free projection (`QuantizedLinearForward`), or
    None: what the matrix-unit paths (native_half_mlp, onednn_decode) compute on."""
    forward = module.__dict__.get("forward")
    if (module.bias is None and isinstance(forward, QuantizedLinearForward)
            and forward.weight.is_half and forward.weight.half_dtype == torch.bfloat16):
        return forward.weight
    return None


def float32_weight(module: nn.Module) -> torch.Tensor | None:
    """The float32 CPU weight of a bias-free projection that computes on it (nothing
    attached), or None: what onednn_decode packs for a float32 model."""
    weight = module.weight
    if (module.bias is None and "forward" not in module.__dict__ and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        return weight
    return None


class QuantizedEmbeddingForward:
    """`forward` of the token embedding: the rows of the looked-up ids, dequantized."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize_rows(input_ids.reshape(-1)).reshape(
            *input_ids.shape, self.weight.in_features)


class QuantizedLogits:
    """`compute_logits` of the model: hidden [N, H] -> float32 logits [N, V] on the LM head's
    (or the tied embedding's) quantized weight."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return quantized_linear(hidden_states.float(), self.weight, float32_sums=True)


def _stored(weight: GGUFWeight) -> QuantizedWeight | None:
    record = weight.record
    if record.type_name not in QUANTIZED_GGUF_TYPES or len(record.shape) != 2:
        return None
    raw = record.data
    if weight.permuted_heads is not None:  # whole rows move: blocks stay intact
        raw = unpermute_rows(raw, weight.permuted_heads)
    return QuantizedWeight.from_gguf(raw, record.type_name, tuple(record.shape))


def _release(module: nn.Module) -> None:
    """The float32 copy the loader wrote is not read again: drop its memory."""
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype),
                                 requires_grad=False)


def _in_one_layout(parts: list[QuantizedWeight]) -> list[QuantizedWeight] | None:
    """The shards of a fused projection in one layout: as they are when they share one, else
    every shard as bytes in the smallest group size among them (exact); None when a shard is
    16-bit and another is not, or two 16-bit ones differ."""
    if len({(p.layout, p.group_size) for p in parts}) == 1:
        return parts
    if any(p.is_half for p in parts):
        return None
    group = min(p.group_size for p in parts)
    return [_as_byte_groups(p, group) for p in parts]


def _as_byte_groups(weight: QuantizedWeight, group_size: int) -> QuantizedWeight:
    mins = None if weight.mins is None else weight.mins.numpy()
    tables = as_byte_groups(weight.q.numpy(), weight.scales.numpy(), mins,
                            weight.layout == "u4", group_size)
    return QuantizedWeight("i8", group_size,
                           *(None if t is None else torch.from_numpy(t) for t in tables),
                           weight.gguf_type)


def _stack(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    if any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    same = _in_one_layout(parts)
    return None if same is None else QuantizedWeight.cat(same)


def attach_quantized_weights(model: nn.Module, model_config: ModelConfig
                             ) -> QuantizedModules | None:
    """Attach the quantized path to `model` (a Llama-family model loaded on the CPU from
    `model_config.model`); None when the checkpoint is not a GGUF file or `model` has no
    LlamaModel."""
    inner = getattr(model, "model", None)
    if not is_gguf_path(model_config.model) or inner is None or not hasattr(inner, "layers"):
        return None
    stored = {name.removesuffix(".weight"): weight for name, weight in
              iterate_gguf_weights(open_gguf(model_config.model), model_config.hf_config)
              if name.endswith(".weight")}
    attached = QuantizedModules()
    for i, layer in enumerate(inner.layers):
        for fused, sources in _FUSED.items():
            module = layer.get_submodule(fused)
            if getattr(module, "tp_size", 1) != 1:
                continue
            parts = [stored.get(f"model.layers.{i}.{source}") for source in sources]
            weight = None if None in parts else _stack([_stored(p) for p in parts])
            if weight is not None:
                _attach_linear(module, weight, f"model.layers.{i}.{fused}", attached)

    def vocab_weight(name: str) -> QuantizedWeight | None:
        return None if name not in stored else _stored(stored[name])

    _attach_vocab(model, inner, vocab_weight, attached)
    return attached


def attach_half_weights(model: nn.Module, dtype: torch.dtype) -> QuantizedModules | None:
    """Keep the loaded float32 weights of `model`'s linears, embedding and LM head in `dtype`
    (float16 or bfloat16; ModelConfig.cpu_weight_dtype) and compute on them in float32: half
    the resident bytes, and half the bytes a decode step streams. None without a LlamaModel."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return None
    attached = QuantizedModules()
    for i, layer in enumerate(inner.layers):
        for fused in _FUSED:
            module = layer.get_submodule(fused)
            if getattr(module, "tp_size", 1) == 1 and module.weight.dtype == torch.float32:
                _attach_linear(module, QuantizedWeight.from_float(module.weight, dtype),
                               f"model.layers.{i}.{fused}", attached)

    def vocab_weight(name: str) -> QuantizedWeight | None:  # a tied model has no lm_head
        weight = model.get_submodule(name).weight
        return QuantizedWeight.from_float(weight, dtype) if weight.dtype == torch.float32 else None

    _attach_vocab(model, inner, vocab_weight, attached)
    return attached


def _hold_as_computed(weight: QuantizedWeight) -> QuantizedWeight:
    """A linear's weight, held as its kernels compute on it: as its panels alone where a
    panel kernel takes it (`q` and the tables released), else as it is."""
    if holds_panels(weight):
        weight.store_as_panels()
    return weight


def _attach_linear(module: nn.Module, weight: QuantizedWeight, name: str,
                   attached: QuantizedModules) -> None:
    module.forward = QuantizedLinearForward(module, _hold_as_computed(weight))
    _release(module)
    attached.weights[name] = weight


def _attach_vocab(model: nn.Module, inner: nn.Module,
                  vocab_weight: Callable[[str], QuantizedWeight | None],
                  attached: QuantizedModules) -> None:
    """The embedding and the LM head (the same weight when tied); `vocab_weight(name)` gives
    the kept weight of "model.embed_tokens" or "lm_head" (None: the module keeps its own)."""
    embed, head = inner.embed_tokens, getattr(model, "lm_head", None)
    if embed.tp_size != 1 or (head is not None and head.tp_size != 1):
        return
    embed_weight = vocab_weight("model.embed_tokens")
    if embed_weight is not None:
        embed.forward = QuantizedEmbeddingForward(embed_weight)
        attached.weights["model.embed_tokens"] = embed_weight
    head_weight = embed_weight
    if head is not None:
        head_weight = vocab_weight("lm_head")
        if head_weight is not None:
            _release(head)
            attached.weights["lm_head"] = head_weight
    if head_weight is not None:
        model.compute_logits = QuantizedLogits(_hold_as_computed(head_weight))
    if embed_weight is not None:
        # Neither the lookup nor the logits read the float32 table now (tied: the logits
        # use embed_weight; untied: the head's own weight).
        _release(embed)
