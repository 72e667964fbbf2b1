"""The hyperparameter keys llama.cpp's converter writes (``set_gguf_parameters`` of its model
classes), for gguf_writer.py: ``TextModel``'s generic keys with ``LlamaModel``'s,
``Gemma3Model``'s and ``Gemma4Model``'s additions, and ``Gemma2Model``'s and
``Phi3MiniModel``'s own sets (and ``GptOssModel``'s two keys)."""

from __future__ import annotations

import math
from typing import Any

import gguf
import torch

from mrv2.testing.gguf_qwen3_next import (QWEN3_NEXT_ARCHS, add_qwen3_next_hparams,
                                          rope_dimension_sections)


# Architectures the converter writes with its LlamaModel class (vocab size and rope dimension
# keys, permuted q/k, add_space_prefix).
LLAMA_MODEL_ARCHS = (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.SMOLLM3, gguf.MODEL_ARCH.MISTRAL3)


BLOCK_COUNT_KEYS = ["n_layers", "num_hidden_layers", "n_layer", "num_layers"]


def find_hparam(hparams: dict[str, Any], keys: list[str]) -> Any:
    """``ModelBase.find_hparam(keys, optional=True)``: the first key present wins."""
    return next((hparams[k] for k in keys if k in hparams), None)


def rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    """``TextModel.__init__``: rope_parameters (or legacy rope_scaling) with the global rope keys
    mirrored into it."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        theta = find_hparam(hparams, ["global_rope_theta", "rope_global_theta", "rope_theta_global",
                                "rope_theta", "rotary_emb_base"])
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        omax = hparams.get("original_max_position_embeddings")
        if "original_max_position_embeddings" not in rope and omax is not None:
            rope["original_max_position_embeddings"] = omax
    return rope.get("full_attention", rope)


def _add_gemma2_hparams(writer: gguf.GGUFWriter, hparams: dict[str, Any],
                        ftype: gguf.LlamaFileType) -> None:
    """``Gemma2Model.set_gguf_parameters`` (no rope keys: llama.cpp's gemma2 base is fixed)."""
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(hparams["head_dim"])
    writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(ftype)
    writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    writer.add_sliding_window(hparams["sliding_window"])


def add_hparams(writer: gguf.GGUFWriter, hparams: dict[str, Any], arch: gguf.MODEL_ARCH,
                 ftype: gguf.LlamaFileType) -> None:
    """``TextModel.set_gguf_parameters`` (the keys these archs have), then LlamaModel's and
    Gemma3Model's extras; Gemma 2's and Phi-3's own."""
    if arch == gguf.MODEL_ARCH.GEMMA2:
        _add_gemma2_hparams(writer, hparams, ftype)
        return
    if arch == gguf.MODEL_ARCH.PHI3:
        _add_phi3_hparams(writer, hparams, ftype)
        return
    writer.add_block_count(find_hparam(hparams, BLOCK_COUNT_KEYS))
    if (n_ctx := find_hparam(hparams, ["max_position_embeddings", "n_ctx", "n_positions",
                                       "max_length", "max_sequence_length",
                                       "model_max_length"])) is not None:
        writer.add_context_length(n_ctx)
    if (n_embd := find_hparam(hparams, ["hidden_size", "n_embd", "dim"])) is not None:
        writer.add_embedding_length(n_embd)
    if (n_ff := find_hparam(hparams, ["prefix_dense_intermediate_size",
                                      "dense_intermediate_size", "intermediate_size", "n_inner",
                                      "hidden_dim"])) is not None:
        writer.add_feed_forward_length(n_ff)
    if (n_head := find_hparam(hparams, ["num_attention_heads", "n_head",
                                        "n_heads"])) is not None:
        writer.add_head_count(n_head)
    if (n_head_kv := find_hparam(hparams, ["num_key_value_heads", "n_kv_heads"])) is not None:
        writer.add_head_count_kv(n_head_kv)
    if hparams.get("is_causal") is False:
        writer.add_causal_attention(False)
    rope = rope_parameters(hparams)
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (ext := rope.get("extrapolation_factor")) is not None:
            writer.add_rope_scaling_yarn_ext_factor(ext)
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            writer.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)
    elif rope_type in ("su", "longrope"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    # "default" (an unknown type to the converter, it only warns), "dynamic": no keys;
    # "llama3": the rope_freqs tensor instead.
    if (sections := rope_dimension_sections(hparams)) is not None:
        writer.add_rope_dimension_sections(sections)
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)
    per_type = hparams.get("rope_parameters") or {}
    if (local := (per_type.get("sliding_attention") or {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)  # the windowed layers' base (Gemma 3)
    if arch == gguf.MODEL_ARCH.OLMOE:
        writer.add_layer_norm_rms_eps(1e-5)  # OlmoeModel.set_gguf_parameters' fixed value
    elif (eps := find_hparam(hparams, ["rms_norm_eps", "norm_eps"])) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (n_experts := find_hparam(hparams, ["num_local_experts", "num_experts",
                                           "n_routed_experts"])) is not None:
        writer.add_expert_count(n_experts)
    if (n_used := find_hparam(hparams, ["num_experts_per_tok", "num_experts_per_token",
                                        "top_k_experts"])) is not None:
        writer.add_expert_used_count(n_used)
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    if arch in (gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.GEMMA4):  # Gemma3Model's additions
        if (cap := hparams.get("final_logit_softcapping")):
            writer.add_final_logit_softcapping(cap)
        if hparams.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(hparams["sliding_window"])
    if arch in LLAMA_MODEL_ARCHS:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(
            hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"])
    if arch == gguf.MODEL_ARCH.MISTRAL3 and hparams.get("model_type") == "ministral3":
        if rope.get("rope_type") != "yarn":  # Mistral3Model.Ministral3Model's asserts
            raise ValueError("ministral3 rope_type must be 'yarn'")
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch == gguf.MODEL_ARCH.GEMMA4:
        _add_gemma4_hparams(writer, hparams)
    if arch == gguf.MODEL_ARCH.GPT_OSS:  # GptOssModel.set_gguf_parameters
        writer.add_sliding_window(hparams["sliding_window"])
        writer.add_expert_feed_forward_length(hparams["intermediate_size"])
    if arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE,  # Qwen2MoeModel's
                *QWEN3_NEXT_ARCHS.values()):
        if (size := hparams.get("moe_intermediate_size")) is not None:
            writer.add_expert_feed_forward_length(size)
        if (shared := hparams.get("shared_expert_intermediate_size")) is not None:
            writer.add_expert_shared_feed_forward_length(shared)
    if arch in QWEN3_NEXT_ARCHS.values():
        add_qwen3_next_hparams(writer, hparams, arch)


def gemma4_global_shape(hparams: dict[str, Any]) -> tuple[int, int | None]:
    """``Gemma4Model``'s reading of the global layers' (head size, kv heads): the top-level
    fields, else the first full-attention layer's ``per_layer_config`` entry."""
    head_dim, kv_heads = hparams.get("global_head_dim"), hparams.get("num_global_key_value_heads")
    per_layer = hparams.get("per_layer_config") or {}
    for layer, config in per_layer.items():
        if hparams["layer_types"][int(layer)] == "full_attention":
            head_dim = head_dim if head_dim is not None else config.get("head_dim")
            kv_heads = kv_heads if kv_heads is not None else config.get("num_key_value_heads")
            break
    if head_dim is None:
        raise ValueError("no global head_dim")
    return head_dim, kv_heads


def _add_gemma4_hparams(writer: gguf.GGUFWriter, hparams: dict[str, Any]) -> None:
    """``Gemma4Model.set_gguf_parameters``' additions; the keys it writes again replace the
    earlier values (as GGUFWriter's overwrite does, without its duplicate-key warning)."""
    def replace(key: str) -> None:
        writer.kv_data[0].pop(key.format(arch=writer.arch), None)

    layers, shared = hparams["num_hidden_layers"], hparams["num_kv_shared_layers"]
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hparams.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in hparams["layer_types"]]
    writer.add_sliding_window_pattern(swa)
    head_dim_full, kv_full = gemma4_global_shape(hparams)
    head_dim_swa = hparams["head_dim"]
    for key in (gguf.Keys.Attention.KEY_LENGTH, gguf.Keys.Attention.VALUE_LENGTH):
        replace(key)
    writer.add_key_length(head_dim_full)
    writer.add_value_length(head_dim_full)
    writer.add_key_length_swa(head_dim_swa)
    writer.add_value_length_swa(head_dim_swa)
    if hparams.get("use_double_wide_mlp", False):
        n_ff = hparams["intermediate_size"]
        replace(gguf.Keys.LLM.FEED_FORWARD_LENGTH)
        writer.add_feed_forward_length([n_ff if i < layers - shared else 2 * n_ff
                                        for i in range(layers)])
    kv_swa = hparams.get("num_key_value_heads")
    if kv_full is not None and kv_swa is not None:
        replace(gguf.Keys.Attention.HEAD_COUNT_KV)
        writer.add_head_count_kv([kv_swa if w else kv_full for w in swa])
    sliding_rope = (hparams.get("rope_parameters") or {}).get("sliding_attention") or {}
    writer.add_rope_dimension_count(head_dim_full)
    writer.add_rope_dimension_count_swa(
        int(head_dim_swa * sliding_rope.get("partial_rotary_factor", 1.0)))


def gemma4_rope_freqs(hparams: dict[str, Any]) -> torch.Tensor:
    """``Gemma4Model.generate_extra_tensors``: the global layers' proportional rope as
    per-frequency divisors, 1 for the rotated ones and 1e30 (stopped) for the rest."""
    full = hparams["rope_parameters"]["full_attention"]
    if full["rope_type"] != "proportional":
        raise ValueError("Gemma 4's full-attention rope must be 'proportional'")
    head_dim_full = gemma4_global_shape(hparams)[0]
    rotated = int(head_dim_full * full["partial_rotary_factor"] / 2)
    return torch.tensor([1.0] * rotated + [1e30] * (head_dim_full // 2 - rotated),
                        dtype=torch.float32)


def phi3_rope_dims(hparams: dict[str, Any]) -> int:
    """``Phi3MiniModel``'s rotary width: partial_rotary_factor of the head size."""
    rot_pct = rope_parameters(hparams).get("partial_rotary_factor",
                                           hparams.get("partial_rotary_factor", 1.0))
    return int(rot_pct * hparams["hidden_size"]) // hparams["num_attention_heads"]


def _add_phi3_hparams(writer: gguf.GGUFWriter, hparams: dict[str, Any],
                      ftype: gguf.LlamaFileType) -> None:
    """``Phi3MiniModel.set_gguf_parameters`` and the attention factor its
    ``generate_extra_tensors`` writes for LongRoPE (the factors are tensors)."""
    rope = rope_parameters(hparams)
    orig_ctx = rope["original_max_position_embeddings"]
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(orig_ctx)
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_dimension_count(phi3_rope_dims(hparams))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(ftype)
    writer.add_sliding_window(hparams.get("sliding_window") or 0)  # 0: Phi-4 (none)
    if rope.get("long_factor"):
        scale = hparams["max_position_embeddings"] / orig_ctx
        rope_type = rope.get("rope_type", "").lower()
        if rope_type in ("su", "longrope"):
            factor = math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1 else 1.0
        elif rope_type == "yarn":
            factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        else:
            raise NotImplementedError(f"The rope scaling type {rope_type} is not supported yet")
        writer.add_rope_scaling_attn_factors(factor)
