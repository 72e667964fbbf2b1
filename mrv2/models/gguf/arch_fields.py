"""The fields of a GGUF file's config that some architectures write their own way (gguf/config.py
reads the rest): Gemma 4's per-layer arrays and proportional rope, and the MoE files' experts.

- Gemma 4 writes its layer pattern (`attention.sliding_window_pattern`), its global layers' kv
  heads and its KV-shared layers' double-wide MLPs as per-layer arrays, the windowed layers'
  head size as `key_length_swa`, and its global layers' "proportional" RoPE as a `rope_freqs`
  tensor: divisor 1 for the rotated frequencies, 1e30 (frequency 0) for the rest.
  `attention_k_eq_v` is not written: global layers without an `attn_v` tensor say it.
- MoE files (qwen3moe, qwen2moe, olmoe; Mixtral as "llama" with an expert_count) store each
  layer's experts as 3-D tensors (`ffn_gate_exps` ...); norm_topk_prob is not written (llama.cpp
  fixes it per architecture, `_MOE_RENORMALIZE`); every layer is routed (the converter writes no
  dense MLP for them).
- gpt-oss: its experts' width is `expert_feed_forward_length`, its windowed layers follow
  `attention.sliding_window_pattern` (flags, or every n-th layer global; llama.cpp's default
  2: the even layers windowed), its SwiGLU's alpha and limit are llama.cpp's constants (the
  config's defaults). Its YaRN is transformers' for gpt-oss, without truncating the
  correction range (llama.cpp always truncates it: the source checkpoint's model is the one
  reproduced, as for Phi-3's window).
- Qwen3-Next / Qwen3.5 (qwen3next, qwen35, qwen35moe): the gated delta rule's shape as `ssm.*`
  keys (key heads = group_count, value heads = time_step_rank, key head size = state_size,
  value head size = inner_size / value heads, conv_kernel), the recurrent layers as a flag per
  block (`attention.recurrent_layers`; files without it: every `full_attention_interval`-th
  layer full, llama.cpp's rule), the multi-token-prediction blocks appended after the trunk's
  (`block_count` counts them, `nextn_predict_layers` says how many), and Qwen3.5's interleaved
  multimodal rope sections (`rope.dimension_sections`, padded to 4 by the converter, which
  writes [11, 11, 10] when the checkpoint has none; a text token's rope is the same either
  way). Every layer of the MoE ones is routed, its top k renormalised.
"""

from __future__ import annotations

from typing import Any

from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError
from mrv2.models.registry import UnsupportedModelError

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# A rope_freqs divisor at least this large stops its frequency (llama.cpp's Gemma 4 writes 1e30).
_STOPPED_FREQUENCY_DIVISOR = 1e29
# Whether llama.cpp rescales an architecture's top-k expert weights to sum to 1 (its graph
# fixes it per architecture; an expert_weights_norm key overrides).
_MOE_RENORMALIZE = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True,
                    "gpt-oss": True,  # gpt-oss: a softmax over the top k (the same numbers)
                    "qwen3next": True, "qwen35moe": True}
# MoE architectures with a sigmoid-gated shared expert (its width a key of its own).
_SHARED_EXPERT_ARCHS = ("qwen2moe", "qwen3next", "qwen35moe")
# Architectures whose model renormalises the top k whatever the file says (Qwen3.5-MoE).
_ALWAYS_RENORMALIZED = ("qwen35moe",)
_GPT_OSS_PATTERN = 2  # llama.cpp's default: every 2nd layer global


