"""A GGUF checkpoint's tensors under the Hugging Face names the model's `load_weights` takes.

Names are mapped with the `gguf` package's own tensor-name map (`gguf.get_tensor_name_map`),
run backwards: every Hugging Face name the architecture can have is mapped forwards once, and
the file's names are looked up in the result. A file tensor with no Hugging Face counterpart is
an error, as an unknown safetensors name is.

Each tensor is yielded as a `GGUFWeight`: a lazy slice in the form of a safetensors slice
(`get_shape()`, indexing), so the weight loaders of mrv2/models/layers read it unchanged and a
tensor-parallel rank dequantizes only its own rows. It keeps the stored blocks and type
(`record`), so a linear that computes on quantized weights can take them as they are instead.
Once the consumer asks for the next tensor, the previous one's file pages are dropped from the
process's resident memory (the loader has copied it by then; reader.MappedBytes.release).

The llama converter permutes the rows of q_proj and k_proj (weights and biases) so that
llama.cpp's rotary, which rotates adjacent pairs, sees them in its order; `GGUFWeight` undoes the
permutation when it dequantizes (Qwen2/Qwen3/Gemma are written unpermuted). The Gemma converters
store every norm weight as 1 + w; `GGUFWeight` subtracts the 1 again. Qwen3-Next and
Qwen3.5's files change more (norms, A_log, split or reordered projections, MTP blocks):
delta_net.py undoes it, tensor by tensor, rebuilding what moved as `DerivedWeight`s
(weight_views.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator

from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError, GGUFTensorRecord
from mrv2.models.gguf.arch_fields import ROPE_FREQS_TENSOR, trunk_block_count
from mrv2.models.gguf.config import DELTA_NET_ARCHS, LONGROPE_TENSORS
from mrv2.models.gguf.delta_net import DeltaNetTensors
# GGUFWeight and unpermute_rows are imported from here by the CPU packer and the tests.
from mrv2.models.gguf.weight_views import GGUFWeight, expert_record, unpermute_rows  # noqa: F401

_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Tensors the config consumed (they are not parameters).
_CONFIG_TENSORS = (ROPE_FREQS_TENSOR, *LONGROPE_TENSORS)
# Hugging Face module names per layer (weights and biases are the same names + suffix).
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm",
                  # Gemma 4's per-layer inputs and output scale
                  "per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm",
                  "layer_scalar",
                  # MoE: the router, the experts (3-D: one tensor per projection), Qwen2-MoE's
                  # shared expert and its gate
                  "mlp.gate", *(f"mlp.experts.{p}" for p in _EXPERT_PROJECTIONS),
                  *(f"mlp.shared_expert.{p}" for p in _EXPERT_PROJECTIONS),
                  "mlp.shared_expert_gate",
                  # gpt-oss's attention sinks (its router, ffn_gate_inp, is "mlp.gate" too)
                  "self_attn.sinks")
# Hugging Face parameters named without a .weight suffix (the converter appends one).
_SUFFIXLESS_MODULES = ("layer_scalar", "self_attn.sinks")
# Architectures whose files store q/k/v and gate/up fused (Phi-3: attn_qkv, and ffn_up holding
# gate and up), and those modules (their GGUF names are the unfused q and up ones' too).
_FUSED_ARCHS = ("phi3",)
_FUSED_LAYER_MODULES = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head", "model.embed_tokens_per_layer",
                  "model.per_layer_model_projection", "model.per_layer_projection_norm")
# GGUF architectures whose converter permutes q/k rows (convert_hf_to_gguf.LlamaModel.permute).
_PERMUTED_ARCHS = ("llama", "smollm3", "mistral3")
# GGUF architectures whose converter stores norm weights as 1 + w (Gemma*Model.modify_tensors).
_SHIFTED_NORM_ARCHS = ("gemma2", "gemma3")


@functools.lru_cache(maxsize=16)
def gguf_to_hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF module name -> Hugging Face module name, e.g. "blk.0.attn_q" -> the q_proj's."""
    import gguf

    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    name_map = gguf.get_tensor_name_map(arch_ids[arch], num_layers)
    modules = _LAYER_MODULES + (_FUSED_LAYER_MODULES if arch in _FUSED_ARCHS else ())
    hf_names = list(_MODEL_MODULES) + [f"model.layers.{i}.{module}"
                                       for i in range(num_layers) for module in modules]
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name)
        if gguf_name is not None:
            mapping[gguf_name] = hf_name
    return mapping


