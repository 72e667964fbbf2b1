"""Packed weights for a model's linears, embedding and LM head on the CPU (`module.packed`):
a quantized GGUF file's blocks as stored, or a bfloat16 / float16 model's 16-bit weights.

Why: at batch 1 a decode step streams every weight once, so bytes per weight decide its speed;
a Q4_1 file holds ~5 bits per weight against float32's 32. Each linear (and the embedding and
the LM head, tied or not) whose file tensors are of a type `PackedWeight` takes is given
its blocks, repacked once (models/layers/quantized.py), and computes on them. `load_model`
packs them before it loads anything else, releasing the float32 parameters unwritten (never
resident) and not dequantizing their tensors: resident weight memory, and the load-time peak,
follow the file's size, not a float32 copy of the model. A linear (the LM head too) that a
panel kernel takes is held as its panels alone (PackedWeight.store_as_panels); an untied
embedding keeps its blocks.

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

import numpy as np
import torch
from torch import nn

from mrv2 import batch_invariant
from mrv2.config import ModelConfig
from mrv2.models.gguf import is_gguf_path, iterate_gguf_weights, open_gguf
from mrv2.models.gguf.weights import GGUFWeight, unpermute_rows
from mrv2.models.layers.gguf_blocks import as_byte_groups
from mrv2.models.layers.cpu_linear import computes_natively
from mrv2.models.layers.linear import set_packed
from mrv2.models.layers.linear_plan import LinearKernel, with_bf16_tiles
from mrv2.models.layers.quant_formats import packs
from mrv2.models.layers.quantized import PackedWeight

# Fused module (relative to a layer) -> the checkpoint modules whose rows it stacks, in order
# (unless the file stores the fused module itself).
# (q/k/v: those of them the layer projects, `QKVLinear.projections`; Gemma 4's layers may
# project q and k, or q alone.)
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",),
          # Qwen2-MoE's shared expert (layers/moe.py: a gated MLP beside the routed experts)
          "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj",
                                             "mlp.shared_expert.up_proj"),
          "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
          # Qwen3-Next's / Qwen3.5's linear-attention projections (models/qwen3_next.py), each
          # one checkpoint module (the GGUF reader rebuilds Qwen3-Next's in_proj_qkvz)
          **{f"linear_attn.{name}": (f"linear_attn.{name}",) for name in (
              "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
              "in_proj_a", "out_proj")}}
# Linears a layer or the model may have besides (Gemma 4's per-layer inputs), and lookup-only
# tables (Gemma 4's per-layer embedding: for E2B the largest tensor of the file).
_OPTIONAL_LAYER_LINEARS = ("per_layer_input_gate", "per_layer_projection")
_OPTIONAL_MODEL_LINEARS = ("per_layer_model_projection",)
_LOOKUP_TABLES = ("embed_tokens_per_layer",)
_LAYER_PREFIX = "model.layers."  # the decoder layers' weights, by name


def _fused_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each `_FUSED` projection the layer has (a layer routed to experts
    has no gate_up_proj / down_proj of its own, maybe a shared expert's: layers/moe.py)."""
    found = []
    for fused in _FUSED:
        module = layer
        for part in fused.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.Module):
            found.append((fused, module))
    return found


def _sources(layer: nn.Module, fused: str) -> tuple[str, ...]:
    """The checkpoint modules whose rows `fused` stacks in this layer."""
    if fused == "self_attn.qkv_proj":
        return tuple(f"self_attn.{p}_proj" for p in layer.self_attn.qkv_proj.projections)
    return _FUSED[fused]


def _optional_linears(inner: nn.Module) -> list[tuple[str, nn.Module]]:
    """(checkpoint module name, module) of every optional linear `inner` has."""
    found = [(f"model.{name}", getattr(inner, name)) for name in _OPTIONAL_MODEL_LINEARS
             if hasattr(inner, name)]
    return found + [(f"model.layers.{i}.{name}", getattr(layer, name))
                    for i, layer in enumerate(inner.layers)
                    for name in _OPTIONAL_LAYER_LINEARS if hasattr(layer, name)]