def gemma4_rope(ckpt: GGUFCheckpoint, head_dim: int) -> dict[str, Any]:
    """Gemma 4's rope per layer type: the windowed layers' default rope (rope.freq_base_swa,
    rope.dimension_count_swa), the global layers' "proportional" rope whose rotated share is the
    count of rope_freqs divisors that are 1 (the others stop their frequency)."""
    from gguf import Keys

    sliding: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(ckpt.arch_field(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    rotated_swa = int(ckpt.arch_field(Keys.Rope.DIMENSION_COUNT_SWA, head_dim))
    if rotated_swa != head_dim:
        sliding["partial_rotary_factor"] = rotated_swa / head_dim
    global_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH))
    full: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(ckpt.arch_field(Keys.Rope.FREQ_BASE, 1e6))}
    rotated = int(ckpt.arch_field(Keys.Rope.DIMENSION_COUNT, global_dim))
    if ROPE_FREQS_TENSOR in ckpt.tensors:
        divisors = ckpt.f32_vector(ROPE_FREQS_TENSOR, global_dim // 2)
        pairs = sum(1 for d in divisors if d == 1.0)
        if divisors != [1.0] * pairs + divisors[pairs:] or any(
                d < _STOPPED_FREQUENCY_DIVISOR for d in divisors[pairs:]):
            raise UnsupportedModelError(
                f"{ckpt.path}: Gemma 4 rope_freqs other than 1 for the rotated frequencies "
                f"then >= {_STOPPED_FREQUENCY_DIVISOR:g} (proportional rope) are not supported")
        full["rope_type"], rotated = "proportional", 2 * pairs
    if rotated != global_dim:
        full["partial_rotary_factor"] = rotated / global_dim
    return {"sliding_attention": sliding, "full_attention": full}


def gemma4_fields(ckpt: GGUFCheckpoint, kwargs: dict[str, Any], kv_heads: list[int],
                   ffn: list[int]) -> dict[str, Any]:
    """Gemma 4's config fields from its per-layer keys and the tensors present."""
    from gguf import Keys

    layers, path = kwargs["num_hidden_layers"], ckpt.path
    windowed = ckpt.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not isinstance(windowed, list) or len(windowed) != layers:
        raise GGUFError(f"{path}: attention.sliding_window_pattern must hold one flag per layer")
    first_shared = layers - int(ckpt.arch_field(Keys.Attention.SHARED_KV_LAYERS, 0))

    def one_value(values: list[int], is_windowed: bool, what: str) -> int | None:
        found = {v for v, w in zip(values, windowed) if bool(w) == is_windowed}
        if len(found) > 1:
            raise UnsupportedModelError(f"{path}: {what} differing between layers of one type "
                                        f"are not supported")
        return found.pop() if found else None

    fields: dict[str, Any] = {
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": ckpt.arch_field(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        "num_kv_shared_layers": layers - first_shared,
        "hidden_size_per_layer_input": int(
            ckpt.arch_field(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, 0)),
        "enable_moe_block": "blk.0.ffn_gate_inp.weight" in ckpt.tensors,
        "attention_k_eq_v": any(not windowed[i] and f"blk.{i}.attn_v.weight" not in ckpt.tensors
                                for i in range(first_shared)),
        "num_key_value_heads": one_value(kv_heads, True, "head_count_kv") or kv_heads[0],
    }
    if (per_layer := ckpt.tensors.get("per_layer_token_embd.weight")) is not None:
        fields["vocab_size_per_layer_input"] = per_layer.shape[0]
    global_kv = one_value(kv_heads, False, "head_count_kv")
    global_dim = int(ckpt.require(Keys.Attention.KEY_LENGTH))
    value_dims = (ckpt.arch_field(Keys.Attention.VALUE_LENGTH, global_dim),
                  ckpt.arch_field(Keys.Attention.VALUE_LENGTH_SWA, kwargs["head_dim"]))
    if value_dims != (global_dim, kwargs["head_dim"]):
        raise UnsupportedModelError(f"{path}: value lengths {value_dims} other than the key "
                                    f"lengths are not supported")
    # The global layers' own shape, as transformers' per_layer_config (its global_head_dim
    # argument would default to 512, and its kv-head argument applies only with k_eq_v).
    overrides = {"head_dim": global_dim, "num_key_value_heads": global_kv}
    fields["per_layer_config"] = {i: overrides for i in range(layers) if not windowed[i]}
    wide = [ffn[0] if i < first_shared else 2 * ffn[0] for i in range(layers)]
    if len(set(ffn)) > 1 and ffn != wide:
        raise UnsupportedModelError(f"{path}: feed_forward_length {ffn} is neither one width nor "
                                    f"double width in the KV-shared layers")
    fields["use_double_wide_mlp"] = len(set(ffn)) > 1
    return fields


def moe_fields(ckpt: GGUFCheckpoint, arch: str) -> dict[str, Any]:
    """A MoE file's expert fields as its transformers config names them."""
    from gguf import Keys

    if arch not in _MOE_RENORMALIZE:
        raise UnsupportedModelError(f"{ckpt.path}: experts in a {arch!r} file are not "
                                    f"supported (MoE: {', '.join(_MOE_RENORMALIZE)})")
    gating = ckpt.arch_field(Keys.LLM.EXPERT_GATING_FUNC)
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise UnsupportedModelError(f"{ckpt.path}: expert_gating_func {gating} is not "
                                    f"supported (softmax only)")
    renormalize = bool(ckpt.arch_field(Keys.LLM.EXPERT_WEIGHTS_NORM, _MOE_RENORMALIZE[arch]))
    if arch in _ALWAYS_RENORMALIZED and not renormalize:
        raise UnsupportedModelError(f"{ckpt.path}: expert_weights_norm=false is not supported "
                                    f"for {arch!r} (its top k is always renormalised)")
    experts = int(ckpt.require(Keys.LLM.EXPERT_COUNT))
    used = int(ckpt.require(Keys.LLM.EXPERT_USED_COUNT))
    if arch in ("llama", "gpt-oss"):  # Mixtral, gpt-oss: every layer routed, renormalised
        if not renormalize:
            raise UnsupportedModelError(f"{ckpt.path}: {arch!r} experts without renormalised "
                                        f"weights are not supported")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    fields: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": used,
                              "norm_topk_prob": renormalize}
    if arch == "olmoe":
        return fields
    # llama.cpp's qwen MoE files have no dense layers (its tensor map has none for them).
    fields.update(moe_intermediate_size=int(ckpt.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
                  decoder_sparse_step=1, mlp_only_layers=[])
    if arch in _SHARED_EXPERT_ARCHS:
        fields["shared_expert_intermediate_size"] = int(
            ckpt.arch_field(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0))
    return fields


def gpt_oss_fields(ckpt: GGUFCheckpoint, kwargs: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's config fields besides the experts' count (`moe_fields`): see the module
    docstring."""
    from gguf import Keys

    layers = kwargs["num_hidden_layers"]
    pattern = ckpt.arch_field(Keys.Attention.SLIDING_WINDOW_PATTERN, _GPT_OSS_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{ckpt.path}: attention.sliding_window_pattern must hold one flag "
                            f"per layer")
        windowed = [bool(flag) for flag in pattern]
    else:
        n = int(pattern)
        windowed = [n == 0 or i % n < n - 1 for i in range(layers)]
    rope = dict(kwargs["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return {"intermediate_size": int(ckpt.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
            "rope_parameters": rope}


# The recurrent layers' flags (llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS; the gguf package
# this venv pins predates its Keys entry).
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"
_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default where a file has neither key
# Qwen3.5's rope sections are interleaved (llama.cpp always rotates qwen35 files so).
_INTERLEAVED_MROPE_ARCHS = ("qwen35", "qwen35moe")


def trunk_block_count(ckpt: GGUFCheckpoint) -> int:
    """The decoder's layers: block_count less the multi-token-prediction blocks the converter
    appends after them (`nextn_predict_layers`)."""
    from gguf import Keys

    blocks = int(ckpt.require(Keys.LLM.BLOCK_COUNT))
    nextn = int(ckpt.arch_field(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
    if not 0 <= nextn < blocks:
        raise GGUFError(f"{ckpt.path}: nextn_predict_layers={nextn} of {blocks} blocks")
    return blocks - nextn


def delta_net_fields(ckpt: GGUFCheckpoint, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5's config fields of the gated delta rule layers, the layer pattern,
    the MTP block count and the multimodal rope sections (see the module docstring)."""
    from gguf import Keys

    layers, path = kwargs["num_hidden_layers"], ckpt.path
    value_heads = int(ckpt.require(Keys.SSM.TIME_STEP_RANK))
    inner = int(ckpt.require(Keys.SSM.INNER_SIZE))
    if inner % value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a multiple of "
                        f"ssm.time_step_rank {value_heads}")
    flags = ckpt.arch_field(RECURRENT_LAYERS_KEY)
    if flags is None:
        interval = int(ckpt.arch_field(Keys.LLM.FULL_ATTENTION_INTERVAL,
                                       _FULL_ATTENTION_INTERVAL))
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or any(flags[layers:]):
        raise GGUFError(f"{path}: attention.recurrent_layers must hold a flag per block, the "
                        f"MTP blocks' false")
    fields: dict[str, Any] = {
        "linear_conv_kernel_dim": int(ckpt.require(Keys.SSM.CONV_KERNEL)),
        "linear_key_head_dim": int(ckpt.require(Keys.SSM.STATE_SIZE)),
        "linear_num_key_heads": int(ckpt.require(Keys.SSM.GROUP_COUNT)),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "layer_types": ["linear_attention" if flag else "full_attention"
                        for flag in flags[:layers]],
    }
    if (nextn := int(ckpt.arch_field(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))):
        fields["mtp_num_hidden_layers"] = nextn
    sections = ckpt.arch_field(Keys.Rope.DIMENSION_SECTIONS)
    if sections is not None:
        if ckpt.architecture not in _INTERLEAVED_MROPE_ARCHS:
            raise UnsupportedModelError(f"{path}: rope.dimension_sections is not supported for "
                                        f"{ckpt.architecture!r} (only for "
                                        f"{', '.join(_INTERLEAVED_MROPE_ARCHS)})")
        sections = [int(s) for s in sections]
        while len(sections) > 3 and sections[-1] == 0:  # the converter's padding to 4
            sections.pop()
        fields["rope_parameters"] = {**kwargs["rope_parameters"], "mrope_section": sections,
                                     "mrope_interleaved": True}
    return fields