_WIDE_FLOAT_TYPES = ("F32", "F64")


def bf16_copy_elements(ckpt: GGUFCheckpoint, integer_blocks_only: bool = False) -> int:
    """Values in the file's 2-D matrices stored as integer blocks or F16 (not BF16 / F32):
    what bfloat16 copies of its linears would hold at most (loader.cpu_auto_gguf); with
    `integer_blocks_only`, those stored as integer blocks (what int8 copies would hold)."""
    skipped = (*_WIDE_FLOAT_TYPES, "BF16") + (("F16",) if integer_blocks_only else ())
    return sum(math.prod(r.shape) for r in ckpt.tensors.values()
               if len(r.shape) == 2 and r.type_name not in skipped)


def has_compact_linears(ckpt: GGUFCheckpoint) -> bool:
    """Whether some matrix of the file (a layer's experts, 3-D, among them) is stored below 32
    bits a weight: block-quantized, or F16 / BF16 (what quantization="gguf" computes on as
    stored)."""
    return any(len(r.shape) in (2, 3) and r.type_name not in _WIDE_FLOAT_TYPES
               for r in ckpt.tensors.values())


def _mapped_weights(name: str, record: GGUFTensorRecord, arch: str, names: dict[str, str],
                    heads: dict[str, int], architecture: str) -> list[tuple[str, GGUFWeight]]:
    """The Hugging Face tensor(s) one file tensor is, by the name map: a layer's 3-D experts as
    one 2-D tensor each (as on the Hub), llama's permuted q/k and Gemma's shifted norms
    marked for undoing."""
    module, _, suffix = name.rpartition(".")
    hf_module = names.get(module)
    if hf_module is None or suffix not in ("weight", "bias"):
        raise GGUFError(f"{record.file}: tensor {name!r} has no counterpart in a "
                        f"{architecture} model")
    if len(record.shape) == 3:
        experts, projection = hf_module.rsplit(".", 1)
        return [(f"{experts}.{expert}.{projection}.{suffix}",
                 GGUFWeight(expert_record(record, expert)))
                for expert in range(record.shape[0])]
    if hf_module.endswith(".shared_expert_gate") and len(record.shape) == 1:
        # llama-quantize rewrites the converter's [1, hidden] as the vector llama.cpp reads.
        record = dataclasses.replace(record, shape=(1, *record.shape),
                                     data=record.data.reshape(1, -1))
    permuted = heads.get(hf_module.split(".", 3)[-1]) if arch in _PERMUTED_ARCHS else None
    shifted = arch in _SHIFTED_NORM_ARCHS and hf_module.endswith("norm")
    hf_name = hf_module if hf_module.endswith(_SUFFIXLESS_MODULES) else f"{hf_module}.{suffix}"
    return [(hf_name, GGUFWeight(record, permuted, -1.0 if shifted else 0.0))]


def iterate_gguf_weights(ckpt: GGUFCheckpoint, hf_config: Any) -> Iterator[tuple[str, GGUFWeight]]:
    """(Hugging Face name, GGUFWeight) for every tensor of the checkpoint."""
    from gguf import Keys

    arch = ckpt.architecture
    # Qwen3-Next / Qwen3.5 files may append MTP blocks after the decoder's: named too.
    blocks = (int(ckpt.require(Keys.LLM.BLOCK_COUNT)) if arch in DELTA_NET_ARCHS
              else hf_config.num_hidden_layers)
    names = gguf_to_hf_names(arch, blocks)
    heads = {"self_attn.q_proj": hf_config.num_attention_heads,
             "self_attn.k_proj": getattr(hf_config, "num_key_value_heads", None)
             or hf_config.num_attention_heads}

    def mapped(name: str, record: GGUFTensorRecord) -> list[tuple[str, GGUFWeight]]:
        return _mapped_weights(name, record, arch, names, heads, hf_config.architectures[0])

    delta_net = (DeltaNetTensors(ckpt, hf_config, trunk_block_count(ckpt), mapped)
                 if arch in DELTA_NET_ARCHS else None)
    for name, record in ckpt.tensors.items():
        if name in _CONFIG_TENSORS:
            continue
        weights = (mapped(name, record) if delta_net is None
                   else delta_net.weights(name, record))
        yield from weights
        # The consumer is done with them (the loader copied their values into parameters):
        # their file pages need not stay resident (a later read faults them back in).
        for source in {id(r.mapped): r for _, w in weights for r in w.source_records()}.values():
            source.release_pages()
    if delta_net is not None:
        delta_net.check_done()