@dataclass
class PackedModules:
    """What was packed: module name -> its weight as stored (repacked). From a GGUF file
    (`pack_gguf_weights`), `checkpoint_names` also lists the checkpoint tensors (by
    Hugging Face name) those weights hold: the loader does not load them into the float
    parameters."""

    weights: dict[str, PackedWeight] = field(default_factory=dict)
    checkpoint_names: set[str] = field(default_factory=set)
    # MoE layers' experts (module name -> each expert's gate/up and down).
    experts: dict[str, list[tuple[PackedWeight, PackedWeight]]] = field(default_factory=dict)

    @property
    def parameter_names(self) -> set[str]:
        """The parameters the packed weights stand in for (each module's "weight"; the
        experts' two 3-D parameters)."""
        return ({f"{name}.weight" for name in self.weights}
                | {f"{name}.{p}" for name in self.experts for p in ("gate_up_proj", "down_proj")})

    def all_weights(self) -> list[PackedWeight]:
        """Every packed weight: the modules' and each expert's two."""
        return [*self.weights.values(),
                *(w for pairs in self.experts.values() for pair in pairs for w in pair)]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.all_weights())


def float32_weight(module: nn.Module) -> torch.Tensor | None:
    """The float32 CPU weight of a bias-free projection that computes on it (nothing
    packed), or None: what onednn_decode packs for a float32 model."""
    weight = module.weight
    if (module.bias is None and module.packed is None and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        return weight
    return None


def _stored(weight: GGUFWeight) -> PackedWeight | None:
    record = weight.record
    if not packs(record.type_name) or len(record.shape) != 2:
        return None
    raw = record.data
    if weight.permuted_heads is not None:  # whole rows move: blocks stay intact
        raw = unpermute_rows(raw, weight.permuted_heads)
    stored = PackedWeight.from_gguf(raw, record.type_name, tuple(record.shape))
    record.release_pages()  # from_gguf copied the blocks: the file's pages may go
    return stored


def _in_one_layout(parts: list[PackedWeight]) -> list[PackedWeight] | None:
    """The shards of a fused projection in one layout: as they are when they share one, else
    every shard as bytes in the smallest group size among them (exact); None when a shard is
    16-bit and another is not, or two 16-bit ones differ."""
    if len({(p.layout, p.group_size) for p in parts}) == 1:
        return parts
    if any(p.is_half for p in parts):
        return None
    group = min(p.group_size for p in parts)
    return [_as_byte_groups(p, group) for p in parts]


def _as_byte_groups(weight: PackedWeight, group_size: int) -> PackedWeight:
    mins = None if weight.mins is None else weight.mins.numpy()
    tables = as_byte_groups(weight.q.numpy(), weight.scales.numpy(), mins,
                            weight.layout == "u4", group_size)
    return PackedWeight("i8", group_size,
                           *(None if t is None else torch.from_numpy(t) for t in tables),
                           weight.gguf_type)


def _stack(parts: list[PackedWeight | None]) -> PackedWeight | None:
    if any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    same = _in_one_layout(parts)
    return None if same is None else PackedWeight.cat(same)


def pack_gguf_weights(model: nn.Module, model_config: ModelConfig
                             ) -> PackedModules | None:
    """Attach the quantized path to `model` (a Llama-family model built on the CPU from
    `model_config`); None when the checkpoint is not a GGUF file or `model` has no
    LlamaModel. `load_model` calls it before loading any weight: a packed module's float
    parameter is released unwritten (never resident), and the loader skips the checkpoint
    tensors listed in the result's `checkpoint_names`. Called on a loaded model, it releases
    the loaded float weights instead."""
    inner = getattr(model, "model", None)
    if not is_gguf_path(model_config.model) or inner is None or not hasattr(inner, "layers"):
        return None
    stored = {name.removesuffix(".weight"): weight for name, weight in
              iterate_gguf_weights(open_gguf(model_config.model), model_config.hf_config)
              if name.endswith(".weight")}
    packed = PackedModules()

    def vocab_weight(name: str) -> PackedWeight | None:
        return None if name not in stored else _stored(stored[name])

    # The vocab tensors first: the largest, their repacking's transient memory (a panel
    # layout made beside the blocks) adds to the least resident (the load-time peak).
    _pack_vocab(model, inner, vocab_weight, packed)
    # Each vocab module packed holds its own file tensor (tied: only the embedding's).
    packed.checkpoint_names.update(f"{name}.weight" for name in ("model.embed_tokens",
                                                                   "lm_head")
                                     if name in packed.weights)
    for i, layer in enumerate(inner.layers):
        for fused, module in _fused_modules(layer):
            if getattr(module, "tp_size", 1) != 1:
                continue
            sources = _sources(layer, fused)
            if f"model.layers.{i}.{fused}" in stored:  # stored fused (Phi-3)
                sources = (fused,)
            parts = [stored.get(f"model.layers.{i}.{source}") for source in sources]
            weight = None if None in parts else _stack([_stored(p) for p in parts])
            if weight is not None:
                _pack_linear(module, weight, f"model.layers.{i}.{fused}", packed)
                packed.checkpoint_names.update(f"model.layers.{i}.{source}.weight"
                                                 for source in sources)
    for name, module in _optional_linears(inner):
        weight = _stored(stored[name]) if name in stored else None
        if weight is not None:
            _pack_linear(module, weight, name, packed)
            packed.checkpoint_names.add(f"{name}.weight")
    for i, experts in _expert_modules(inner):
        prefix = f"model.layers.{i}.mlp.experts"
        names = [[f"{prefix}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
                 for e in range(experts.num_experts)]
        if not _whole_experts(experts) or any(n not in stored for ns in names for n in ns):
            continue
        pairs = [(_stack([_stored(stored[gate]), _stored(stored[up])]), _stored(stored[down]))
                 for gate, up, down in names[experts.expert_start:][:experts.num_local_experts]]
        if all(gate_up is not None and down is not None for gate_up, down in pairs):
            _pack_experts(experts, pairs, prefix, packed)
            packed.checkpoint_names.update(f"{n}.weight" for ns in names for n in ns)
    for name in _LOOKUP_TABLES:
        table = getattr(inner, name, None)
        weight = (_stored(stored[f"model.{name}"])
                  if table is not None and table.tp_size == 1 and f"model.{name}" in stored
                  else None)
        if weight is not None:  # lookups only: kept as blocks, no panels
            set_packed(table, weight)
            packed.weights[f"model.{name}"] = weight
            packed.checkpoint_names.add(f"model.{name}.weight")
    if model_config.gguf_bf16_copies and not batch_invariant.active():
        _hold_copies(model, packed, model_config.gguf_int8_prefill)
    elif model_config.cpu_weight_dtype == torch.bfloat16 and computes_natively(torch.bfloat16):
        for weight in packed.all_weights():  # a bfloat16 model's prefill: on the matrix units
            weight.plan = with_bf16_tiles(weight.plan)
    return packed


def _hold_copies(model: nn.Module, packed: PackedModules, int8: bool) -> None:
    """Give every linear whose many rows do not run on the matrix units as stored (integer
    blocks, float16 where the CPU has no float16 ones; the LM head too; not a lookup-only
    table, nor the experts, whose blocks win at every batch measured) its bfloat16 copy for
    many rows; with `int8`, each decoder layer's linear of integer blocks also its int8 copy
    for a prompt's rows (not the LM head: logits keep their float32 sums). In batch-invariant
    mode there is none: one kernel runs every row count."""
    lookups = {f"model.{name}" for name in _LOOKUP_TABLES}
    if getattr(model, "lm_head", None) is not None:  # untied: the embedding is looked up
        lookups.add("model.embed_tokens")
    for name, weight in packed.weights.items():
        if name not in lookups and weight.plan.many is not LinearKernel.NATIVE_16BIT:
            weight.hold_bf16_copy()
            if int8 and not weight.is_half and name.startswith(_LAYER_PREFIX):
                weight.hold_int8_copy()


def packed_modules(model: nn.Module) -> PackedModules:
    """What `model`'s modules compute on in place of their float weight (`module.packed`, set
    at load or by the attach functions here), by module name."""
    modules = list(model.named_modules())
    return PackedModules(
        {name: m.packed for name, m in modules if isinstance(getattr(m, "packed", None),
                                                            PackedWeight)},
        experts={name: list(m.packed) for name, m in modules
                 if isinstance(getattr(m, "packed", None), tuple)})


def pack_16bit_weights(model: nn.Module, dtype: torch.dtype) -> PackedModules | None:
    """Keep the loaded float32 weights of `model`'s linears, embedding and LM head in `dtype`
    (float16 or bfloat16; ModelConfig.cpu_weight_dtype) and compute on them in float32: half
    the resident bytes, and half the bytes a decode step streams. None without a LlamaModel."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return None
    packed = PackedModules()
    linears = [(f"model.layers.{i}.{fused}", module)
               for i, layer in enumerate(inner.layers) for fused, module in _fused_modules(layer)]
    for name, module in linears + _optional_linears(inner):
        if getattr(module, "tp_size", 1) == 1 and module.weight.dtype == torch.float32:
            _pack_linear(module, PackedWeight.from_float(module.weight, dtype), name, packed)
    for i, experts in _expert_modules(inner):
        if (experts.packed is None and _whole_experts(experts)
                and experts.gate_up_proj.dtype == torch.float32):  # MXFP4 ones: packed at load
            pairs = [(PackedWeight.from_float(experts.gate_up_proj[e], dtype),
                      PackedWeight.from_float(experts.down_proj[e], dtype))
                     for e in range(experts.num_local_experts)]
            _pack_experts(experts, pairs, f"model.layers.{i}.mlp.experts", packed)
    for name in _LOOKUP_TABLES:
        table = getattr(inner, name, None)
        if table is not None and table.tp_size == 1 and table.weight.dtype == torch.float32:
            set_packed(table, PackedWeight.from_float(table.weight, dtype))
            packed.weights[f"model.{name}"] = table.packed

    def vocab_weight(name: str) -> PackedWeight | None:  # a tied model has no lm_head
        weight = model.get_submodule(name).weight
        return PackedWeight.from_float(weight, dtype) if weight.dtype == torch.float32 else None

    _pack_vocab(model, inner, vocab_weight, packed)
    return packed


def _hold_as_computed(weight: PackedWeight) -> PackedWeight:
    """A linear's weight, held as its kernels compute on it: as its panels alone where a
    panel kernel takes it (`q` and the tables released), else as it is."""
    if weight.plan.on_panels:
        weight.store_as_panels()
    return weight


def _pack_linear(module: nn.Module, weight: PackedWeight, name: str,
                   packed: PackedModules) -> None:
    set_packed(module, _hold_as_computed(weight))
    packed.weights[name] = weight


def _expert_modules(inner: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, experts module) of every layer routed to experts (layers/moe.py)."""
    return [(i, layer.mlp.experts) for i, layer in enumerate(inner.layers)
            if hasattr(layer.mlp, "experts")]


def _whole_experts(experts: nn.Module) -> bool:
    """Whether the rank holds its experts whole (one rank, or expert parallelism: the
    rank's own experts), so each packs as stored; tensor parallelism slices every expert's
    intermediate, which would cut down's blocks apart."""
    return experts.tp_size == 1 or experts.expert_parallel


def _pack_experts(experts: nn.Module, pairs: list[tuple[PackedWeight, PackedWeight]],
                  name: str, packed: PackedModules) -> None:
    """Each of the rank's experts' (gate/up, down) held as their kernels compute on them (the
    checkpoint names of every expert are listed by the caller: other ranks' are not loaded)."""
    held = [(_hold_as_computed(gate_up), _hold_as_computed(down)) for gate_up, down in pairs]
    experts.set_packed(held)
    packed.experts[name] = held


def pack_mxfp4_experts(experts: nn.Module, gate_up: np.ndarray, down: np.ndarray) -> None:
    """Give a layer's experts (one rank; layers/moe.FusedMoE) MXFP4 weights as ggml's blocks,
    uint8 [E, rows, bytes] each (gate/up's rows: gate's, then up's), computed on as stored
    and held as their kernels compute on them: a safetensors MXFP4 checkpoint's experts
    (models/mxfp4.py), never dequantized."""
    hidden, inter = experts.hidden_size, experts.intermediate_size
    experts.set_packed([
        (_hold_as_computed(PackedWeight.from_gguf(gate_up[e], "MXFP4", (2 * inter, hidden))),
         _hold_as_computed(PackedWeight.from_gguf(down[e], "MXFP4", (hidden, inter))))
        for e in range(experts.num_experts)])


def _pack_vocab(model: nn.Module, inner: nn.Module,
                  vocab_weight: Callable[[str], PackedWeight | None],
                  packed: PackedModules) -> None:
    """The embedding and the LM head (the same weight when tied); `vocab_weight(name)` gives
    the kept weight of "model.embed_tokens" or "lm_head" (None: the module keeps its own)."""
    embed, head = inner.embed_tokens, getattr(model, "lm_head", None)
    if embed.tp_size != 1 or (head is not None and head.tp_size != 1):
        return
    embed_weight = vocab_weight("model.embed_tokens")
    head_weight = embed_weight
    if head is not None:
        head_weight = vocab_weight("lm_head")
        if head_weight is not None:
            set_packed(head, _hold_as_computed(head_weight))
            packed.weights["lm_head"] = head_weight
    elif embed_weight is not None:  # tied: the logits multiply by the embedding's weight
        _hold_as_computed(embed_weight)
    if embed_weight is not None:
        # Neither the lookup nor the logits read the float32 table now (tied: the logits
        # use embed_weight; untied: the head's own weight).
        set_packed(embed, embed_weight)
        packed.weights["model.embed_tokens"] = embed_weight
